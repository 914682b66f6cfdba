"""Speed, measured: the machine's limits, glassgpt against them, and Hugging Face GPT-2 beside it.

Library only: every function returns numbers (dataclasses); `glassgpt.cli.benchmark` prints them.

Method. Contenders of one comparison run in interleaved rounds (A B C, B C A, C A B, ...) so that
noise from other processes hits each of them alike; warm-up calls come first and are not timed;
every figure is the median of its rounds. Nothing here is a constant figure: the limits that
utilisation is measured against are probed in the same rounds as the contenders.

  * Training is compute-bound: its limit is the fp32 matmul peak. MFU = achieved model FLOP/s /
    measured peak, with 6N + 12*L*H*Q*T FLOPs per token (N = parameters that take part in matmuls,
    L layers, H heads of width Q, context T): forward + backward of every weight (2N + 4N) plus
    the attention scores and their weighted sum.
  * Decoding one token at batch 1 is memory-bound: every weight is read once per token. Its limit
    is read bandwidth / weight bytes per token.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.config import GPTConfig, load_preset
from glassgpt.errors import ConfigError
from glassgpt.generate import compiled_step, one_token_logits
from glassgpt.model import GPT, count_parameters
from glassgpt.train import TrainConfig, make_optimizer, train_step

TRAIN_PRESETS = ("cpu-small", "shakespeare-char")
DECODE_PRESETS = ("shakespeare-char", "gpt2")
PROMPT_LEN = 16
NEW_TOKENS = 128
MAX_TRAIN_BATCH = 12  # caps a preset's batch so one step stays around a second on a laptop CPU

GLASSGPT, GLASSGPT_COMPILED, HF = "glassgpt", "glassgpt+compile", "hf"
Key = TypeVar("Key")


# --- timing ---------------------------------------------------------------------------------

def interleaved_times(contenders: dict[Key, Callable[[], Any]], rounds: int,
                      warmup: int = 1) -> dict[Key, list[float]]:
    """Seconds of every timed call of each contender, run in interleaved, rotating rounds."""
    if rounds <= 0:
        raise ConfigError(f"rounds must be positive, got {rounds}")
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    seconds: dict[Key, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            contenders[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def interleaved_medians(contenders: dict[Key, Callable[[], Any]], rounds: int,
                        warmup: int = 1) -> dict[Key, float]:
    """Median seconds per call of each contender, timed in interleaved, rotating rounds."""
    times = interleaved_times(contenders, rounds, warmup)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


# --- the machine's limits -------------------------------------------------------------------

@dataclass
class MachineLimits:
    matmul_flops: float  # FLOP/s of a large fp32 matmul
    read_bandwidth: float  # bytes/s read from main memory


class LimitProbes:
    """Probes of the machine's two limits, timed in the same rounds as the contenders.

    A limit probed alongside the contenders sees the machine in the same state (other processes,
    clocks, caches). A limit is a peak, so it is the fastest round of its probe, where a
    contender's figure is its median round: utilisation errs low, never high.
    * matmul: a large fp32 matmul, 2n^3 FLOPs.
    * read: a sum over a buffer several times larger than any CPU cache, so every byte comes from
      memory at almost no arithmetic per byte.
    """

    MATMUL, READ = "matmul peak probe", "read bandwidth probe"
    MATMUL_BF16 = "bf16 matmul peak probe"

    def __init__(self, matmul_size: int = 2048, buffer_bytes: int = 256 * 2**20):
        self.a = torch.randn(matmul_size, matmul_size)
        self.b = torch.randn(matmul_size, matmul_size)
        self.buffer = torch.ones(buffer_bytes // 4)

    def matmul(self) -> Tensor:
        return self.a @ self.b

    def matmul_bf16(self) -> Tensor:
        """The peak that bf16 autocast training runs against: the same product in bfloat16."""
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.a @ self.b

    def read(self) -> Tensor:
        return self.buffer.sum()

    def flops(self, seconds: float) -> float:
        return 2 * self.a.shape[0] ** 3 / seconds

    def bandwidth(self, seconds: float) -> float:
        return self.buffer.numel() * self.buffer.element_size() / seconds


def measure_limits(probes: LimitProbes, rounds: int = 7) -> MachineLimits:
    """The fp32 matmul peak and the memory read bandwidth, measured side by side."""
    times = interleaved_times({probes.MATMUL: probes.matmul, probes.READ: probes.read}, rounds)
    return MachineLimits(probes.flops(min(times[probes.MATMUL])),
                         probes.bandwidth(min(times[probes.READ])))


# --- model arithmetic -----------------------------------------------------------------------

def matmul_parameters(model: GPT) -> int:
    """Parameters that take part in a matmul: all but the position table (a lookup only)."""
    return count_parameters(model) - model.pos_emb.weight.numel()


def train_flops_per_token(config: GPTConfig, n_params: int, seq_len: int) -> float:
    """6N + 12*L*H*Q*T: weights forward and backward, plus attention over T positions."""
    return 6 * n_params + 12 * config.n_layer * config.n_head * config.head_dim * seq_len


def decode_bytes_per_token(model: GPT) -> int:
    """Bytes of weights one decoding step reads: all of them, but one row of each lookup table.

    The LM head reads the whole token table even when it is tied to the embedding.
    """
    lookups = {id(model.pos_emb.weight)}
    if model.lm_head.weight is not model.tok_emb.weight:
        lookups.add(id(model.tok_emb.weight))
    total = 0
    for param in model.parameters():  # a tied weight appears once
        elements = param.shape[-1] if id(param) in lookups else param.numel()
        total += elements * param.element_size()
    return total


# --- contenders -----------------------------------------------------------------------------

class HFLanguageModel(nn.Module):
    """Hugging Face GPT-2 behind glassgpt's `model(x, y) -> (logits, loss)`, same loss code."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, idx: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.hf(input_ids=idx).logits  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def hf_twin(model: GPT) -> nn.Module:
    """A `transformers` GPT2LMHeadModel with exactly `model`'s shape and weights."""
    from glassgpt.interop import to_hf  # transformers is an optional extra: import late

    hf_model = to_hf(model)
    hf_model.generation_config.pad_token_id = 0  # silences a warning; batch 1 never pads
    return hf_model


