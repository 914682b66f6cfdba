"""Decoding on a CPU beside llama.cpp: the same weights, the same threads, one table.

`bench_against_llamacpp(preset)` builds the preset's model with random weights (seeded), writes
it as GGUF files (glassgpt.formats.gguf: F32, F16, BF16, Q8_0, Q4_0), and times greedy decoding
at batch 1 of every contender in interleaved rounds, once per thread count:

* glassgpt: the CPU engine's eager step and its compiled step (glassgpt.decoding.cpu), in fp32
  and bf16, and int8 and int4 (llama.cpp's Q8_0 and Q4_0 blocks multiplied with integer dot
  products, glassgpt.decoding.blocks), each model made ready as `glassgpt sample` makes it
  (glassgpt.decoding.prepare);
* llama.cpp, through llama-cpp-python (an optional extra that compiles llama.cpp), one context
  per file: each step decodes one token and picks the argmax of its logits, as llama.cpp's
  greedy sampler does, with no Python sampler in between.

Each row has the median tokens/s over the rounds and its range, the fraction of the read
bandwidth limit (the bytes of weights a step reads over the best read of a large buffer probed
in the same rounds, with the same threads), and the prefill rate of a 512-token prompt. The
greedy tokens of glassgpt fp32 and llama.cpp F32 are compared too: the two decoders must agree
before their speeds mean anything; and glassgpt's int8 and int4 with llama.cpp's Q8_0 and Q4_0
(the same blocks: equal where the rounding of the rest of the step allows).

Nothing is built here: without llama-cpp-python the bench says how to install it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from glassgpt.bench.decoding import alternate
from glassgpt.bench.measure import (
    LimitProbes,
    bench_model,
    decode_bytes_per_token,
    interleaved_times,
)
from glassgpt.decoding.prepare import DecodingModel, decoding_model
from glassgpt.errors import ConfigError
from glassgpt.model import GPT

PRESETS = ("gpt2", "smollm2-135m")  # GPT-2 small, and a Llama-family shape
PREFILL_LEN = 512
LLAMACPP = "llama.cpp"
GLASSGPT_EAGER, GLASSGPT_COMPILED = "glassgpt eager", "glassgpt compiled"
# llama.cpp's file types against glassgpt's precisions; bytes per weight element of each.
ELEMENT_BYTES = {"f32": 4.0, "fp32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32,
                 "q4_0": 18 / 32}
# glassgpt's integer precisions beside llama.cpp's file types of the same blocks.
SAME_BLOCKS = {"int8": "q8_0", "int4": "q4_0"}
INSTALL = ("llama-cpp-python is not installed: `pip install 'glassgpt[llamacpp]'` compiles "
           "llama.cpp (a few minutes)")


@dataclass
class LlamaCppRow:
    preset: str
    decoder: str  # glassgpt eager, glassgpt compiled, llama.cpp
    precision: str  # fp32, bf16, int8, int4 (glassgpt); f32, f16, bf16, q8_0, q4_0 (llama.cpp)
    threads: int
    tokens_per_s: float  # median over the rounds
    slowest: float  # tokens/s of the slowest and fastest rounds
    fastest: float
    bandwidth_fraction: float  # tokens/s x bytes per token / read bandwidth
    prefill_tokens_per_s: float  # a PREFILL_LEN-token prompt, median


@dataclass
class LlamaCppReport:
    rows: list[LlamaCppRow]
    read_bandwidth: dict[tuple[str, int], float]  # (preset, threads) -> bytes/s, best read
    same_tokens: dict[str, tuple[int, int]]  # preset -> (leading tokens equal, of how many)
    # "preset int8/q8_0" (and int4/q4_0) -> (leading tokens equal, of how many)
    same_blocks: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)


def llama_cpp_module() -> Any:
    """llama_cpp, or ConfigError saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(INSTALL) from None
    return llama_cpp


