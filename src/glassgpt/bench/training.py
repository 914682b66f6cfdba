"""Training speed: one optimizer step of each contender, tokens/s and MFU."""

from __future__ import annotations

import copy
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.bench.measure import (
    BF16,
    FP32,
    GLASSGPT,
    GLASSGPT_COMPILED,
    HF,
    MAX_TRAIN_BATCH,
    HFLanguageModel,
    LimitProbes,
    bench_model,
    hf_twin,
    interleaved_times,
    matmul_parameters,
    train_flops_per_token,
)
from glassgpt.config import TrainConfig, load_preset
from glassgpt.model import GPT
from glassgpt.training.optim import make_optimizer
from glassgpt.training.trainer import train_step


@dataclass
class TrainSpeed:
    preset: str
    contender: str
    dtype: str  # "float32", or "bfloat16" for bf16 autocast (fp32 weights and optimizer)
    batch_size: int
    seq_len: int
    dropout: float
    step_seconds: float
    tokens_per_s: float
    flops_per_token: float
    mfu: float  # achieved FLOP/s / matmul_flops
    matmul_flops: float  # the peak of its dtype, probed in the same rounds


def bench_train_config(preset: str, batch_size: int | None, on_gpu: bool = False
                       ) -> TrainConfig:
    """The preset's recipe with one micro-batch per step: the preset's batch on a GPU, and on
    a CPU at most MAX_TRAIN_BATCH sequences, which it steps through in about a second."""
    recipe = load_preset(preset).get("train", {})
    batch = recipe.get("batch_size", MAX_TRAIN_BATCH)
    batch = batch_size or (batch if on_gpu else min(batch, MAX_TRAIN_BATCH))
    settings = {k: v for k, v in recipe.items() if k in {"lr", "beta2", "weight_decay",
                                                          "grad_clip"}}
    return TrainConfig(batch_size=batch, grad_accum=1, **settings)


def train_stepper(model: nn.Module, train_cfg: TrainConfig, batch: tuple[Tensor, Tensor],
             amp_dtype: torch.dtype | None = None) -> Callable[[], Tensor]:
    """One optimizer step of the trainer's own `train_step` on a fixed batch."""
    optimizer = make_optimizer(model, train_cfg)
    model.train()
    return lambda: train_step(model, optimizer, lambda: batch, train_cfg, amp_dtype=amp_dtype)


TrainKey = tuple[str, str]  # (contender, dtype)


def bench_training(preset: str, probes: LimitProbes, against_hf: bool = False,
                   compiled: bool = True, bf16: bool = True, rounds: int = 5,
                   batch_size: int | None = None, **overrides: Any) -> list[TrainSpeed]:
    """Training tokens/s and MFU of each contender on the same random batch, on the probes'
    device.

    The matmul peak that MFU divides by is probed in the same rounds as the contenders; the
    bf16 autocast contender (`train --dtype bfloat16`) is measured against a bf16 matmul's peak.
    """
    device = probes.device
    model = bench_model(preset, device, **overrides)
    config = model.config
    train_cfg = bench_train_config(preset, batch_size, on_gpu=device.type == "cuda")
    B, T = train_cfg.batch_size, config.block_size
    data = torch.randint(0, config.vocab_size, (B, T + 1), device=device)
    batch = (data[:, :-1], data[:, 1:])  # (B, T) inputs and next-token targets
    # Each contender trains its own copy from the same initial weights.
    contenders: dict[TrainKey | str, Callable[[], Any]] = {
        (GLASSGPT, FP32): train_stepper(copy.deepcopy(model), train_cfg, batch)}
    if compiled:
        contenders[GLASSGPT_COMPILED, FP32] = train_stepper(torch.compile(copy.deepcopy(model)),
                                                       train_cfg, batch)
    if bf16:
        contenders[GLASSGPT, BF16] = train_stepper(copy.deepcopy(model), train_cfg, batch,
                                              amp_dtype=torch.bfloat16)
        contenders[probes.MATMUL_BF16] = probes.matmul_bf16
    if against_hf:
        contenders[HF, FP32] = train_stepper(HFLanguageModel(hf_twin(model).train()), train_cfg,
                                        batch)
    contenders[probes.MATMUL] = probes.matmul
    times = interleaved_times(contenders, rounds, warmup=2, sync=probes.sync)
    peaks = {FP32: probes.flops(min(times.pop(probes.MATMUL)))}
    if bf16:
        peaks[BF16] = probes.flops(min(times.pop(probes.MATMUL_BF16)))
    flops = train_flops_per_token(config, matmul_parameters(model), T)
    results = []
    for (name, dtype), step_times in times.items():
        step = statistics.median(step_times)
        tokens_per_s = B * T / step
        results.append(TrainSpeed(preset, name, dtype, B, T, config.dropout, step, tokens_per_s,
                                  flops, tokens_per_s * flops / peaks[dtype], peaks[dtype]))
    return results


def eager_and_compiled_losses(model: GPT, batch: tuple[Tensor, Tensor], steps: int,
                           train_cfg: TrainConfig) -> tuple[list[float], list[float]]:
    """Losses of `steps` optimizer steps, eager and compiled, from the same initial weights.

    The model is compiled with `fullgraph=True`, as one graph a step: anything in its forward
    that broke the graph (a thread count asked, ids read back) would fail here.
    """
    losses = []
    for wrap in (lambda m: m, functools.partial(torch.compile, fullgraph=True)):
        step = train_stepper(wrap(copy.deepcopy(model)), train_cfg, batch)
        losses.append([float(step()) for _ in range(steps)])
    return losses[0], losses[1]
