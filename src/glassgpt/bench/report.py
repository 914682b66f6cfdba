"""The whole report: every figure of a `glassgpt bench` run, and the speed-ups between them."""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from glassgpt.bench.decoding import (
    DecodeSpeed,
    PrecisionCost,
    bench_decoding,
    check_decode_length,
    precision_cost,
)
from glassgpt.bench.measure import (
    FP32,
    GLASSGPT,
    GLASSGPT_COMPILED,
    GLASSGPT_EAGER,
    HF,
    LimitProbes,
    MachineLimits,
    measure_limits,
)
from glassgpt.bench.profiles import OpShare, profile_decode_step, profile_train_step
from glassgpt.bench.training import TrainSpeed, bench_training
from glassgpt.config import NEW_TOKENS, PROMPT_LEN, GPTConfig, load_preset
from glassgpt.errors import ConfigError


@dataclass
class Speedup:
    """glassgpt's best tokens/s over a reference contender's, for one preset and workload."""

    workload: str  # "train" or "decode"
    preset: str
    contender: str
    reference: str
    ratio: float


def speedups(report: BenchReport) -> list[Speedup]:
    """Each glassgpt training contender (bf16 autocast included) against HF's fp32 step; each
    glassgpt fp32 decoder against HF, and cached against uncached decoding."""
    out = []
    for preset in sorted({r.preset for r in report.train}):
        rows = {(r.contender, r.dtype): r for r in report.train if r.preset == preset}
        hf = rows.get((HF, FP32))
        out += [Speedup("train", preset, name if dtype == FP32 else f"{name} {dtype}", HF,
                        row.tokens_per_s / hf.tokens_per_s)
                for (name, dtype), row in rows.items() if name != HF and hf is not None]
    for preset in sorted({r.preset for r in report.decode}):
        rows = {(r.contender, r.cache): r for r in report.decode
                if r.preset == preset and r.dtype == FP32}
        for name in (GLASSGPT, GLASSGPT_COMPILED):
            ours = rows.get((name, True))
            for key, label in (((HF, True), "hf"), ((GLASSGPT_EAGER, True), GLASSGPT_EAGER),
                               ((GLASSGPT, False), "glassgpt no-cache"),
                               ((HF, False), "hf no-cache")):
                if ours is not None and key in rows:
                    out.append(Speedup("decode", preset, name, label,
                                       ours.tokens_per_s / rows[key].tokens_per_s))
    return out


# Dense bf16 tensor-core peaks from NVIDIA's datasheets (FLOP/s), by a name fragment of the GPU.
DATASHEET_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                        "A10": 125e12, "L4": 121e12, "4090": 165e12, "3090": 71e12}


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "load_before": _load_average(),
            "device": str(device)}
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(device)
        info["gpu"] = name
        info["datasheet_bf16_flops"] = next(
            (peak for key, peak in DATASHEET_BF16_FLOPS.items() if key in name), None)
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _load_average() -> float | None:
    """The 1-minute load average: other processes competing for the cores during the run."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@dataclass
class BenchReport:
    machine: dict[str, Any]
    limits: MachineLimits
    train: list[TrainSpeed] = field(default_factory=list)
    decode: list[DecodeSpeed] = field(default_factory=list)
    precision: list[PrecisionCost] = field(default_factory=list)
    profile: list[OpShare] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["speedups"] = [dataclasses.asdict(s) for s in speedups(self)]
        return data


def run_benchmarks(workload: str, train_presets: list[str], decode_presets: list[str],
                   against_hf: bool = False, rounds: int | None = None,
                   new_tokens: int = NEW_TOKENS, compiled: bool = True, profile: bool = False,
                   train_dropout: float | None = 0.0, device: torch.device | str = "cpu",
                   progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """Everything `glassgpt bench` measures on `device`; `workload` is train, generate or all.

    Training runs without dropout by default, as nanoGPT's bench.py does: dropout's random
    masks cost time that no FLOP count includes. `train_dropout=None` keeps each preset's.
    """
    device = torch.device(device)
    if profile and device.type != "cpu":
        raise ConfigError("--profile measures CPU operators; leave it out with --device cuda")
    if workload not in ("train", "generate", "all"):
        raise ConfigError(f"unknown workload {workload!r}; choose train, generate or all")
    for preset in {*train_presets, *decode_presets}:
        load_preset(preset)  # an unknown name fails now, not after minutes of measuring
    if workload != "train":
        for preset in decode_presets:
            check_decode_length(GPTConfig.from_preset(preset), PROMPT_LEN, new_tokens)
    progress("measuring the machine's matmul peak and read bandwidth")
    probes = LimitProbes.for_device(device)
    report = BenchReport(machine_info(device), measure_limits(probes))
    if workload in ("train", "all"):
        for preset in train_presets:
            progress(f"training {preset}")
            dropout = {} if train_dropout is None else {"dropout": train_dropout}
            report.train += bench_training(preset, probes, against_hf, compiled,
                                           rounds=rounds or 5, **dropout)
            if profile:
                report.profile += profile_train_step(preset, **dropout)
    if workload in ("generate", "all"):
        for preset in decode_presets:
            progress(f"decoding {preset}")
            report.decode += bench_decoding(preset, probes, against_hf, compiled=compiled,
                                            rounds=rounds or 5, new_tokens=new_tokens,
                                            uncached_rounds=min(3, rounds or 5))
            report.precision += [precision_cost(preset, dtype, new_tokens=new_tokens,
                                                device=device)
                                 for dtype in (torch.bfloat16, torch.int8)]
            if profile:
                report.profile += profile_decode_step(preset)
                if compiled:
                    report.profile += profile_decode_step(preset, compiled=True)
    report.machine["load_after"] = _load_average()
    return report
