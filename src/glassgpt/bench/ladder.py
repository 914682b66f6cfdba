"""Time to loss: the speedrun ladder, one change at a time (`glassgpt bench ladder`).

Each rung is the rung before it plus one change, in the order the GPT-2 speedrun took them:
nanoGPT's recipe, a tuned learning rate, Muon, rotary positions, ReLU^2, QK-norm, zero-initialised
projections with soft-capped logits, `torch.compile`, a bigger batch, then bf16 autocast (on a
CPU with bf16 instructions) and a cosine that ends where the target is crossed. Every rung trains on
the same data (Tiny Shakespeare, character level), from the same seed, with the same evaluation
(the same number of val tokens, drawn from the same seeded stream, every `EVAL_TOKENS` training
tokens), until the first evaluation at or below the target val loss (`TrainConfig.target_loss`).

What is timed is the trainer's whole run (glassgpt.training.trainer.Trainer.run): every step, every
evaluation, every checkpoint written, compiling and thread tuning included; building the model
and loading the data are not (the same for every rung). One seed's timing on a busy machine is
noisy, so a gain smaller than `NOISE` is called close, and with several seeds (`seeds`,
`recheck_close`) a gain whose range of times overlaps the previous rung's is within noise.

Library only: `run_ladder` returns a `LadderReport`; the CLI prints it (glassgpt.cli.ladder).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glassgpt.bench.report import machine_info
from glassgpt.config import NOISE, TARGET_LOSS, GPTConfig, TrainConfig, load_preset
from glassgpt.data import PreparedData
from glassgpt.errors import ConfigError
from glassgpt.figures import LABEL_PT, label_axes, new_figure, save_figure
from glassgpt.machine.devices import cpu_bf16_support
from glassgpt.model import GPT, count_parameters
from glassgpt.training.evaluate import evaluate
from glassgpt.training.trainer import NonFiniteLossError, Trainer

BASE_PRESET = "cpu-small"  # nanoGPT's CPU recipe: 4 layers, 4 heads, width 128, context 64
MAX_PARAMETERS = 1_000_000
EVAL_TOKENS = 50 * 12 * 64  # training tokens between evaluations: 50 steps of the base rung
EVAL_VAL_TOKENS = 20 * 12 * 64  # tokens per split in an evaluation: the base rung's 20 batches
FULL_VAL_BATCHES = 64  # the untimed final score: 64 x 32 windows, the whole val split
# Each seed trains every rung again (about 9 minutes on a laptop's CPU): 20 seeds are 3 hours,
# more would not finish in a working day.
MAX_SEEDS = 20

# --quick: the same rungs at a toy size, for tests (seconds, not minutes); compiling is left out.
# 60 steps with an evaluation every 5 let every rung reach QUICK_TARGET (nanoGPT's lr, the
# slowest, at about step 35; the others by step 15), so the table compares times.
QUICK_MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}
QUICK_TRAIN = {"max_iters": 60, "batch_size": 8, "warmup_iters": 2, "eval_interval": 5,
               "eval_iters": 2, "log_interval": 5, "compile": False}
QUICK_SKIPS = ("compile",)


@dataclass(frozen=True)
class Rung:
    """One rung: the settings it trains with (its own change and every one before it)."""

    name: str
    change: str  # what this rung adds, in a few words
    model: dict[str, Any]
    train: dict[str, Any]
    threads: int | str | None = None  # Trainer(threads=...): None leaves torch's setting


# name, change, model settings added, training settings added, threads (None: unchanged)
LADDER: list[tuple[str, str, dict[str, Any], dict[str, Any], int | str | None]] = [
    ("nanogpt", "nanoGPT's recipe: AdamW lr 1e-3, cosine over 2000 steps", {}, {}, None),
    ("tuned-lr", "AdamW lr 3e-3, cosine over 1500 steps", {},
     {"lr": 3e-3, "min_lr": 3e-4, "max_iters": 1500}, None),
    ("muon", "Muon (lr 0.03) for the hidden matrices", {},
     {"optimizer": "muon", "muon_lr": 0.03}, None),
    ("rotary", "rotary positions instead of a learned table", {"position": "rope"}, {}, None),
    ("relu2", "ReLU^2 MLP instead of GELU", {"activation": "relu2"}, {}, None),
    ("qk-norm", "RMSNorm on queries and keys", {"qk_norm": True}, {}, None),
    ("zero-init-softcap", "zero-initialised projections, logits soft-capped at 15",
     {"zero_init_proj": True, "logit_softcap": 15.0}, {}, None),
    ("compile", "torch.compile (compiling is timed)", {}, {"compile": True}, None),
    ("batch-threads", "batch 24 at a sqrt(2) higher lr, warmup 50, cosine over 400 steps; "
     "threads chosen by timing", {},
     {"batch_size": 24, "lr": 4.2e-3, "min_lr": 4.2e-4, "muon_lr": 0.042, "max_iters": 400,
      "warmup_iters": 50}, "auto"),
    ("bf16", "bf16 autocast (where the CPU has bf16 matrix instructions: avx512_bf16, AMX)",
     {}, {"dtype": "bfloat16"}, None),
    ("short-cosine", "cosine over 240 steps: the lr has decayed where the target is crossed",
     {}, {"max_iters": 240}, None),
]
# Skipped on a CPU without bf16 instructions, where bf16 is many times slower (not in --quick:
# a toy size stays seconds).
BF16_RUNGS = ("bf16", "short-cosine")


# The preset cpu-speedrun is the last rung's recipe without this: compiled cold (no inductor
# cache yet, as on a first run), compiling took most of the rung's time on two cores, more than
# it saves in a run that reaches the target in well under a minute (docs/time-to-loss.md).
SPEEDRUN_PRESET = "cpu-speedrun"
SPEEDRUN_LEAVES_OUT = {"compile": False}
# ... and it stops lower than the ladder's target: its evaluation (the same seeded 15,360 val
# tokens every time) read 0.019-0.023 below the whole val split in every run measured, and
# `glassgpt eval` of a run (the whole split) must say TARGET_LOSS.
SPEEDRUN_TARGET = 1.86


def ladder_rungs() -> list[Rung]:
    """The rungs in order, each with every change up to it."""
    preset = load_preset(BASE_PRESET)
    model, train = dict(preset["model"]), dict(preset["train"])
    threads: int | str | None = None
    rungs = []
    for name, change, model_changes, train_changes, rung_threads in LADDER:
        model.update(model_changes)
        train.update(train_changes)
        threads = rung_threads if rung_threads is not None else threads
        rungs.append(Rung(name, change, dict(model), dict(train), threads))
    return rungs


@dataclass
class RungRun:
    """One training run of a rung (one seed)."""

    seed: int
    reached: bool
    steps: int | None  # to the first evaluation at or below the target
    seconds: float | None  # wall seconds of the run to that evaluation, evaluations included
    iterations: int  # trained in all (max_iters when the target was not reached)
    total_seconds: float
    tokens_per_s: float  # training tokens per second of the steps (median of the log lines)
    val_loss: float  # at the last evaluation
    full_val_loss: float  # the stopped weights on the whole val split (untimed)
    curve: list[tuple[float, float]]  # (seconds, val loss) at every evaluation
    # Of the seconds to the target, the share spent outside training steps at their median
    # speed: evaluations, checkpoints, compiling, thread tuning, slow first steps.
    overhead_share: float | None = None
    # CPU seconds of this process over the whole run, every thread: on a machine shared with
    # other work, less at the mercy of the load than wall seconds.
    cpu_seconds: float | None = None


@dataclass
class RungResult:
    name: str
    change: str
    parameters: int
    model: dict[str, Any]
    train: dict[str, Any]
    threads: int | str | None
    runs: list[RungRun] = field(default_factory=list)
    skipped: str | None = None  # why this rung did not run
    gain_over_previous: float | None = None  # previous rung's seconds / this rung's
    gain_over_base: float | None = None
    verdict: str = ""  # "faster", "slower", "close", "within noise", ...

    def seconds(self) -> float | None:
        """Median seconds to the target over seeds; None unless every seed reached it."""
        if not self.runs or not all(r.reached for r in self.runs):
            return None
        return statistics.median(r.seconds for r in self.runs)

    def seconds_range(self) -> tuple[float, float] | None:
        if self.seconds() is None:
            return None
        return min(r.seconds for r in self.runs), max(r.seconds for r in self.runs)

    def median(self, name: str) -> float | None:
        values = [getattr(r, name) for r in self.runs if getattr(r, name) is not None]
        return statistics.median(values) if values else None


@dataclass
class LadderReport:
    machine: dict[str, Any]
    target_loss: float
    quick: bool
    rungs: list[RungResult]
    seconds: float  # the whole ladder

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for rung in self.rungs:
            row = dataclasses.asdict(rung)
            row.update(seconds_to_target=rung.seconds(), seconds_range=rung.seconds_range(),
                       steps_to_target=rung.median("steps"),
                       tokens_per_s=rung.median("tokens_per_s"),
                       final_val_loss=rung.median("val_loss"),
                       full_val_loss=rung.median("full_val_loss"),
                       cpu_seconds=rung.median("cpu_seconds"))
            rows.append(row)
        return {"machine": self.machine, "target_loss": self.target_loss, "quick": self.quick,
                "seconds": self.seconds, "rungs": rows}


class _EvalClock:
    """A trainer reporter that keeps (seconds since the start, val loss) of each evaluation
    and the tokens/s of each log line."""

    def __init__(self) -> None:
        self.start_time = time.perf_counter()
        self.curve: list[tuple[float, float]] = []
        self.speeds: list[float] = []

    def start(self, total: int, done: int) -> None:
        self.start_time = time.perf_counter()

    def log(self, record: dict[str, Any]) -> None:
        self.speeds.append(record["tokens_per_s"])

    def eval(self, record: dict[str, Any]) -> None:
        self.curve.append((time.perf_counter() - self.start_time, record["val_loss"]))

    def stop(self) -> None: ...


def rung_settings(rung: Rung, target_loss: float, quick: bool, seed: int
                  ) -> tuple[dict[str, Any], TrainConfig]:
    """The model settings and training config of one run of `rung`: its own recipe, with the
    ladder's evaluation scaled to its batch (the same tokens between evaluations and in each)."""
    model, train = dict(rung.model), dict(rung.train)
    if quick:
        model.update(QUICK_MODEL)
        train.update(QUICK_TRAIN)
    else:
        tokens_per_step = train["batch_size"] * model["block_size"] * train.get("grad_accum", 1)
        train["eval_interval"] = max(1, round(EVAL_TOKENS / tokens_per_step))
        train["eval_iters"] = max(1, round(EVAL_VAL_TOKENS / (train["batch_size"]
                                                              * model["block_size"])))
    train.update(target_loss=target_loss, seed=seed, device="cpu")
    return model, TrainConfig.from_dict(train)


