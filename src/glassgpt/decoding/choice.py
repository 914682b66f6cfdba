"""Which eager CPU engine decodes faster on this host: measured, never assumed.

The threaded one-row products (`CPUEngine`) were 1.31x the plain model on one 2-core AMD host
and 0.86x on a 2-core Intel one (BENCHMARKS.md): whether splitting a one-row product over the
threads pays depends on the CPU, the matrix widths and the dtype. So "auto" times a few cached
steps of both, in interleaved rounds, and keeps the faster, once per process for each model
shape, dtype and thread count (a GPT-2 small costs about a quarter of a second, a small model
milliseconds). The plain model wins ties and near-ties: the threaded engine is only chosen
where its median step is more than `CHOICE_MARGIN` faster, so that the noise of a few timed
steps on a busy host does not pick an engine that is slower on average. Timing costs about
eight steps (a warm-up and `CHOICE_ROUNDS` for each engine), more than a short continuation
could win back, so fewer than `MEASURED_FROM` new tokens are decoded by the plain model
untimed (`auto_engine_name`): on a 0.6B model eight timed steps were 8 of 24 seconds of an
8-token `sample`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from glassgpt.decoding.cpu import CPUEngine
from glassgpt.decoding.engine import EagerEngine

CHOICE_ROUNDS = 3  # timed steps per engine, after one untimed warm-up step each
CHOICE_MARGIN = 0.05  # how much faster than the plain model an engine must be to be chosen
MEASURED_FROM = 64  # new tokens: below, "auto" on a CPU is the plain model, untimed
PLAIN, THREADED = EagerEngine.name, CPUEngine.name
Timer = Callable[[dict[str, EagerEngine]], dict[str, list[float]]]

# (model class, config, dtype, threads) -> the engine name measured faster
_choices: dict[tuple[Any, ...], str] = {}


def faster_engine(seconds: dict[str, list[float]], margin: float = CHOICE_MARGIN) -> str:
    """The engine of `seconds` (name -> seconds of its timed steps) with the lowest median;
    the plain model unless another's median is more than `margin` below its own."""
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    best = min(medians, key=medians.__getitem__)
    if PLAIN in medians and medians[best] >= (1 - margin) * medians[PLAIN]:
        return PLAIN
    return best


def step_seconds(engines: dict[str, EagerEngine], rounds: int = CHOICE_ROUNDS
                 ) -> dict[str, list[float]]:
    """Seconds of single cached steps of each engine, in interleaved, rotating rounds.

    Each engine gets a two-position cache, a one-token prefill, then steps that rewrite
    position 1 (the same work as any early step of a real decoding).
    """
    names = list(engines)
    token = torch.zeros(1, 1, dtype=torch.long, device=_device(engines[names[0]].model))
    seconds: dict[str, list[float]] = {name: [] for name in names}
    try:
        with torch.no_grad():
            for engine in engines.values():
                engine.start(1, 2)
                engine.prefill(token)
                engine.step(token, 1)  # warm-up: first-touch allocations, library setup
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    start = time.perf_counter()
                    engines[name].step(token, 1)
                    seconds[name].append(time.perf_counter() - start)
    finally:
        for engine in engines.values():
            engine.close()
    return seconds


def measured_cpu_engine(model: Any, timer: Timer = step_seconds) -> EagerEngine:
    """The plain model or the threaded engine for `model` on a CPU, whichever `timer` finds
    faster (measured once per model shape, dtype and thread count)."""
    threads = torch.get_num_threads()
    weight = next(model.parameters(), None)
    # One thread, or weights other than float32: the threaded products are then F.linear
    # (`ThreadedLinear`), so the engine could only add overhead; nothing to time.
    if (threads == 1 or weight is None or weight.dtype != torch.float32
            or model.config.block_size < 2):
        return EagerEngine(model)
    key = (type(model), repr(model.config), weight.dtype, threads)
    if key not in _choices:
        _choices[key] = faster_engine(timer({PLAIN: EagerEngine(model),
                                             THREADED: CPUEngine(model)}))
    return CPUEngine(model) if _choices[key] == THREADED else EagerEngine(model)


def auto_engine_name(model: Any, new_tokens: int, compiled: bool) -> str:
    """The engine name "auto" stands for in a decoding of `new_tokens`: "eager" (the plain
    model) for a short uncompiled one on a CPU, where timing the engines would cost more than
    it could save; "auto" (measured, or the device's engine) otherwise."""
    if not compiled and new_tokens < MEASURED_FROM and _device(model).type == "cpu":
        return PLAIN
    return "auto"


def forget_choices() -> None:
    """Measure again at the next "auto" (after the host's load or threads changed)."""
    _choices.clear()


def _device(model: Any) -> torch.device:
    return next(model.parameters(), Tensor()).device
