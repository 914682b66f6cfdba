"""Decoding speed at batch 1, with and without the KV cache, and what bf16 and int8 weights cost."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.bench.measure import (
    GLASSGPT,
    GLASSGPT_COMPILED,
    GLASSGPT_EAGER,
    HF,
    LimitProbes,
    bench_model,
    decode_bytes_per_token,
    hf_twin,
    interleaved_times,
)
from glassgpt.config import NEW_TOKENS, PROMPT_LEN, GPTConfig
from glassgpt.decoding.generate import generate
from glassgpt.decoding.prepare import DecodingModel, decoding_model
from glassgpt.errors import ConfigError


@dataclass
class DecodeSpeed:
    preset: str
    contender: str
    cache: bool
    dtype: str
    seconds: float  # prefill + every new token
    tokens_per_s: float
    bytes_per_token: int
    bandwidth_fraction: float  # tokens/s / (read_bandwidth / bytes per token)
    read_bandwidth: float  # bytes/s, probed in the same rounds as the cached decoders


@dataclass
class PrecisionCost:
    """What lower-precision weights (`dtype`) cost in accuracy, on the fp32 model's own greedy
    continuation."""

    preset: str
    top1_agreement: float  # positions where both pick the same next token
    mean_kl: float  # mean KL(fp32 || dtype) of the next-token distributions, in nats
    max_logit_error: float
    dtype: str = "bfloat16"  # bfloat16 (weights and activations) or int8 (weights only)


INT8 = torch.int8  # the int8 contenders' key: int8 weights, float32 activations


def _glassgpt_decoder(decoding: DecodingModel, prompt: Tensor, new_tokens: int, cache: bool,
                      engine: str = "auto") -> Callable[[], Tensor]:
    return lambda: decoding.greedy(prompt, new_tokens, use_cache=cache, engine=engine)


def _hf_decoder(hf_model: nn.Module, prompt: Tensor, new_tokens: int, cache: bool
                ) -> Callable[[], Tensor]:
    def run() -> Tensor:
        with torch.no_grad():
            return hf_model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False, use_cache=cache)
    return run


def check_decode_length(config: GPTConfig, prompt_len: int, new_tokens: int) -> None:
    if prompt_len + new_tokens > config.block_size:
        raise ConfigError(f"a {prompt_len}-token prompt plus {new_tokens} new tokens does not fit "
                          f"block_size={config.block_size}; ask for fewer new tokens")


DecodeKey = tuple[str, bool, torch.dtype]  # (contender, KV cache, dtype)


def bench_decoding(preset: str, probes: LimitProbes, against_hf: bool = False,
                   bf16: bool = True, uncached: bool = True, compiled: bool = True,
                   rounds: int = 3, int8: bool = True,
                   uncached_rounds: int = 3, prompt_len: int = PROMPT_LEN,
                   new_tokens: int = NEW_TOKENS, **overrides: Any) -> list[DecodeSpeed]:
    """Greedy decoding tokens/s of each contender at batch 1, with and without a KV cache.

    Cached and uncached decoders are compared in two interleaved groups: recomputing the
    context costs tens of times more, so the uncached group gets its own (smaller) round count.
    `glassgpt` decodes on the device's engine (`glassgpt.decoding`), `glassgpt+compile` on its
    compiled variant, and `glassgpt eager` on the reference engine (the plain model), which
    shows what the engines add. With `int8`, an int8 copy (Q8_0 blocks, `decoding.blocks`)
    decodes too, uncompiled, as `sample --dtype int8` decodes it; its bytes per token are its
    int8 weights, their block scales and the float32 rest.
    """
    model = bench_model(preset, probes.device, dropout=0.0, **overrides).eval()
    check_decode_length(model.config, prompt_len, new_tokens)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=probes.device)
    cached = _contenders(model, bf16, compiled, int8)
    fp32 = cached[GLASSGPT, True, torch.float32]
    recomputing: dict[DecodeKey, Any] = {(GLASSGPT, False, torch.float32): fp32}
    if against_hf:
        hf_model = hf_twin(model)
        cached[HF, True, torch.float32] = hf_model
        recomputing[HF, False, torch.float32] = hf_model
    # The bandwidth limit is probed alongside the cached decoders, which it is the limit of:
    # one read after each decoder in every round, and the limit is the best of them all. On a
    # shared host the read bandwidth moves by half within minutes (BENCHMARKS.md); three
    # reads alone could all land in a slow moment and put a decoder above its "limit".
    reads = {(probes.READ, i): probes.read for i in range(len(cached))}
    times = _time_decoders(cached, prompt, new_tokens, rounds, probes.sync, reads)
    bandwidth = probes.bandwidth(min(min(times.pop(key)) for key in reads))
    if uncached:
        times |= _time_decoders(recomputing, prompt, new_tokens, uncached_rounds, probes.sync)
    seconds = {key: statistics.median(t) for key, t in times.items()}
    weight_bytes = decode_bytes_per_token(model)  # fp32
    results = []
    for (name, cache, dtype), elapsed in seconds.items():
        dtype_bytes = (decode_bytes_per_token(cached[name, cache, dtype].model) if dtype == INT8
                       else weight_bytes * dtype.itemsize // 4)
        tokens_per_s = new_tokens / elapsed
        results.append(DecodeSpeed(preset, name, cache, str(dtype).removeprefix("torch."),
                                    elapsed, tokens_per_s, dtype_bytes,
                                    tokens_per_s * dtype_bytes / bandwidth, bandwidth))
    return results


def _contenders(model: nn.Module, bf16: bool, compiled: bool, int8: bool
                ) -> dict[DecodeKey, DecodingModel]:
    """(contender, KV cache, dtype) -> the model it decodes, ready in its dtype; the bf16
    contenders decode one bf16 copy, int8 as `sample --dtype int8` does (uncompiled)."""
    fp32 = decoding_model(model, compiled=False)
    cached = {(GLASSGPT, True, torch.float32): fp32, (GLASSGPT_EAGER, True, torch.float32): fp32}
    if compiled:
        cached[GLASSGPT_COMPILED, True, torch.float32] = decoding_model(model, compiled=True)
    if bf16:
        half = decoding_model(model, "bfloat16", compiled=False)
        cached[GLASSGPT, True, torch.bfloat16] = half
        if compiled:
            cached[GLASSGPT_COMPILED, True, torch.bfloat16] = dataclasses.replace(half,
                                                                                  compiled=True)
    if int8:
        quantized = decoding_model(model, "int8")
        cached[GLASSGPT_COMPILED if quantized.compiled else GLASSGPT, True, INT8] = quantized
    return cached


def _time_decoders(models: dict[DecodeKey, Any], prompt: Tensor, new_tokens: int,
                   rounds: int, sync: Callable[[], Any],
                   probes: dict[str, Callable[[], Any]] | None = None
                   ) -> dict[Any, list[float]]:
    """Seconds of each model's greedy decoding, and of each probe, in interleaved rounds."""
    def decoders(n: int) -> dict[Any, Callable[[], Any]]:
        make = {GLASSGPT: _glassgpt_decoder, HF: _hf_decoder,
                GLASSGPT_COMPILED: _glassgpt_decoder,
                GLASSGPT_EAGER: functools.partial(_glassgpt_decoder, engine="eager")}
        return {key: make[key[0]](m, prompt, n, key[1]) for key, m in models.items()}

    # A short run touches every path, and compiles the compiled step (once per process).
    for warm_up in decoders(min(4, new_tokens)).values():
        warm_up()
    return interleaved_times(alternate(decoders(new_tokens), probes or {}), rounds, warmup=0,
                             sync=sync)