def missing_switches(rung: Rung) -> list[str]:
    """Model settings of `rung` that this GPTConfig does not have (yet)."""
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    return sorted(set(rung.model) - known)


def train_rung(rung: Rung, data: PreparedData, target_loss: float, quick: bool,
               seed: int) -> tuple[RungRun, int]:
    """Train one seed of `rung` to the target in a scratch run directory; (its run, params)."""
    model_settings, cfg = rung_settings(rung, target_loss, quick, seed)
    torch.manual_seed(seed)  # as runs.build_model: the same initial weights for a seed
    model = GPT(GPTConfig.from_dict({**model_settings, "vocab_size": data.vocab_size}))
    parameters = count_parameters(model)
    clock = _EvalClock()
    threads_before = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory(prefix="glassgpt-ladder-") as run_dir:
            trainer = Trainer(model, cfg, data, run_dir, clock, threads=rung.threads)
            cpu_start = time.process_time()
            result = trainer.run()
            cpu_seconds = time.process_time() - cpu_start
        trainer.model.eval()
        with torch.no_grad():
            full = evaluate(trainer.model, data.splits["val"], data.tokenizer, 32,
                            2 if quick else FULL_VAL_BATCHES, trainer.device)
    finally:
        torch.set_num_threads(threads_before)  # the next rung starts from the same setting
    speeds = clock.speeds[1:] or clock.speeds  # the first interval holds warm-up
    tokens_per_s = statistics.median(speeds) if speeds else 0.0
    overhead = None
    if result.target_reached and tokens_per_s > 0:
        step_seconds = result.target_iteration * trainer.tokens_per_step / tokens_per_s
        overhead = max(0.0, 1 - step_seconds / result.target_seconds)
    run = RungRun(seed, result.target_reached, result.target_iteration, result.target_seconds,
                  result.iteration, result.seconds, tokens_per_s, result.val_loss, full.loss,
                  clock.curve, overhead, cpu_seconds)
    return run, parameters


