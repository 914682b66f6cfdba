"""The machine a run uses: its device, the precision that pays there, and how many threads.

Two measured facts drive this module (BENCHMARKS.md):
  * A tiny model on a 2-core machine shared with other work runs ~6x slower with torch's default
    threads than with one: each step waits for a thread that another process preempted. A fixed
    count is wrong on some machine or other, so `ThreadTuner` times real steps at one thread and
    at all cores, keeps the faster, and probes again when steps become several times slower.
  * bf16 is 2-3x faster than fp32 on a CPU with bf16 matrix instructions (AVX512-BF16, AMX).
    On one without, a training batch's products run many times slower (11-15x for torch's
    fallback product, timed with oneDNN switched off), while one row at a time (decoding) can
    still be faster, as half the bytes of weights are read: so `bf16_warning` measures both
    shapes here before it says anything.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch
import torch.nn.functional as F

from glassgpt.errors import ConfigError
from glassgpt.machine.threadsetting import AUTO

T = TypeVar("T")
DEVICE_TYPES = ("cpu", "cuda", "mps")  # where glassgpt trains and samples
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags of bf16 matrix instructions in cpuinfo
# The shapes bf16 is measured on: cpu-small's training batch (12 x 64 tokens) into its MLP
# (width 128), and one token into GPT-2's MLP (width 768), a decoding step's largest product.
BATCH_ROWS, BATCH_WIDTH, ROW_WIDTH = 12 * 64, 128, 768
BF16_CLEARLY_SLOWER = 1.5  # a smaller factor is within what a shared 2-core host's noise makes


# --- bf16 on a CPU ---------------------------------------------------------------------------

def cpu_bf16_support() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX on x86, BF16 on Arm)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # newer torch only
    if probe is not None and probe():
        return True
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if amx is not None and amx():
        return True
    flags = _cpu_flags()
    return any(flag in flags for flag in BF16_FLAGS) or "bf16" in flags  # "bf16": Arm's name


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def measure_bf16_slowdown(rows: int, width: int, rounds: int = 7,
                          clock: Callable[[], float] = time.perf_counter) -> float:
    """How many times slower a bf16 product is than float32 here (> 1: slower), measured now on
    a model's shape: `rows` tokens through an MLP's first matrix (width -> 4 x width).

    A first call is no measure: oneDNN builds its kernel then (and a tiny 256 x 256 product
    once claimed 154x where bf16 sampled faster). So each dtype runs twice untimed; then the
    two alternate for `rounds`, so that a moment when another process holds a core falls on
    both, and the best round of each counts (a busy host only ever adds time)."""
    x = torch.randn(rows, width)  # (rows, C)
    weight = torch.randn(4 * width, width)  # (4C, C), as nn.Linear holds it
    operands = {dtype: (x.to(dtype), weight.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    for x_d, w_d in operands.values():
        for _ in range(2):  # warm-up: the kernel is built, the operands are in cache
            F.linear(x_d, w_d)
    best = dict.fromkeys(operands, math.inf)
    for _ in range(rounds):
        for dtype, (x_d, w_d) in operands.items():
            start = clock()
            F.linear(x_d, w_d)  # (rows, 4C)
            best[dtype] = min(best[dtype], clock() - start)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def bf16_slowdown() -> float:
    """bf16's cost here on a training batch (`BATCH_ROWS` tokens at width `BATCH_WIDTH`)."""
    return measure_bf16_slowdown(BATCH_ROWS, BATCH_WIDTH)