def bench_against_llamacpp(presets: tuple[str, ...] = PRESETS,
                           threads: tuple[int, ...] | None = None, rounds: int = 3,
                           new_tokens: int = 128, prompt_len: int = 16,
                           prefill_len: int = PREFILL_LEN, compiled: bool = True,
                           int8: bool = True,
                           progress: Callable[[str], Any] = lambda _: None,
                           **overrides: Any) -> LlamaCppReport:
    """The table of the module docstring. `threads`: the thread counts (default 1 and all of
    the machine's); `int8`: also glassgpt's int8 and int4 (glassgpt.decoding.blocks);
    `overrides`: GPTConfig fields changed from the presets' (a smaller model in a test)."""
    llama_cpp = llama_cpp_module()
    threads = threads or tuple(sorted({1, torch.get_num_threads()}))
    rows, bandwidths, same, same_blocks = [], {}, {}, {}
    before = torch.get_num_threads()
    try:
        for preset in presets:
            model = bench_model(preset, **{"dropout": 0.0, **overrides}).eval()
            if prompt_len + new_tokens > model.config.block_size:
                raise ConfigError(f"{preset}: {prompt_len} + {new_tokens} tokens do not fit "
                                  f"its context ({model.config.block_size})")
            with tempfile.TemporaryDirectory(prefix="glassgpt-gguf-") as directory:
                progress(f"{preset}: writing GGUF files")
                contexts = _llama_contexts(llama_cpp, model, Path(directory),
                                           prompt_len + max(new_tokens, prefill_len) + 1)
                glass = _glassgpt_models(model, int8)
                same[preset] = _agreement(glass["fp32"], contexts["f32"], prompt_len,
                                          new_tokens)
                for ours, theirs in SAME_BLOCKS.items():
                    if ours in glass:
                        same_blocks[f"{preset} {ours}/{theirs}"] = _agreement(
                            glass[ours], contexts[theirs], prompt_len, new_tokens)
                for count in threads:
                    progress(f"{preset}: decoding at {count} thread{'s' * (count > 1)}")
                    found, bandwidth = _measure(preset, glass, contexts, count, rounds,
                                                new_tokens, prompt_len, prefill_len, compiled,
                                                _step_bytes(model, glass))
                    rows += found
                    bandwidths[preset, count] = bandwidth
                for context in contexts.values():
                    context.close()
    finally:
        torch.set_num_threads(before)
    return LlamaCppReport(rows, bandwidths, same, same_blocks)


def _glassgpt_models(model: GPT, int8: bool) -> dict[str, DecodingModel]:
    """glassgpt's contenders by precision, each ready to decode (uncompiled: `_measure` times
    both steps of each)."""
    dtypes = {"fp32": "float32", "bf16": "bfloat16",
              **({"int8": "int8", "int4": "int4"} if int8 else {})}
    return {name: decoding_model(model, dtype, compiled=False) for name, dtype in dtypes.items()}


def _step_bytes(model: GPT, glass: dict[str, DecodingModel]) -> dict[str, float]:
    """Bytes of weights a decoding step reads, per precision: glassgpt's own (int8 and int4
    with their block scales and float32 norms and biases), and llama.cpp's types by their bytes
    per weight."""
    fp32 = decode_bytes_per_token(model)
    sizes = {name: fp32 * per_weight / 4 for name, per_weight in ELEMENT_BYTES.items()}
    for precision in SAME_BLOCKS:
        if precision in glass:
            sizes[precision] = decode_bytes_per_token(glass[precision].model)
    return sizes


@contextlib.contextmanager
def without_repacking(llama_cpp: Any) -> Iterator[None]:
    """ggml repacks Q8_0 matrices for AMX units where the CPU has them, which faults where the
    kernel grants no AMX state (a sandbox); llama-cpp-python does not pass the switch, so its
    default is set. (That switch also turns off the AVX2/AVX-512 repacking of Q4_0 into
    interleaved rows, llama.cpp's fast Q4_0 path: `_llama_contexts` keeps it off only where
    the CPU has AMX.)"""
    low = llama_cpp.llama_cpp
    defaults = low.llama_model_default_params

    def params() -> Any:
        chosen = defaults()
        chosen.use_extra_bufts = False
        return chosen
    with mock.patch.object(low, "llama_model_default_params", params):
        yield


