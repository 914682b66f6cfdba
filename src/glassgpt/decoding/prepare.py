"""A model ready to decode: its weights in the dtype asked for, on its device, and whether its
steps go through the compiled step. One function, `decoding_model`, serves `glassgpt sample`
(glassgpt.decoding.session) and the decoding benchmarks (glassgpt.bench.decoding and
glassgpt.bench.llamacpp), so that what they time is what the command decodes:

    float32   the model as it is
    bfloat16  every tensor in bf16 (a run's weights read straight into it: no float32 copy)
    int8      every layer's weight int8 with a scale per row (glassgpt.decoding.quantized),
              quantized from the float32 model, which is then let go

Compiling is asked for (`compiled=True`), refused (`False`), or left to the one rule there is
(`None`): int8 on a CPU goes through the compiled step, where its products are fast, for a
model large enough to win back the compiling (`int8_compiles`); everything else decodes
uncompiled.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassgpt.config import GPTConfig
from glassgpt.config_checks import DECODE_DTYPES, check_choice
from glassgpt.decoding.generate import generate
from glassgpt.decoding.quantized import int8_compile_pays, quantize_int8
from glassgpt.model import parameter_count
from glassgpt.rundir.checkpoint import Run
from glassgpt.tokenizers import Tokenizer

__all__ = ["DecodingModel", "decoding_model", "int8_compiles"]


@dataclass(frozen=True)
class DecodingModel:
    """A model ready to decode: `model` in `dtype` ("float32", "bfloat16" or "int8") on its
    device, whether its steps are `compiled`, and a run's tokenizer (None for a model given)."""

    model: nn.Module
    dtype: str
    compiled: bool
    tokenizer: Tokenizer | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def greedy(self, prompt: Tensor, new_tokens: int, use_cache: bool = True,
               engine: str = "auto") -> Tensor:
        """The greedy continuation of prompt (B, T): (B, T + new_tokens), on `engine`."""
        return generate(self.model, prompt, max_new_tokens=new_tokens, temperature=0.0,
                        use_cache=use_cache, compiled=self.compiled, engine=engine)


def decoding_model(source: nn.Module | Run, dtype: str = "float32", *,
                   device: torch.device | str = "auto", checkpoint: str = "best",
                   compiled: bool | None = None, hooks: bool = False) -> DecodingModel:
    """`source` ready to decode in `dtype` (module docstring). A float32 GPT decodes where it
    is (bfloat16 and int8 are copies of it; it is left as it was); a `Run` is loaded on
    `device` from its `checkpoint` weights. `compiled` None applies `int8_compiles`; `hooks`
    says that hooks will run at every step (steering), which only the eager model calls."""
    check_choice("decoding dtype", dtype, DECODE_DTYPES)
    tokenizer = None
    if isinstance(source, Run):
        # bf16 weights are read as bf16; int8 ones are quantized from the float32 model.
        read_as = torch.bfloat16 if dtype == "bfloat16" else None
        model, tokenizer = source.load_model(device, checkpoint, read_as)
        if dtype == "int8":
            model = quantize_int8(model)
    else:
        model = _in_dtype(source, dtype)
    if compiled is None:
        compiled = int8_compiles(dtype, next(model.parameters()).device.type, hooks,
                                 model.config)
    return DecodingModel(model, dtype, compiled, tokenizer)


def _in_dtype(model: nn.Module, dtype: str) -> nn.Module:
    if dtype == "int8":
        return quantize_int8(model)
    if dtype == "bfloat16":
        return copy.deepcopy(model).to(torch.bfloat16)
    return model


def int8_compiles(dtype: str, device: str, steering: bool, config: GPTConfig) -> bool:
    """Whether a model decoding in `dtype` on `device` compiles its step unasked: int8 on a
    CPU, where an int8 product is fast only inside the compiled step (uncompiled, each product
    converts its weights first: 3-4x slower than float32, BENCHMARKS.md), for a model large
    enough to gain from it (glassgpt.decoding.quantized.int8_compile_pays); not while
    steering, whose hooks only the eager model calls."""
    if dtype != "int8" or device != "cpu" or steering:
        return False
    return int8_compile_pays(parameter_count(config))

