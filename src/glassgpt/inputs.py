"""The checks of what a caller hands the model: token ids and targets, each refused in one
clear InputError naming the value, never an opaque index failure deep inside torch.

Shapes: B = batch, T = positions. `GPT.check_tokens` adds what only the model knows (its
`block_size`); the decoders check a prompt's ids once, where it enters (`check_token_ids`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from glassgpt.errors import InputError

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
