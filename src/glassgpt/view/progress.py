"""How far the model thread is through a long request (patching: hundreds of forward passes),
read by `GET /api/progress` while that request runs.

The model thread reports `(done, total)` forward passes through `Progress.reporter`; the event
loop answers the page's polls from the last report, without waiting for the model thread (it is
busy with the very request the page asks about). The estimate of the seconds left assumes the
passes still to run take as long as the ones done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Report:
    task: str
    done: int
    total: int
    started: float  # time.perf_counter() at the job's first report
    at: float  # time.perf_counter() at this report


class Progress:
    """The last report of the newest long job (one model thread runs one job at a time)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.lock = threading.Lock()
        self.last: Report | None = None

    def reporter(self, task: str) -> Callable[[int, int], None]:
        """A `progress(done, total)` callback for one job named `task`: its first call (done 0,
        before any pass runs) starts the job's clock."""
        started: list[float] = []

        def report(done: int, total: int) -> None:
            now = self.clock()
            if not started:
                started.append(now)
            with self.lock:
                self.last = Report(task, done, total, started[0], now)
        return report

    def answer(self) -> dict[str, Any]:
        """{task, done, total, running, seconds, seconds_left} of the newest job (task None:
        none has run yet). seconds_left is None until one pass is done."""
        with self.lock:
            last = self.last
        if last is None:
            return {"task": None, "done": 0, "total": 0, "running": False, "seconds": 0.0,
                    "seconds_left": None}
        running = last.done < last.total
        seconds = (self.clock() if running else last.at) - last.started
        left = None
        if last.done > 0:
            left = (last.at - last.started) / last.done * (last.total - last.done)
        return {"task": last.task, "done": last.done, "total": last.total, "running": running,
                "seconds": round(seconds, 3), "seconds_left": None if left is None
                else round(left, 1)}