def bf16_row_slowdown() -> float:
    """bf16's cost here on one row at GPT-2's width: what decoding does for each sampled token,
    where reading half the bytes of weights can make bf16 faster even without bf16
    instructions."""
    return measure_bf16_slowdown(1, ROW_WIDTH)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` (this rank's GPU if there is one, else the CPU), or the device named, checked."""
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        else:
            return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"unknown device {name!r:.40}; use auto, cpu, cuda, cuda:N or "
                          f"mps") from None
    if device.type not in DEVICE_TYPES:
        raise ConfigError(f"device {name!r:.40} cannot train or sample here; use auto, cpu, "
                          f"cuda, cuda:N or mps")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device mps was asked for, but MPS is not available here")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but CUDA is not available here")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{device} was asked for, but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s); under torchrun use one "
                          f"process per GPU, or --device cpu")
    return device


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `dtype` on `device`; None means plain float32."""
    if dtype == "auto":
        if device.type != "cuda":
            # On a CPU bf16 is opt-in: it pays off only where the CPU has bf16 instructions
            # (2.6x on shakespeare-char with AVX512-BF16, 1.2x on cpu-small: BENCHMARKS.md),
            # and full precision keeps CPU runs comparable with the documented losses.
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype == "float16" and device.type != "cuda":
        raise ConfigError(f"dtype float16 needs CUDA (it trains with a gradient scaler); "
                          f"use bfloat16 or float32 on {device.type}")
    return {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)




def bf16_warning(device: torch.device) -> str | None:
    """A one-line warning when bf16 was asked for on a CPU without bf16 matrix instructions
    and a model-shaped bf16 product measured clearly slower than float32 here (where it is
    not, nothing is said); it names how much slower, and says so when one row at a time, as
    in decoding, was not slower. None where bf16 is fine."""
    if device.type != "cpu" or cpu_bf16_support():
        return None
    slowdown = bf16_slowdown()
    if slowdown < BF16_CLEARLY_SLOWER:
        return None
    warning = (f"this CPU has no bf16 matrix instructions (avx512_bf16/amx_bf16): a bf16 matmul "
               f"measured {slowdown:.1f}x slower than float32 here; use --dtype float32")
    row = bf16_row_slowdown()
    if row < BF16_CLEARLY_SLOWER:
        warning += (f" to train (one row at a time, as each sampled token is, it measured "
                    f"{row:.1f}x: sampling in bf16 may still pay)")
    return warning


# --- threads ----------------------------------------------------------------------------------

def user_chose_threads() -> bool:
    """Whether OMP_NUM_THREADS is set: then `auto` keeps the count the user asked for."""
    return bool(os.environ.get("OMP_NUM_THREADS"))


class ThreadTuner:
    """Keeps torch's CPU thread count at whichever of 1 and all cores runs the steps faster.

    Feed it each step's duration (`step_done`, or wrap a loop with `tuned`). The first step is
    a warm-up; then `probe_steps` steps run at each candidate count, and the faster count stays.
    If later steps take `degrade_factor` times longer than the chosen count measured (another
    process took a core, say), it probes again. The steps are the real work: nothing is wasted.

    `warm_up_each` leaves the first step at every count untimed, in every probe: under
    `torch.compile` a new thread count is a new graph (dynamo guards on it), so that step is the
    compilation, and timing it would make the compiled count look many times slower.
    """

    def __init__(self, candidates: tuple[int, ...] | None = None, probe_steps: int = 3,
                 degrade_factor: float = 3.0, window: int = 5, warm_up_each: bool = False):
        cores = os.cpu_count() or 1
        self.candidates = candidates or tuple(sorted({1, cores}))
        self.probe_steps, self.degrade_factor, self.window = probe_steps, degrade_factor, window
        self.warm_up_each = warm_up_each
        self.threads = torch.get_num_threads()
        self.probes = 0  # how many times the candidates were measured
        self.baseline: float | None = None  # seconds per step of the chosen count
        self._warmed_up = warm_up_each  # then each count's first step is the warm-up
        self._plan: list[tuple[int, bool]] = []  # (thread count, timed) of the coming steps
        self._timings: dict[int, list[float]] = {}
        self._recent: list[float] = []
        if len(self.candidates) > 1:
            self._start_probe()

    def _start_probe(self) -> None:
        warm_up = [False] if self.warm_up_each else []
        self._plan = [(n, timed) for n in self.candidates
                      for timed in warm_up + [True] * self.probe_steps]
        self._timings = {n: [] for n in self.candidates}
        self._recent = []

    def _set(self, threads: int) -> None:
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.threads = threads

    def before_step(self) -> None:
        """Set the thread count the next step runs with (the warm-up runs at the first
        candidate, one thread: all cores on a machine whose other work holds one can make a
        step many times slower)."""
        if self._plan:
            self._set(self._plan[0][0])

    def step_done(self, seconds: float) -> None:
        """Record the step that just ran (after `before_step`)."""
        if not self._warmed_up:
            self._warmed_up = True
            return
        if self._plan:
            threads, timed = self._plan.pop(0)
            if timed:
                self._timings[threads].append(seconds)
                self._drop_if_collapsed(threads, seconds)
            if not self._plan:
                self._choose()
            return
        self._recent = (self._recent + [seconds])[-self.window:]
        if (self.baseline is not None and len(self._recent) == self.window
                and statistics.median(self._recent) > self.degrade_factor * self.baseline):
            self._start_probe()

    def _drop_if_collapsed(self, threads: int, seconds: float) -> None:
        """One probe step `degrade_factor` times slower than another count's median is
        enough: that count's other probe steps are dropped (each could cost seconds)."""
        others = [statistics.median(t) for n, t in self._timings.items() if t and n != threads]
        if others and seconds > self.degrade_factor * min(others):
            self._plan = [(n, timed) for n, timed in self._plan if n != threads]

    def _choose(self) -> None:
        medians = {n: statistics.median(t) for n, t in self._timings.items() if t}
        best = min(medians, key=medians.__getitem__)
        self._set(best)
        self.baseline = medians[best]
        self.probes += 1

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Run one step (the block) with the thread count the tuner sets, and time it."""
        self.before_step()
        started = time.perf_counter()
        yield
        self.step_done(time.perf_counter() - started)

    def tuned(self, steps: Iterable[T]) -> Iterator[T]:
        """The items of `steps`, each timed and run with the thread count the tuner sets."""
        iterator = iter(steps)
        while True:
            self.before_step()
            start = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            self.step_done(time.perf_counter() - start)
            yield item

    def describe(self) -> str:
        if len(self.candidates) == 1:
            return cpu_threads(self.threads)
        return (f"threads auto ({' or '.join(map(str, self.candidates))}, chosen by timing the "
                f"first steps)")


def cpu_threads(count: int | None = None) -> str:
    """"1 CPU thread", "2 CPU threads": `count`, or the number torch uses now."""
    count = torch.get_num_threads() if count is None else count
    return f"{count} CPU thread{'s' if count > 1 else ''}"


def tuner_for(setting: int | str | None, device: torch.device,
              compiled: bool = False) -> ThreadTuner | None:
    """Apply a `threads` setting (glassgpt.machine.threadsetting) on a CPU: a count is set now;
    `auto` gives a tuner that times the caller's own steps (`compiled` steps: each count's first
    step untimed, ThreadTuner's `warm_up_each`). None where there is nothing to tune (a GPU, one
    core, a user's OMP_NUM_THREADS, a setting of None)."""
    if device.type != "cpu" or setting is None:
        return None
    if setting != AUTO:
        torch.set_num_threads(int(setting))
        return None
    if user_chose_threads():
        return None
    tuner = ThreadTuner(warm_up_each=compiled)
    return tuner if len(tuner.candidates) > 1 else None


def settle_threads(setting: int | str | None, device: torch.device,
                   step: Callable[[], object]) -> int:
    """Apply a `threads` setting for an entry point that runs one piece of work rather than a
    loop of steps (a picture, a page, an experiment): a count is set now; `auto` times `step`,
    the entry point's own unit of work, once to warm up and then a few times at each candidate
    count, and keeps the faster. Returns the count torch uses afterwards."""
    tuner = tuner_for(setting, device)
    if tuner is not None:
        runs = 1 + tuner.probe_steps * len(tuner.candidates)  # a warm-up, then each count
        for _ in tuner.tuned(step() for _ in range(runs)):
            pass
    return torch.get_num_threads()


def timed(tuner: ThreadTuner | None) -> contextlib.AbstractContextManager:
    """`tuner.step()`, or nothing to time when there is no tuner."""
    return tuner.step() if tuner is not None else contextlib.nullcontext()
