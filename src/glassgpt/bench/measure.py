"""The measuring harness: interleaved timing, the machine's limits, model arithmetic, and
the contenders' models (glassgpt's and its Hugging Face twin)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.model import GPT, count_parameters

MAX_TRAIN_BATCH = 12  # caps a preset's batch so one step stays around a second on a laptop CPU

GLASSGPT, GLASSGPT_COMPILED, HF = "glassgpt", "glassgpt+compile", "hf"
GLASSGPT_EAGER = "glassgpt eager"  # decoding on the reference engine: the plain model
FP32, BF16 = "float32", "bfloat16"  # dtype names in every result row
Key = TypeVar("Key")


# --- timing ---------------------------------------------------------------------------------

def interleaved_times(contenders: dict[Key, Callable[[], Any]], rounds: int,
                      warmup: int = 1, sync: Callable[[], Any] | None = None
                      ) -> dict[Key, list[float]]:
    """Seconds of every timed call of each contender, run in interleaved, rotating rounds.

    `sync` waits for queued device work (`torch.cuda.synchronize` on a GPU, where a call
    returns before its kernels finish); it runs before the clock starts and before it is read.
    """
    if rounds <= 0:
        raise ConfigError(f"rounds must be positive, got {rounds}")
    sync = sync or (lambda: None)
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    seconds: dict[Key, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync()
            start = time.perf_counter()
            contenders[name]()
            sync()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def interleaved_medians(contenders: dict[Key, Callable[[], Any]], rounds: int,
                        warmup: int = 1, sync: Callable[[], Any] | None = None
                        ) -> dict[Key, float]:
    """Median seconds per call of each contender, timed in interleaved, rotating rounds."""
    times = interleaved_times(contenders, rounds, warmup, sync)
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

    def __init__(self, matmul_size: int = 2048, buffer_bytes: int = 256 * 2**20,
                 device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.a = torch.randn(matmul_size, matmul_size, device=self.device)
        self.b = torch.randn(matmul_size, matmul_size, device=self.device)
        self.buffer = torch.ones(buffer_bytes // 4, device=self.device)

    @classmethod
    def for_device(cls, device: torch.device | str) -> LimitProbes:
        """Probes sized for the device: a GPU needs a far larger product to reach its peak,
        and a buffer far larger than its caches."""
        if torch.device(device).type == "cuda":
            return cls(matmul_size=8192, buffer_bytes=2**30, device=device)
        return cls(device=device)

    def sync(self) -> None:
        """Wait for the device (a GPU runs asynchronously) before the clock is read."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def matmul(self) -> Tensor:
        return self.a @ self.b

    def matmul_bf16(self) -> Tensor:
        """The peak that bf16 autocast training runs against: the same product in bfloat16."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            return self.a @ self.b

    def read(self) -> Tensor:
        return self.buffer.sum()

    def flops(self, seconds: float) -> float:
        return 2 * self.a.shape[0] ** 3 / seconds

    def bandwidth(self, seconds: float) -> float:
        return self.buffer.numel() * self.buffer.element_size() / seconds


def measure_limits(probes: LimitProbes, rounds: int = 7) -> MachineLimits:
    """The fp32 matmul peak and the memory read bandwidth, measured side by side."""
    times = interleaved_times({probes.MATMUL: probes.matmul, probes.READ: probes.read}, rounds,
                              sync=probes.sync)
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
    """Bytes of weights one decoding step reads: all of them, but one row of each lookup table
    (a token or position table the LM head does not also read whole).

    The LM head reads the whole token table even when it is tied to the embedding; an int8
    model's (glassgpt.decoding.quantized) head and tied table are its int8 rows and scales.
    """
    head = {id(p) for p in model.lm_head.parameters()}
    lookups = {id(table.weight) for table in (model.tok_emb, model.pos_emb)
               if isinstance(table, nn.Embedding) and id(table.weight) not in head}
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

    def forward(self, idx: Tensor, targets: Tensor, check_ids: bool = True
                ) -> tuple[Tensor, Tensor]:
        """`check_ids` is glassgpt's (the trainer's batches are checked); HF checks nothing."""
        logits = self.hf(input_ids=idx).logits  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def hf_twin(model: GPT) -> nn.Module:
    """A `transformers` GPT2LMHeadModel with exactly `model`'s shape and weights."""
    from glassgpt.formats.interop import to_hf  # transformers is an optional extra: import late

    hf_model = to_hf(model)
    hf_model.generation_config.pad_token_id = 0  # silences a warning; batch 1 never pads
    return hf_model


def bench_model(preset: str, device: torch.device | str = "cpu", **overrides: Any) -> GPT:
    """A randomly initialised GPT of `preset`'s shape (seeded, so every run builds the same)."""
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset(preset, **overrides)).to(device)
