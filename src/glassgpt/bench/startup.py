"""How long the command line takes to answer before any work: `glassgpt --help`, a
subcommand's `--help` and a mistyped flag, each a fresh process, beside `python -c "import
torch"` on the same machine (the floor that every command importing torch pays)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

# (label, arguments after `python`), the first the reference every other is set against
STARTUP_COMMANDS = (
    ("python -c 'import torch'", ["-c", "import torch"]),
    ("glassgpt --help", ["-m", "glassgpt", "--help"]),
    ("glassgpt train --help", ["-m", "glassgpt", "train", "--help"]),
    ("glassgpt sample --help", ["-m", "glassgpt", "sample", "--help"]),
    ("glassgpt train --n-layr 2 (a typo)", ["-m", "glassgpt", "train", "--n-layr", "2"]),
)


@dataclass
class StartupResult:
    command: str
    median_s: float
    best_s: float
    vs_import_torch: float  # median time / the median of `import torch`


def time_process(args: list[str]) -> float:
    """Wall seconds of one fresh Python process running `args` (its output discarded)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def measure_startup(rounds: int = 5) -> list[StartupResult]:
    """Every command of STARTUP_COMMANDS `rounds` times, interleaved so that a busy moment of
    a shared machine falls on all of them alike."""
    times: dict[str, list[float]] = {label: [] for label, _ in STARTUP_COMMANDS}
    for _ in range(rounds):
        for label, args in STARTUP_COMMANDS:
            times[label].append(time_process(args))
    reference = statistics.median(times[STARTUP_COMMANDS[0][0]])
    return [StartupResult(label, statistics.median(t), min(t),
                          statistics.median(t) / reference) for label, t in times.items()]