def bench_model(preset: str, **overrides: Any) -> GPT:
    """A randomly initialised GPT of `preset`'s shape (seeded, so every run builds the same)."""
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset(preset, **overrides))


# --- training -------------------------------------------------------------------------------

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


def bench_train_config(preset: str, batch_size: int | None) -> TrainConfig:
    """The preset's recipe with one micro-batch per step and a batch a CPU steps through fast."""
    recipe = load_preset(preset).get("train", {})
    batch = batch_size or min(recipe.get("batch_size", MAX_TRAIN_BATCH), MAX_TRAIN_BATCH)
    settings = {k: v for k, v in recipe.items() if k in {"lr", "beta2", "weight_decay",
                                                          "grad_clip"}}
    return TrainConfig(batch_size=batch, grad_accum=1, **settings)


def _stepper(model: nn.Module, train_cfg: TrainConfig, batch: tuple[Tensor, Tensor],
             amp_dtype: torch.dtype | None = None) -> Callable[[], Tensor]:
    """One optimizer step of the trainer's own `train_step` on a fixed batch."""
    optimizer = make_optimizer(model, train_cfg)
    model.train()
    return lambda: train_step(model, optimizer, lambda: batch, train_cfg, amp_dtype=amp_dtype)


TrainKey = tuple[str, str]  # (contender, dtype)
FP32, BF16 = "float32", "bfloat16"


def bench_training(preset: str, probes: LimitProbes, against_hf: bool = False,
                   compiled: bool = True, bf16: bool = True, rounds: int = 5,
                   batch_size: int | None = None, **overrides: Any) -> list[TrainSpeed]:
    """Training tokens/s and MFU of each contender on the same random batch.

    The matmul peak that MFU divides by is probed in the same rounds as the contenders; the
    bf16 autocast contender (`train --dtype bfloat16`) is measured against a bf16 matmul's peak.
    """
    model = bench_model(preset, **overrides)
    config, train_cfg = model.config, bench_train_config(preset, batch_size)
    B, T = train_cfg.batch_size, config.block_size
    data = torch.randint(0, config.vocab_size, (B, T + 1))
    batch = (data[:, :-1], data[:, 1:])  # (B, T) inputs and next-token targets
    # Each contender trains its own copy from the same initial weights.
    contenders: dict[TrainKey | str, Callable[[], Any]] = {
        (GLASSGPT, FP32): _stepper(copy.deepcopy(model), train_cfg, batch)}
    if compiled:
        contenders[GLASSGPT_COMPILED, FP32] = _stepper(torch.compile(copy.deepcopy(model)),
                                                       train_cfg, batch)
    if bf16:
        contenders[GLASSGPT, BF16] = _stepper(copy.deepcopy(model), train_cfg, batch,
                                              amp_dtype=torch.bfloat16)
        contenders[probes.MATMUL_BF16] = probes.matmul_bf16
    if against_hf:
        contenders[HF, FP32] = _stepper(HFLanguageModel(hf_twin(model).train()), train_cfg,
                                        batch)
    contenders[probes.MATMUL] = probes.matmul
    times = interleaved_times(contenders, rounds, warmup=2)
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
    """Losses of `steps` optimizer steps, eager and compiled, from the same initial weights."""
    losses = []
    for wrap in (lambda m: m, torch.compile):
        step = _stepper(wrap(copy.deepcopy(model)), train_cfg, batch)
        losses.append([float(step()) for _ in range(steps)])
    return losses[0], losses[1]


