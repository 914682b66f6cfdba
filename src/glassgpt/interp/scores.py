"""Head scores on a repeated random sequence: previous-token, duplicate-token and induction.

Feed tokens r_0 .. r_{n-1} r_0 .. r_{n-1} (a random half, then the same half again). In the
second half, at position i = n + j a head can look at
    i - 1       the previous token                 (a previous-token head)
    i - n       the same token, first time round     (a duplicate-token head)
    i - n + 1   the token after it, first time round (an induction head: "what came next")
A head's score is the attention it puts there, averaged over the second half and the batch;
the previous-token score is taken over every position after the first. A score is in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.hooked import run_with_cache


@dataclass(frozen=True)
class HeadScores:
    previous_token: Tensor  # (L, H)
    duplicate_token: Tensor  # (L, H)
    induction: Tensor  # (L, H)
    half: int  # n: the length of the random half


def repeated_random_tokens(vocab_size: int, half: int, batch: int,
                           seed: int = 0) -> Tensor:
    """(batch, 2 * half) ids: a random half, then that half again."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(vocab_size, (batch, half), generator=generator)
    return torch.cat([first, first], dim=1)


def diagonal_mean(pattern: Tensor, offset: int, start: int) -> Tensor:
    """pattern (B, H, T, T) -> (H,): the mean of pattern[:, :, i, i - offset] for i >= start."""
    T = pattern.shape[-1]
    queries = torch.arange(start, T)
    return pattern[:, :, queries, queries - offset].mean(dim=(0, 2))


def head_scores(model: nn.Module, half: int | None = None, batch: int = 8,
                seed: int = 0) -> HeadScores:
    """Every head's previous-token, duplicate-token and induction score (each (L, H))."""
    block_size = model.config.block_size
    half = block_size // 2 if half is None else half
    if isinstance(half, bool) or not isinstance(half, int) or not 2 <= half <= block_size // 2:
        raise InputError(f"half must be an int in [2, block_size // 2 = {block_size // 2}], "
                         f"got {half!r}")
    ids = repeated_random_tokens(model.config.vocab_size, half, batch, seed)
    ids = ids.to(next(model.parameters()).device)
    _, cache = run_with_cache(model, ids, names=lambda n: n.endswith("attn.hook_pattern"))
    patterns = [cache[f"blocks.{l}.attn.hook_pattern"].float()
                for l in range(model.config.n_layer)]
    return HeadScores(
        previous_token=torch.stack([diagonal_mean(p, 1, 1) for p in patterns]).cpu(),
        duplicate_token=torch.stack([diagonal_mean(p, half, half) for p in patterns]).cpu(),
        induction=torch.stack([diagonal_mean(p, half - 1, half) for p in patterns]).cpu(),
        half=half,
    )
