"""CPU threads under a competing load: torch's default count, fixed counts, and `auto`.

A second process spinning on one core is the busy machine that made the quick start ~6x slower
with torch's default threads. Each setting trains the same steps of the same model in
interleaved rounds while the spinner runs; `auto` starts each round with a fresh
`devices.ThreadTuner`, so its probing steps are part of what it is timed on.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from glassgpt.bench.measure import bench_model
from glassgpt.bench.training import bench_train_config, train_stepper
from glassgpt.machine.devices import ThreadTuner

DEFAULT, AUTO = "torch default", "auto"


@dataclass
class ThreadSpeed:
    preset: str
    setting: str  # "torch default", "1", "2", ..., "auto"
    threads_used: int  # at the end of the last round
    competing_load: bool
    tokens_per_s: float  # median round
    step_seconds: float


@contextlib.contextmanager
def competing_load(active: bool = True) -> Iterator[None]:
    """A second process that keeps one core busy for as long as the block runs."""
    if not active:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it get scheduled
        yield
    finally:
        spinner.kill()
        spinner.wait()


def bench_threads(preset: str = "cpu-small", steps: int = 30, rounds: int = 3,
                  load: bool = True, batch_size: int | None = None) -> list[ThreadSpeed]:
    """Training tokens/s of each thread setting, with a spinner on one core when `load`."""
    cores = os.cpu_count() or 1
    default = torch.get_num_threads()
    settings = [DEFAULT, *sorted({"1", str(cores)}), AUTO]
    model = bench_model(preset)
    cfg = bench_train_config(preset, batch_size)
    data = torch.randint(0, model.config.vocab_size, (cfg.batch_size, model.config.block_size + 1))
    step = train_stepper(model, cfg, (data[:, :-1], data[:, 1:]))
    step()  # the optimizer allocates its state on the first step
    seconds: dict[str, list[float]] = {s: [] for s in settings}
    used: dict[str, int] = {}
    try:
        with competing_load(load):
            for r in range(rounds):
                for setting in settings[r % len(settings):] + settings[:r % len(settings)]:
                    seconds[setting].append(_time_steps(step, steps, setting, default))
                    used[setting] = torch.get_num_threads()
    finally:
        torch.set_num_threads(default)
    tokens = steps * cfg.batch_size * model.config.block_size
    return [ThreadSpeed(preset, s, used[s], load, tokens / statistics.median(t),
                        statistics.median(t) / steps) for s, t in seconds.items()]


def _time_steps(step: Callable[[], Any], steps: int, setting: str, default: int) -> float:
    """Seconds for `steps` training steps at `setting` (auto: a fresh tuner decides)."""
    work = (step() for _ in range(steps))
    if setting == AUTO:
        work = ThreadTuner().tuned(work)
    else:
        torch.set_num_threads(default if setting == DEFAULT else int(setting))
    start = time.perf_counter()
    for _ in work:
        pass
    return time.perf_counter() - start
