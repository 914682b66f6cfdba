"""A model ready to decode: its weights in the dtype asked for, on its device, and whether its
steps go through the compiled step. One function, `decoding_model`, serves `glassgpt sample`
(glassgpt.decoding.session) and the decoding benchmarks (glassgpt.bench.decoding and
glassgpt.bench.llamacpp), so that what they time is what the command decodes:

    float32   the model as it is
    bfloat16  every tensor in bf16 (a run's weights read straight into it: no float32 copy)
    int8      every layer's weight in Q8_0 blocks of 32 (glassgpt.decoding.blocks), multiplied
              with integer dot products, quantized from the float32 model, which is let go
    int4      the same in Q4_0 blocks (4 bits a weight and an fp16 scale a block)

Nothing compiles unless asked (`compiled=True`). int8 and int4 are fast uncompiled (their
products are the block kernel, glassgpt.decoding.kernels), so their first token comes as soon
as the model is quantized, for a model of any size. (int8 used to compile unasked from 1M
parameters, whose per-row products were fast only inside the compiled step, at 45-100 s of
compiling before the first token: BENCHMARKS.md "int8 and 4-bit with integer dot products".)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassgpt.config_checks import DECODE_DTYPES, check_choice
from glassgpt.decoding.blocks import quantize_blocks
from glassgpt.decoding.generate import generate
from glassgpt.rundir.checkpoint import Run
from glassgpt.tokenizers import Tokenizer

__all__ = ["DecodingModel", "decoding_model"]


@dataclass(frozen=True)
class DecodingModel:
    """A model ready to decode: `model` in `dtype` ("float32", "bfloat16", "int8", "int4") on its
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
                   compiled: bool = False) -> DecodingModel:
    """`source` ready to decode in `dtype` (module docstring). A float32 GPT decodes where it
    is (bfloat16 and int8 are copies of it; it is left as it was); a `Run` is loaded on
    `device` from its `checkpoint` weights; its steps go through the compiled step where
    `compiled`."""
    check_choice("decoding dtype", dtype, DECODE_DTYPES)
    tokenizer = None
    if isinstance(source, Run):
        # bf16 weights are read as bf16; int8 and int4 ones quantized from the float32 model.
        read_as = torch.bfloat16 if dtype == "bfloat16" else None
        model, tokenizer = source.load_model(device, checkpoint, read_as)
        if dtype in BLOCK_FORMATS:
            model = quantize_blocks(model, BLOCK_FORMATS[dtype])
    else:
        model = _in_dtype(source, dtype)
    return DecodingModel(model, dtype, compiled, tokenizer)


# Each integer decoding dtype's block format (llama.cpp's name for it).
BLOCK_FORMATS = {"int8": "q8_0", "int4": "q4_0"}


def _in_dtype(model: nn.Module, dtype: str) -> nn.Module:
    if dtype in BLOCK_FORMATS:
        return quantize_blocks(model, BLOCK_FORMATS[dtype])
    if dtype == "bfloat16":
        return copy.deepcopy(model).to(torch.bfloat16)
    return model