# --- decoding -------------------------------------------------------------------------------

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
    """What bf16 weights cost in accuracy, on the fp32 model's own greedy continuation."""

    preset: str
    top1_agreement: float  # positions where both pick the same next token
    mean_kl: float  # mean KL(fp32 || bf16) of the next-token distributions, in nats
    max_logit_error: float


def _glassgpt_decoder(model: GPT, prompt: Tensor, new_tokens: int, cache: bool
                      ) -> Callable[[], Tensor]:
    return lambda: model.generate(prompt, new_tokens, temperature=0.0, use_cache=cache)


def _compiled_decoder(model: GPT, prompt: Tensor, new_tokens: int, cache: bool
                      ) -> Callable[[], Tensor]:
    return lambda: model.generate(prompt, new_tokens, temperature=0.0, use_cache=cache,
                                  compiled=True)


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
                   rounds: int = 3,
                   uncached_rounds: int = 3, prompt_len: int = PROMPT_LEN,
                   new_tokens: int = NEW_TOKENS, **overrides: Any) -> list[DecodeSpeed]:
    """Greedy decoding tokens/s of each contender at batch 1, with and without a KV cache.

    Cached and uncached decoders are compared in two interleaved groups: recomputing the
    context costs tens of times more, so the uncached group gets its own (smaller) round count.
    Eager glassgpt decodes with input-major fp32 weights (`GPT.input_major_weights`); the bf16
    copy and the compiled contenders (`compiled=True`, `generate(..., compiled=True)`) keep the
    default layout, which bf16 kernels and the compiled one-row reductions read faster.
    """
    model = bench_model(preset, dropout=0.0, **overrides).eval()
    check_decode_length(model.config, prompt_len, new_tokens)
    half = copy.deepcopy(model).to(torch.bfloat16) if bf16 else None  # default layout
    default_layout = copy.deepcopy(model) if compiled else None
    model.input_major_weights()
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len))
    hf_model = hf_twin(model) if against_hf else None
    # (contender, KV cache, dtype) -> model; the bf16 contenders decode from a bf16 copy.
    cached: dict[DecodeKey, nn.Module] = {(GLASSGPT, True, torch.float32): model}
    if default_layout is not None:
        cached[GLASSGPT_COMPILED, True, torch.float32] = default_layout
    if half is not None:
        cached[GLASSGPT, True, torch.bfloat16] = half
        if compiled:
            cached[GLASSGPT_COMPILED, True, torch.bfloat16] = half
    recomputing: dict[DecodeKey, nn.Module] = {(GLASSGPT, False, torch.float32): model}
    if hf_model is not None:
        cached[HF, True, torch.float32] = hf_model
        recomputing[HF, False, torch.float32] = hf_model
    # The bandwidth limit is probed alongside the cached decoders, which it is the limit of.
    times = _time_decoders(cached, prompt, new_tokens, rounds, {probes.READ: probes.read})
    bandwidth = probes.bandwidth(min(times.pop(probes.READ)))
    if uncached:
        times |= _time_decoders(recomputing, prompt, new_tokens, uncached_rounds)
    seconds = {key: statistics.median(t) for key, t in times.items()}
    weight_bytes = decode_bytes_per_token(model)  # fp32
    results = []
    for (name, cache, dtype), elapsed in seconds.items():
        dtype_bytes = weight_bytes * dtype.itemsize // 4
        tokens_per_s = new_tokens / elapsed
        results.append(DecodeSpeed(preset, name, cache, str(dtype).removeprefix("torch."),
                                    elapsed, tokens_per_s, dtype_bytes,
                                    tokens_per_s * dtype_bytes / bandwidth, bandwidth))
    return results


def _time_decoders(models: dict[DecodeKey, nn.Module], prompt: Tensor, new_tokens: int,
                   rounds: int, probes: dict[str, Callable[[], Any]] | None = None
                   ) -> dict[Any, list[float]]:
    """Seconds of each model's greedy decoding, and of each probe, in interleaved rounds."""
    def decoders(n: int) -> dict[Any, Callable[[], Any]]:
        make = {GLASSGPT: _glassgpt_decoder, GLASSGPT_COMPILED: _compiled_decoder,
                HF: _hf_decoder}
        return {key: make[key[0]](m, prompt, n, key[1]) for key, m in models.items()}

    # A short run touches every path, and compiles the compiled step (once per process).
    for warm_up in decoders(min(4, new_tokens)).values():
        warm_up()
    return interleaved_times({**decoders(new_tokens), **(probes or {})}, rounds, warmup=0)


