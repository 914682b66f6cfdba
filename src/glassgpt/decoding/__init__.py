"""Decoding engines: the same decoding steps as the plain model, made fast for one device.

The model files (`attention.py`, `block.py`, `model.py`) are plain PyTorch; every speed path of
decoding lives here, one module per device:
    engine.py  `EagerEngine`, the reference: `GPT.forward` with a KV cache, nothing else
    cpu.py     `CPUEngine` (one-row products on every thread), `CompiledCPUEngine` (one compiled
               graph per step, products and attention as fused reductions)
    cuda.py    `CUDAGraphEngine` (a static KV cache and the step captured as a CUDA graph)
    choice.py  which eager CPU engine "auto" takes: the plain model or the threaded one, timed
    quantized.py  a model's int8 weight-only form (`quantize_int8`), which every engine decodes,
               held to the tokens of its dequantized float model; fast through the compiled step
    blocks.py  int8 and int4 as llama.cpp's Q8_0/Q4_0 blocks with integer dot products
               (`quantize_blocks`), through the C kernel kernels.py builds, or its torch reference
    prepare.py `decoding_model`: a model ready to decode in float32, bfloat16, int8 or int4,
               compiled or not (`glassgpt sample` and the decoding benchmarks share it)
    session.py `sample_run`: what `glassgpt sample` does, as one call
An engine prepares a plain `GPT` without changing its weights' values and gives exactly the
tokens of `EagerEngine` (tested for each). `glassgpt.decoding.generate` picks one with `engine_for`.
"""

from __future__ import annotations

from typing import Any

import torch

from glassgpt.config_checks import ENGINES
from glassgpt.decoding.choice import measured_cpu_engine
from glassgpt.decoding.cpu import CompiledCPUEngine, CPUEngine
from glassgpt.decoding.cuda import CUDAGraphEngine
from glassgpt.decoding.engine import EagerEngine
from glassgpt.errors import ConfigError

__all__ = ["ENGINES", "CPUEngine", "CUDAGraphEngine", "CompiledCPUEngine", "EagerEngine",
           "engine_for"]


def engine_for(model: Any, name: str = "auto", compiled: bool = False) -> EagerEngine:
    """The decoding engine `name` for `model`; "auto" picks the one made for its device (on a
    CPU, uncompiled: the threaded engine or the plain model, whichever a few timed steps find
    faster on this host, `decoding.choice`).

    `compiled` asks for the engine's torch.compile'd variant (the CPU's compiled step, or a
    compiled step inside the CUDA graph); the eager reference has none.
    """
    device = next(model.parameters(), torch.empty(0)).device.type
    if name == "auto":
        if device == "cpu" and not compiled:
            return measured_cpu_engine(model)
        name = {"cpu": "cpu", "cuda": "cuda-graph"}.get(device, "eager")
    if name == "eager":
        if compiled:
            raise ConfigError("the eager engine is the uncompiled reference; use engine 'auto' "
                              "to compile the decoding step")
        return EagerEngine(model)
    if name == "cpu":
        _check_device(name, device, "cpu")
        return CompiledCPUEngine(model) if compiled else CPUEngine(model)
    if name == "cuda-graph":
        _check_device(name, device, "cuda")
        return CUDAGraphEngine(model, compiled=compiled)
    raise ConfigError(f"unknown decoding engine {name!r}; choose one of {list(ENGINES)}")


def _check_device(engine: str, device: str, needed: str) -> None:
    if device != needed:
        raise ConfigError(f"the {engine} engine decodes a model on {needed}, this one is on "
                          f"{device}")
