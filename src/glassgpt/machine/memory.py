"""How much memory a device has, and how much a model or a training step needs: checked before
anything is allocated, so that a size typed wrong is one clear line instead of an allocator
crash (or a machine brought to its knees).

This module sits below the model: it reads a config's sizes and is handed the parameter count
(`glassgpt.model.parameter_count(config)`, or `count_parameters(model)` of a built one)."""

from __future__ import annotations

import os

import torch

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError


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


# glibc's malloc serves an allocation from this size up (its own starting value) as its own
# mapping, returned to the OS when freed. Left alone, glibc raises the threshold (to 32 MiB)
# after the first such free, and a training step's freed activations then stay in its heap,
# fragmented: LoRA on Qwen3-0.6B's shape peaked 400 MiB higher (BENCHMARKS.md, "LoRA at real
# size"). Fixed at 128 KiB it measured as fast as at 1 MiB, and 20-70 MiB lower.
MMAP_THRESHOLD = 2**17
M_MMAP_THRESHOLD = -3  # mallopt's parameter number, glibc's malloc.h


def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD for this process, so that large buffers go
    back to the OS when freed; whether it was set (False off glibc, where nothing changes)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # another libc's mallopt means other things
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def gib(count: int) -> str:
    """Bytes as GiB for a message: '3.2 GiB'."""
    return f"{count / 2**30:,.1f} GiB"


# Host memory of one block's Python objects (its ~15 nn.Modules and ~17 hook points, their dicts
# and the tensor objects), whatever its width: measured ~105 KB a block with torch 2.13
# (tests/test_modern.py holds the estimate above the measurement). 100,000 layers are gigabytes
# before any weight.
HOST_BYTES_PER_LAYER = 128 * 1024


def model_memory(config: GPTConfig, parameters: int) -> dict[str, int]:
    """Bytes a GPT of `config` with `parameters` holds once built, by part: float32 weights, the
    Python objects of its modules, and the buffers that scale with the config (the positions'
    indices)."""
    return {"weights": 4 * parameters,
            "module objects": HOST_BYTES_PER_LAYER * config.n_layer,
            "buffers": 8 * config.block_size}


def check_model_fits_memory(config: GPTConfig, parameters: int) -> None:
    """Refuse, before allocating, a model that alone exceeds this machine's memory."""
    parts = model_memory(config, parameters)
    needed, available = sum(parts.values()), physical_memory()
    if available is not None and needed > available:
        detail = ", ".join(f"{name} {gib(count)}" for name, count in parts.items())
        raise ConfigError(f"n_layer={config.n_layer}, n_embd={config.n_embd}, vocab_size="
                          f"{config.vocab_size}, block_size={config.block_size} make "
                          f"{parts['weights'] // 4:,} parameters: about {gib(needed)} "
                          f"({detail}) before training starts, more than this machine's "
                          f"{gib(available)} of memory")


def activation_floats_per_token(config: GPTConfig) -> int:
    """Floats kept for backward per token, over all layers: an upper estimate from the config.

    Per layer, in features: norm inputs and outputs (4C); q, k and v (H d + 2 KV widths, d the
    head width), once more for each of rotary and QK-norm when on; the attention output (H d)
    and projection (C); the
    MLP's hidden tensors (2F before and after the activation; 4F for SwiGLU's gate, up, SiLU and
    product); dropout masks and residual sums (3C). The explicit path adds the scores, softmax
    and dropout mask of every head (3 H S). GPT-2's shape gives 20C a layer.
    """
    C, F = config.n_embd, config.hidden_width
    qkv = config.q_width + 2 * config.kv_width
    per_layer = 4 * C + qkv + config.q_width + C + 3 * C
    per_layer += (4 if config.activation == "swiglu" else 2) * F
    per_layer += qkv * ((config.position == "rope") + config.qk_norm)
    if config.attn_impl == "explicit":
        per_layer += 3 * config.n_head * config.block_size
    return config.n_layer * per_layer


def training_memory(config: GPTConfig, batch_size: int, amp_dtype: torch.dtype | None,
                    parameters: int) -> dict[str, int]:
    """Bytes one training step needs, by part: the model (`model_memory`), gradients and
    AdamW's two moments (12 more bytes a parameter), and the activations of one micro-batch,
    logits included.

    A rough upper estimate: it exists to refuse a job that cannot fit before it is tried
    (`--batch-size 10000000`, `--n-layer 100000`), not to tune one.
    """
    model = model_memory(config, parameters)
    tokens = batch_size * config.block_size
    activation_bytes = 2 if amp_dtype is not None else 4
    # float32 logits, log-softmax and gradient (and the capped copy with a soft-cap)
    logits = tokens * config.vocab_size * 4 * (3 if config.logit_softcap is None else 4)
    return {**model, "gradients": 4 * parameters, "AdamW moments": 8 * parameters,
            "activations": tokens * activation_floats_per_token(config) * activation_bytes
            + logits}


def check_training_fits_memory(config: GPTConfig, batch_size: int,
                               amp_dtype: torch.dtype | None, device: torch.device,
                               parameters: int) -> None:
    """Refuse, with the numbers, a training job whose step cannot fit in `device`'s memory."""
    parts = training_memory(config, batch_size, amp_dtype, parameters)
    needed, available = sum(parts.values()), device_memory(device)
    if available is not None and needed > available:
        detail = ", ".join(f"{name} {gib(count)}" for name, count in parts.items())
        raise ConfigError(f"training needs about {gib(needed)} ({detail}) with batch_size="
                          f"{batch_size} and block_size={config.block_size}, more than "
                          f"the {gib(available)} of {device}; lower --batch-size (--grad-accum "
                          f"keeps the tokens per step) or the model's size")
