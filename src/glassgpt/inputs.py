"""The checks of what a caller hands the model: token ids and targets, and the stream and
padding mask an attention layer or a block is called with, each refused in one clear
InputError naming the value, never an opaque index or shape failure deep inside torch.

Shapes: B = batch, T = positions, S = key positions, C = width. `GPT.check_tokens` adds what
only the model knows (its `block_size`); the decoders check a prompt's ids once, where it
enters (`check_token_ids`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from glassgpt.errors import InputError
from glassgpt.norms import autocast_enabled

ID_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding takes
TARGET_DTYPES = (torch.int64,)  # what cross_entropy takes, -1 included


def check_id_tensor(idx: object, what: str = "token ids",
                    dtypes: tuple[torch.dtype, ...] = ID_DTYPES) -> None:
    """Raise InputError unless idx is a torch tensor of `dtypes` holding values (not meta)."""
    if not isinstance(idx, Tensor):
        raise InputError(f"{what} must be a torch tensor of integers (B, T), got "
                         f"{type(idx).__name__}; use torch.tensor(...)")
    if idx.dtype not in dtypes:
        raise InputError(f"{what} must be integers, got dtype {idx.dtype} (use torch.long)")
    if idx.device.type == "meta":
        raise InputError(f"{what} are on the meta device, which holds shapes but no values")


def check_token_ids(idx: Tensor, vocab_size: int) -> None:
    """Raise InputError naming the first id of idx outside [0, vocab_size) (reads ids back)."""
    check_id_tensor(idx)
    if idx.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(idx))
    if low < 0 or high >= vocab_size:
        raise InputError(f"token id {low if low < 0 else high} is outside the vocabulary "
                         f"[0, {vocab_size})")


def check_targets(targets: Tensor, idx: Tensor, vocab_size: int, check_ids: bool) -> None:
    """Targets are next-token ids shaped like idx (B, T), or -1 where no loss is wanted.

    With `check_ids` the values are read back (a host sync on a GPU), as for the ids."""
    check_id_tensor(targets, "targets", TARGET_DTYPES)
    if targets.shape != idx.shape:
        raise InputError(f"targets must have the shape of the token ids {tuple(idx.shape)}, "
                         f"got {tuple(targets.shape)}")
    if check_ids and targets.numel():
        low, high = (int(v) for v in torch.aminmax(targets))
        if low < -1 or high >= vocab_size:
            raise InputError(f"target {low if low < -1 else high} is outside the vocabulary "
                             f"[0, {vocab_size}) (or -1 to skip a position)")


def float_dtype(layer: torch.nn.Module) -> torch.dtype:
    """The dtype a layer's input must have: its weight's, or, for a quantized layer keeping no
    float weight (glassgpt.decoding's int8 and block layers), its `float_dtype`, read without
    dequantizing the weight (a whole LM head a step, otherwise)."""
    dtype = getattr(layer, "float_dtype", None)
    return dtype if dtype is not None else layer.weight.dtype


def check_stream(x: object, d_model: int, weight: Tensor | torch.dtype, what: str) -> None:
    """Raise InputError unless x is a float tensor (B, T, C=d_model), B and T at least 1, in
    the weights' dtype (`weight`: one of them, or its dtype; under autocast any float dtype:
    autocast chooses each product's)."""
    wanted = weight if isinstance(weight, torch.dtype) else weight.dtype
    if not isinstance(x, Tensor):
        raise InputError(f"{what} takes a tensor (B, T, C={d_model}), got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise InputError(f"{what} takes x of shape (B, T, C={d_model}), got {tuple(x.shape)}")
    if 0 in x.shape[:2]:
        raise InputError(f"{what} takes x of at least one sequence (B) of one position (T), got "
                         f"shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise InputError(f"{what} takes floating-point x, got dtype {x.dtype}")
    if x.dtype != wanted and not autocast_enabled(x.device.type):
        raise InputError(f"{what}: x is {x.dtype} but its weights are {wanted}; cast one "
                         f"to the other (e.g. x.to({wanted}))")


def check_pad_mask(pad_mask: object, x: Tensor) -> None:
    """Raise InputError unless `pad_mask` is None or a bool tensor (B or 1, S) on x's device,
    True on the padding keys (nn.MultiheadAttention's key_padding_mask). Only bool: a Hugging
    Face attention_mask holds 1 on the real tokens, the opposite, and would hide them all.
    S, the keys' count, is checked where the keys are known (`build_attention_mask`)."""
    if pad_mask is None:
        return
    if not isinstance(pad_mask, Tensor):
        raise InputError(f"pad_mask must be a bool tensor (B, S), True on padding keys, got "
                         f"{type(pad_mask).__name__}")
    if pad_mask.dtype != torch.bool:
        raise InputError(f"pad_mask must be a bool tensor, True on padding keys, got dtype "
                         f"{pad_mask.dtype}; from an attention_mask of 1 on real tokens, pass "
                         f"attention_mask == 0")
    B = x.shape[0]
    if pad_mask.dim() != 2 or pad_mask.shape[0] not in (1, B):
        raise InputError(f"pad_mask must be of shape (B={B}, S) (or (1, S) for every row), got "
                         f"{tuple(pad_mask.shape)}")
    if pad_mask.device != x.device:
        raise InputError(f"pad_mask is on {pad_mask.device} but x is on {x.device}")
