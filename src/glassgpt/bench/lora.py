"""LoRA fine-tuning at real size on a CPU: steps/s and peak memory against the base's weights.

`bench_lora(size)` runs one worker process (`python -m glassgpt.bench.lora SIZE_JSON`), so that
its peak resident memory (ru_maxrss) is the fine-tune's own: it builds a model of the preset's
shape with random weights straight in the base dtype (bf16 where the CPU has bf16 matrix
instructions, else float32: never a float32 copy first), adds float32 adapters on every
projection (glassgpt.adapters.lora), and takes optimizer steps on random token windows, the
first untimed. The aim: peak memory at most 1.5x the bf16 weights (the weights, the adapters,
their Adam state, and the activations of one window). Library only: the CLI (`glassgpt bench
lora`) prints it.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from glassgpt.adapters.lora import add_lora, lora_parameters
from glassgpt.adapters.settings import TARGETS, LoraSettings
from glassgpt.config import GPTConfig
from glassgpt.machine.devices import cpu_bf16_support
from glassgpt.machine.memory import return_large_buffers
from glassgpt.model import GPT
from glassgpt.rundir.weights import model_holding, parameters_on_meta
from glassgpt.training.steps import fused_loss, recompute_blocks


@dataclass(frozen=True)
class LoraBenchSize:
    preset: str = "qwen3-0.6b"
    n_layer: int | None = None  # None: the preset's
    rank: int = 16
    alpha: float = 32.0
    batch_size: int = 1
    seq_len: int = 256
    steps: int = 4  # the first untimed
    checkpointed: bool = False  # recompute each block's activations and the logits


FULL = LoraBenchSize()
QUICK = LoraBenchSize(n_layer=4, seq_len=128, steps=3)
WAYS = (False, True)  # each size is measured without and with activation checkpointing


@dataclass
class LoraBenchResult:
    size: LoraBenchSize
    dtype: str  # the base's
    parameters: int  # the base's
    adapter_parameters: int
    base_weight_mib: float  # the base's weights in bf16 (2 bytes each)
    peak_rss_mib: float  # the worker's high-water resident memory
    seconds_per_step: float  # median of the timed steps
    loss_first: float
    loss_last: float

    @property
    def peak_over_bf16_weights(self) -> float:
        return self.peak_rss_mib / self.base_weight_mib


def bench_lora(size: LoraBenchSize = FULL) -> LoraBenchResult:
    """The figures of the module docstring, from a fresh worker process."""
    done = subprocess.run([sys.executable, "-m", "glassgpt.bench.lora", json.dumps(asdict(size))],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the LoRA bench failed: {done.stderr.strip()[-2000:]}")
    return LoraBenchResult(size, **json.loads(done.stdout.strip().splitlines()[-1]))


def base_model(size: LoraBenchSize, dtype: torch.dtype) -> GPT:
    """Random weights of the preset's shape, each made in `dtype` and once: the model is built
    around them as a loaded run's is (glassgpt.rundir.weights.model_holding), so the peak is
    the weights and not a float32 or untied copy first (norm gains 1, biases 0, the rest
    N(0, 0.02))."""
    overrides = {} if size.n_layer is None else {"n_layer": size.n_layer}
    config = GPTConfig.from_preset(size.preset, **overrides)
    with parameters_on_meta():
        shapes = GPT(config).state_dict()
    if config.tie_weights:
        shapes.pop("lm_head.weight")
    generator = torch.Generator().manual_seed(0)
    tensors = {name: _random_weight(name, meta.shape, dtype, generator)
               for name, meta in shapes.items() if meta.is_meta}
    return model_holding(config, tensors, f"the {size.preset} shape")


def _random_weight(name: str, shape: torch.Size, dtype: torch.dtype,
                   generator: torch.Generator) -> torch.Tensor:
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1:  # a norm's gain
        return torch.ones(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=generator)


def measure(size: LoraBenchSize) -> dict:
    """Run in the worker: build, adapt, train, and report (JSON-ready)."""
    return_large_buffers()  # as glassgpt.training.finetune does
    dtype = torch.bfloat16 if cpu_bf16_support() else torch.float32
    model = base_model(size, dtype)
    add_lora(model, LoraSettings(size.rank, size.alpha, targets=TARGETS))
    if size.checkpointed:
        recompute_blocks(model)
    fused_loss(model)
    adapters = list(lora_parameters(model).values())
    for adapter in adapters:  # B starts at 0; make the adapters do something from step 1
        torch.nn.init.normal_(adapter, std=0.01)
    optimizer = torch.optim.AdamW(adapters, lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    vocab, losses, seconds = model.config.vocab_size, [], []
    model.train()
    for step in range(size.steps):
        ids = torch.randint(vocab, (size.batch_size, size.seq_len + 1), generator=generator)
        start = time.perf_counter()
        _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > 0:
            seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
    n_base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return {"dtype": str(dtype).removeprefix("torch."), "parameters": n_base,
            "adapter_parameters": sum(a.numel() for a in adapters),
            "base_weight_mib": n_base * 2 / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "seconds_per_step": statistics.median(seconds), "loss_first": losses[0],
            "loss_last": losses[-1]}


if __name__ == "__main__":
    print(json.dumps(measure(LoraBenchSize(**json.loads(sys.argv[1])))))
