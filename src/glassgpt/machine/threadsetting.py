"""The one shape of a thread setting, at every entry point: `threads: int | "auto" | None`.

    an int    that many CPU threads (checked against the machine: at most 4x its cores)
    "auto"    time the entry point's own steps at one thread and at all cores, keep the faster
              (glassgpt.machine.devices.ThreadTuner); a user's OMP_NUM_THREADS is kept
    None      leave torch's setting alone

Each entry point (train, sample/generate, eval, the demos, the view) builds its own tuner from
the setting (`devices.tuner_for`) and reports the count it chose in its result. This module
imports neither torch nor anything of glassgpt but the errors, so the command line can parse
`--threads` before any heavy import.
"""

from __future__ import annotations

import os

from glassgpt.errors import ConfigError

AUTO = "auto"
ThreadSetting = int | str | None


def parse_threads(value: str | int) -> int | str:
    """`auto` or a positive thread count no larger than a few times the machine's cores."""
    if value == AUTO:
        return AUTO
    try:
        threads = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"threads must be a positive integer or auto, got {value!r:.40}") \
            from None
    most = 4 * (os.cpu_count() or 1)  # beyond that, threads only thrash (or crash OpenMP)
    if not 0 < threads <= most:
        raise ConfigError(f"threads must be between 1 and {most} on this machine, got {threads}")
    return threads