@torch.no_grad()
def bf16_cost(preset: str, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS,
              **overrides: Any) -> PrecisionCost:
    """Teacher-force the fp32 greedy continuation through fp32 and bf16 copies and compare."""
    model = bench_model(preset, dropout=0.0, **overrides).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len))
    tokens = model.generate(prompt, new_tokens, temperature=0.0)[:, :-1]  # (1, T)
    reference = model(tokens)[0].float()  # (1, T, V)
    approx = copy.deepcopy(model).to(torch.bfloat16)(tokens)[0].float()
    kl = F.kl_div(approx.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)  # (1, T)
    agree = (reference.argmax(-1) == approx.argmax(-1)).float().mean()
    return PrecisionCost(preset, float(agree), float(kl.mean()),
                         float((reference - approx).abs().max()))


# --- where the time goes --------------------------------------------------------------------

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

    With `compiled`, the step is `generate.compiled_step()`: its kernels show up as one graph
    call, beside dynamo's guard check and whatever still runs outside the graph.
    """
    model = bench_model(preset, dropout=0.0).eval()
    if not compiled:
        model.input_major_weights()  # each contender in the layout it decodes with
    step_fn = compiled_step() if compiled else one_token_logits
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len))
    model.setup_kv_cache(1, None if compiled else prompt_len + 1)
    with torch.no_grad():
        model(prompt, start_pos=0, last_only=True)
        token = prompt[:, -1:].clone(memory_format=torch.contiguous_format)  # as sampled
        step = lambda: step_fn(model, token, prompt_len)  # noqa: E731
        step()  # warm-up (and compilation); the profiled step rewrites the same cache slot
        ops = top_ops(step, top, repeats=20)
    model.remove_kv_cache()
    label = "compiled decode step" if compiled else "decode step"
    return [OpShare(label, preset, _readable_op(name), share, calls)
            for name, share, calls in ops]


def _readable_op(name: str) -> str:
    """Profiler names of compiled graphs carry a hash; the name says what they are."""
    return "inductor kernels (one compiled graph)" if "CompiledFxGraph" in name else name


def profile_train_step(preset: str, top: int = 8, batch_size: int | None = None,
                       **overrides: Any) -> list[OpShare]:
    """The costliest operators of one eager training step (forward, backward, AdamW)."""
    model = bench_model(preset, **overrides)
    train_cfg = bench_train_config(preset, batch_size)
    data = torch.randint(0, model.config.vocab_size, (train_cfg.batch_size,
                                                      model.config.block_size + 1))
    step = _stepper(model, train_cfg, (data[:, :-1], data[:, 1:]))
    step()  # warm-up: the optimizer allocates its state on the first step
    return [OpShare("train step", preset, *op) for op in top_ops(step, top, repeats=2)]


# --- the whole report -----------------------------------------------------------------------

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
                if r.preset == preset and r.dtype == "float32"}
        for name in (GLASSGPT, GLASSGPT_COMPILED):
            ours = rows.get((name, True))
            for key, label in (((HF, True), "hf"), ((GLASSGPT, False), "glassgpt no-cache"),
                               ((HF, False), "hf no-cache")):
                if ours is not None and key in rows:
                    out.append(Speedup("decode", preset, name, label,
                                       ours.tokens_per_s / rows[key].tokens_per_s))
    return out


def machine_info() -> dict[str, Any]:
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "load_before": _load_average()}
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
                   train_dropout: float | None = 0.0,
                   progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """Everything `glassgpt bench` measures; `workload` is train, generate or all.

    Training runs without dropout by default, as nanoGPT's bench.py does: dropout's random
    masks cost time that no FLOP count includes. `train_dropout=None` keeps each preset's.
    """
    if workload not in ("train", "generate", "all"):
        raise ConfigError(f"unknown workload {workload!r}; choose train, generate or all")
    for preset in {*train_presets, *decode_presets}:
        load_preset(preset)  # an unknown name fails now, not after minutes of measuring
    if workload != "train":
        for preset in decode_presets:
            check_decode_length(GPTConfig.from_preset(preset), PROMPT_LEN, new_tokens)
    progress("measuring the machine's matmul peak and read bandwidth")
    probes = LimitProbes()
    report = BenchReport(machine_info(), measure_limits(probes))
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
            report.precision.append(bf16_cost(preset, new_tokens=new_tokens))
            if profile:
                report.profile += profile_decode_step(preset)
                if compiled:
                    report.profile += profile_decode_step(preset, compiled=True)
    report.machine["load_after"] = _load_average()
    return report
