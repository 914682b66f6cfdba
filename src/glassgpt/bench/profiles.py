"""Where the time goes: the costliest operators of one profiled step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from glassgpt.bench.measure import bench_model
from glassgpt.bench.training import bench_train_config, train_stepper
from glassgpt.config import PROMPT_LEN
from glassgpt.decoding import CompiledCPUEngine, CPUEngine


@dataclass
class OpShare:
    """One operator's share of the self CPU time of a profiled step."""

    workload: str  # "train step", "decode step" or "compiled decode step"
    preset: str
    op: str
    share: float
    calls: int  # per step


def top_ops(fn: Callable[[], Any], top: int = 8, repeats: int = 1
            ) -> list[tuple[str, float, int]]:
    """(op, share of self CPU time, calls per call of fn) of the `top` costliest operators."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [(e.key, e.self_cpu_time_total / total, e.count // repeats) for e in events[:top]]


def profile_decode_step(preset: str, top: int = 8, prompt_len: int = PROMPT_LEN,
                        compiled: bool = False) -> list[OpShare]:
    """The costliest operators of one cached decoding step after a `prompt_len` prefill.

    With `compiled`, the step is the `CompiledCPUEngine`'s: its kernels show up as one graph
    call, beside dynamo's guard check and whatever still runs outside the graph.
    """
    model = bench_model(preset, dropout=0.0).eval()
    engine = CompiledCPUEngine(model) if compiled else CPUEngine(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len))
    engine.start(1, prompt_len + 1)
    with torch.no_grad():
        engine.prefill(prompt)
        token = prompt[:, -1:].clone(memory_format=torch.contiguous_format)  # as sampled
        step = lambda: engine.step(token, prompt_len)  # noqa: E731
        step()  # warm-up (and compilation); the profiled step rewrites the same cache slot
        ops = top_ops(step, top, repeats=20)
    engine.close()
    label = "compiled decode step" if compiled else "decode step"
    graph_event = "CompiledFxGraph" if any("CompiledFxGraph" in n for n, _, _ in ops) \
        else "Torch-Compiled Region"  # older torch counts the kernels to the region itself
    return [OpShare(label, preset, _readable_op(name, graph_event), share, calls)
            for name, share, calls in ops]


def _readable_op(name: str, graph_event: str) -> str:
    """Profiler names of compiled graphs carry a hash; the name says what they are."""
    return "inductor kernels (one compiled graph)" if graph_event in name else name


def profile_train_step(preset: str, top: int = 8, batch_size: int | None = None,
                       **overrides: Any) -> list[OpShare]:
    """The costliest operators of one eager training step (forward, backward, AdamW)."""
    model = bench_model(preset, **overrides)
    train_cfg = bench_train_config(preset, batch_size)
    data = torch.randint(0, model.config.vocab_size, (train_cfg.batch_size,
                                                      model.config.block_size + 1))
    step = train_stepper(model, train_cfg, (data[:, :-1], data[:, 1:]))
    step()  # warm-up: the optimizer allocates its state on the first step
    return [OpShare("train step", preset, *op) for op in top_ops(step, top, repeats=2)]