def _llama_contexts(llama_cpp: Any, model: GPT, directory: Path, n_ctx: int) -> dict[str, Any]:
    """One llama.cpp context per file type, on files written from `model`'s weights."""
    from glassgpt.formats.gguf import write_gguf

    contexts = {}
    for dtype in ("f32", "f16", "bf16", "q8_0", "q4_0"):
        path = directory / f"model-{dtype}.gguf"
        write_gguf(model, None, path, dtype)
        # F32 weights keep float32 keys and values (type 0); the others llama.cpp's F16 (1).
        kv_type = 0 if dtype == "f32" else 1
        repacking = contextlib.nullcontext() if not has_amx() else without_repacking(llama_cpp)
        with repacking:
            contexts[dtype] = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=PREFILL_LEN,
                                              n_ubatch=PREFILL_LEN, verbose=False,
                                              type_k=kv_type, type_v=kv_type)
    return contexts


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (/proc/cpuinfo's amx_tile), where ggml's repacking
    faults in a sandbox that grants no AMX state."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_greedy(context: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """llama.cpp's greedy continuation of `prompt`: decode, argmax of the last logits, repeat."""
    context.reset()
    context.eval(prompt)
    vocab, out = context.n_vocab(), []
    for _ in range(new_tokens):
        logits = np.ctypeslib.as_array(context._ctx.get_logits_ith(-1), shape=(vocab,))
        token = int(logits.argmax())
        out.append(token)
        context.eval([token])
    return out


def _agreement(ready: DecodingModel, context: Any, prompt_len: int, new_tokens: int
               ) -> tuple[int, int]:
    """How many of glassgpt's greedy tokens (fp32's, say) llama.cpp (F32's) gives too, before
    the first difference (random weights leave near ties that float rounding may break)."""
    prompt = torch.randint(0, ready.model.config.vocab_size, (1, prompt_len),
                           generator=torch.Generator().manual_seed(1))
    ours = ready.greedy(prompt, new_tokens)[0, prompt_len:]
    theirs = llama_greedy(context, prompt[0].tolist(), new_tokens)
    equal = next((i for i, (a, b) in enumerate(zip(ours.tolist(), theirs, strict=True))
                  if a != b), new_tokens)
    return equal, new_tokens


def _measure(preset: str, glass: dict[str, DecodingModel], contexts: dict[str, Any], threads: int,
             rounds: int, new_tokens: int, prompt_len: int, prefill_len: int, compiled: bool,
             step_bytes: dict[str, float]) -> tuple[list[LlamaCppRow], float]:
    """Every contender at `threads` threads, decoding and prefill, in interleaved rounds."""
    torch.set_num_threads(threads)
    for context in contexts.values():
        context._ctx.set_n_threads(threads, threads)  # decoding and prompt batches alike
    vocab = glass["fp32"].model.config.vocab_size
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=generator)
    long_prompt = torch.randint(0, vocab, (1, prefill_len), generator=generator)
    decoders, prefills = {}, {}
    for precision, ready in glass.items():
        engines = [(GLASSGPT_EAGER, False)] + ([(GLASSGPT_COMPILED, True)] if compiled else [])
        for name, compile_step in engines:
            decoders[name, precision] = _glassgpt_decoder(ready, prompt, new_tokens,
                                                          compile_step)
        prefills[GLASSGPT_EAGER, precision] = _glassgpt_decoder(ready, long_prompt, 1, False)
    for dtype, context in contexts.items():
        decoders[LLAMACPP, dtype] = _llama_decoder(context, prompt[0].tolist(), new_tokens)
        prefills[LLAMACPP, dtype] = _llama_decoder(context, long_prompt[0].tolist(), 0)
    probes = LimitProbes()
    reads = {(probes.READ, i): probes.read for i in range(len(decoders))}
    for warm in decoders.values():  # compiles the compiled steps, touches every path
        warm()
    times = interleaved_times(alternate(decoders, reads), rounds, warmup=0)
    bandwidth = probes.bandwidth(min(min(times.pop(key)) for key in reads))
    prefill_times = interleaved_times(prefills, rounds)
    prefill_rate = {key: prefill_len / statistics.median(t) for key, t in prefill_times.items()}
    rows = []
    for (name, precision), seconds in times.items():
        rates = [new_tokens / s for s in seconds]
        median = statistics.median(rates)
        # The compiled step prefills as the eager one does: one prefill figure per precision.
        prefill_key = (LLAMACPP if name == LLAMACPP else GLASSGPT_EAGER, precision)
        rows.append(LlamaCppRow(preset, name, precision, threads, median, min(rates),
                                max(rates), median * step_bytes[precision] / bandwidth,
                                prefill_rate[prefill_key]))
    return rows, bandwidth


def _glassgpt_decoder(ready: DecodingModel, prompt: torch.Tensor, new_tokens: int,
                      compiled: bool) -> Callable[[], Any]:
    """The CPU engine's greedy decoding (glassgpt.decoding.cpu), eager or its compiled step."""
    decoding = dataclasses.replace(ready, compiled=compiled)
    return lambda: decoding.greedy(prompt, new_tokens)


def _llama_decoder(context: Any, prompt: list[int], new_tokens: int) -> Callable[[], Any]:
    if new_tokens == 0:  # the prefill alone
        return lambda: (context.reset(), context.eval(prompt))
    return lambda: llama_greedy(context, prompt, new_tokens)

