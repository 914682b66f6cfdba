"""How much memory a device has, and how much a model or a training step needs: checked before
anything is allocated, so that a size typed wrong is one clear line instead of an allocator
crash (or a machine brought to its knees)."""

from __future__ import annotations

import dataclasses
import os

import torch

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.model import GPT, count_parameters


def physical_memory() -> int | None:
    """Bytes of RAM, where the OS tells (Linux, macOS); None elsewhere."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of `device`: a GPU's own, the machine's RAM for a CPU (and for mps,
    which shares it); None when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return physical_memory()


def gib(count: int) -> str:
    """Bytes as GiB for a message: '3.2 GiB'."""
    return f"{count / 2**30:,.1f} GiB"


def parameter_count(config: GPTConfig) -> int:
    """Parameters of a GPT of `config`, counted without allocating it."""
    try:
        with torch.device("meta"):  # shapes only; one and two layers give the cost of a layer
            one, two = (count_parameters(GPT(dataclasses.replace(config, n_layer=n)))
                        for n in (1, 2))
    except RuntimeError as error:  # sizes whose product overflows
        raise ConfigError(f"n_embd={config.n_embd}, vocab_size={config.vocab_size}, block_size="
                          f"{config.block_size} make tensors too large to exist "
                          f"({error})") from None
    return one + (config.n_layer - 1) * (two - one)


def check_model_fits_memory(config: GPTConfig) -> None:
    """Refuse, before allocating, a model whose weights alone exceed this machine's memory."""
    params = parameter_count(config)
    needed, available = 4 * params, physical_memory()  # float32 weights
    if available is not None and needed > available:
        raise ConfigError(f"n_layer={config.n_layer}, n_embd={config.n_embd}, vocab_size="
                          f"{config.vocab_size}, block_size={config.block_size} make "
                          f"{params:,} parameters: {needed / 2**30:,.0f} GiB of weights alone, "
                          f"more than this machine's {available / 2**30:,.0f} GiB of memory")


# Floats kept for backward per token and layer, in units of C: LayerNorm inputs and outputs
# (4), q, k, v (3), attention output and projection (2), MLP hidden before and after the
# activation (8), dropout masks and residual sums (3). An upper estimate, like the rest.
ACTIVATION_FLOATS_PER_LAYER = 20


def training_memory(config: GPTConfig, batch_size: int,
                    amp_dtype: torch.dtype | None) -> dict[str, int]:
    """Bytes one training step needs, by part: float32 weights, gradients and AdamW's two
    moments (16 bytes a parameter), and the activations of one micro-batch, logits included.

    A rough upper estimate: it exists to refuse a job that cannot fit before it is tried
    (`--batch-size 10000000`), not to tune one.
    """
    params = parameter_count(config)
    tokens = batch_size * config.block_size
    per_token = config.n_layer * ACTIVATION_FLOATS_PER_LAYER * config.n_embd
    if config.attn_impl == "explicit":  # scores, softmax and dropout mask of every head
        per_token += config.n_layer * 3 * config.n_head * config.block_size
    activation_bytes = 2 if amp_dtype is not None else 4
    logits = tokens * config.vocab_size * 4 * 3  # float32 logits, log-softmax, gradient
    return {"weights": 4 * params, "gradients": 4 * params, "AdamW moments": 8 * params,
            "activations": tokens * per_token * activation_bytes + logits}


def check_training_fits_memory(config: GPTConfig, batch_size: int,
                               amp_dtype: torch.dtype | None, device: torch.device) -> None:
    """Refuse, with the numbers, a training job whose step cannot fit in `device`'s memory."""
    parts = training_memory(config, batch_size, amp_dtype)
    needed, available = sum(parts.values()), device_memory(device)
    if available is not None and needed > available:
        detail = ", ".join(f"{name} {gib(count)}" for name, count in parts.items())
        raise ConfigError(f"training needs about {gib(needed)} ({detail}) with batch_size="
                          f"{batch_size} and block_size={config.block_size}, more than "
                          f"the {gib(available)} of {device}; lower --batch-size (--grad-accum "
                          f"keeps the tokens per step) or the model's size")