def check_ladder_request(target_loss: float, seeds: int, recheck_close: int) -> None:
    """Refuse a ladder that cannot give an answer: a target no loss reaches (a cross-entropy is
    positive), or more seeds than finish in a day."""
    if not isinstance(target_loss, int | float) or not 0 < target_loss < math.inf:
        raise ConfigError(f"the target loss must be a positive number (a cross-entropy is "
                          f"never below 0), got {target_loss}")
    for name, value, least in (("seeds", seeds, 1), ("recheck_close", recheck_close, 0)):
        if not isinstance(value, int) or not least <= value <= MAX_SEEDS:
            raise ConfigError(f"{name} must be between {least} and {MAX_SEEDS} (each seed "
                              f"trains every rung again), got {value}")


def run_ladder(data: PreparedData, target_loss: float = TARGET_LOSS, quick: bool = False,
               seeds: int = 1, recheck_close: int = 0, seed: int = 1337,
               only: list[str] | None = None,
               progress: Callable[[str], Any] | None = None) -> LadderReport:
    """Train every rung (or those named in `only`, in ladder order) to `target_loss`.

    `seeds` runs each rung from that many seeds (seed, seed + 1, ...); `recheck_close` then
    gives every rung whose gain over the previous one is close (under NOISE) and that previous
    rung that many seeds in all, so that the verdict says whether the gain is within noise.
    """
    check_ladder_request(target_loss, seeds, recheck_close)
    rungs = ladder_rungs()
    names = [r.name for r in rungs]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise ConfigError(f"unknown rungs {unknown}; the ladder has {names}")
    rungs = [r for r in rungs if not only or r.name in only]
    start = time.perf_counter()
    machine = machine_info()
    results = [RungResult(r.name, r.change, 0, r.model, r.train, r.threads) for r in rungs]

    def train_seeds(index: int, count: int) -> None:
        rung, result = rungs[index], results[index]
        while result.skipped is None and len(result.runs) < count:
            run_seed = seed + len(result.runs)
            if progress is not None:
                progress(f"rung {index + 1}/{len(rungs)} {rung.name} (seed {run_seed})")
            try:
                run, result.parameters = train_rung(rung, data, target_loss, quick, run_seed)
            except (RuntimeError, NonFiniteLossError) as error:  # a compiler failed, or the
                # rung's learning rate diverged: say so, go on with the next
                result.skipped = f"failed: {str(error).splitlines()[0][:200]}"
                return
            result.runs.append(run)

    for index, (rung, result) in enumerate(zip(rungs, results, strict=True)):
        missing = missing_switches(rung)
        if missing:
            result.skipped = f"this GPTConfig has no {missing}"
        elif quick and rung.name in QUICK_SKIPS:
            result.skipped = "left out of --quick (compiling takes a minute)"
        elif rung.name in BF16_RUNGS and not quick and not cpu_bf16_support():
            result.skipped = "this CPU has no bf16 matrix instructions (avx512_bf16, AMX)"
        train_seeds(index, seeds)
    if recheck_close > seeds:
        judge_gains(results)
        for index, result in enumerate(results):
            if result.verdict == "close" and index > 0:
                train_seeds(index - 1, recheck_close)
                train_seeds(index, recheck_close)
    judge_gains(results)
    machine["load_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return LadderReport(machine, target_loss, quick, results, time.perf_counter() - start)


def judge_gains(results: list[RungResult]) -> None:
    """Gains over the previous rung that ran and over the base, and a verdict on each."""
    ran = [r for r in results if r.skipped is None]
    base = ran[0].seconds() if ran else None
    for previous, result in zip([None, *ran], ran, strict=False):
        seconds = result.seconds()
        before = previous.seconds() if previous is not None else None
        result.gain_over_base = base / seconds if base and seconds else None
        result.gain_over_previous = before / seconds if before and seconds else None
        result.verdict = _verdict(previous, result)


def _verdict(previous: RungResult | None, result: RungResult) -> str:
    if previous is None:
        return "base" if result.seconds() is not None else "target not reached"
    if result.seconds() is None:
        return "target not reached"
    if previous.seconds() is None:
        return "reached (the previous rung did not)"
    gain = result.gain_over_previous
    if len(result.runs) > 1 and len(previous.runs) > 1:
        low, high = result.seconds_range()
        prev_low, prev_high = previous.seconds_range()
        if low <= prev_high and prev_low <= high:
            return "within noise"
        return "faster" if gain > 1 else "slower"
    if abs(gain - 1) < NOISE:
        return "close"
    return "faster" if gain > 1 else "slower"


def plot_ladder(report: LadderReport, path: Path) -> Path:
    """Val loss against wall seconds, one line per rung (its first seed), the target dashed."""
    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    for rung in report.rungs:
        if not rung.runs:
            continue
        seconds, losses = zip(*rung.runs[0].curve, strict=True)
        ax.plot(seconds, losses, marker=".", linewidth=1.2, label=rung.name)
    ax.axhline(report.target_loss, color="black", linestyle="--", linewidth=0.8,
               label=f"target {report.target_loss:g}")
    ax.set_ylim(report.target_loss - 0.25, report.target_loss + 1.2)
    label_axes(ax, "wall seconds (evaluations and compiling included)", "val loss",
               "Time to loss, one change at a time" + (" (--quick)" if report.quick else ""))
    ax.legend(fontsize=LABEL_PT, loc="upper right")
    ax.grid(alpha=0.3)
    return save_figure(fig, path)