def alternate(first: dict[Any, Any], second: dict[Any, Any]) -> dict[Any, Any]:
    """Both dicts' items in one, taken in turn (first's, second's, first's, ...), so that in
    interleaved rounds each probe runs right after a contender; the longer one's rest last."""
    a, b = list(first.items()), list(second.items())
    turns = [item for pair in zip(a, b, strict=False) for item in pair]
    return dict(turns + a[len(b):] + b[len(a):])


@torch.no_grad()
def precision_cost(preset: str, dtype: torch.dtype = torch.bfloat16,
                   prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS,
                   device: torch.device | str = "cpu", **overrides: Any) -> PrecisionCost:
    """Teacher-force the fp32 greedy continuation through the fp32 model and a copy in `dtype`
    (bfloat16: every tensor; int8: Q8_0 blocks, activations rounded to Q8_0 too) and
    compare their next-token distributions."""
    if dtype not in (torch.bfloat16, INT8):
        raise ConfigError(f"precision_cost compares bfloat16 or int8 with float32, not {dtype}")
    model = bench_model(preset, device, dropout=0.0, **overrides).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device)
    tokens = generate(model, prompt, max_new_tokens=new_tokens, temperature=0.0)[:, :-1]  # (1,T)
    reference = model(tokens)[0].float()  # (1, T, V)
    copied = decoding_model(model, str(dtype).removeprefix("torch."), compiled=False).model
    approx = copied(tokens)[0].float()
    kl = F.kl_div(approx.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)  # (1, T)
    agree = (reference.argmax(-1) == approx.argmax(-1)).float().mean()
    return PrecisionCost(preset, float(agree), float(kl.mean()),
                         float((reference - approx).abs().max()),
                         str(dtype).removeprefix("torch."))


def bf16_cost(preset: str, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS,
              device: torch.device | str = "cpu", **overrides: Any) -> PrecisionCost:
    """`precision_cost` of bfloat16."""
    return precision_cost(preset, torch.bfloat16, prompt_len, new_tokens, device, **overrides)
