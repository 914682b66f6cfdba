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
from glassgpt.interp import checks
from glassgpt.interp.hooked import check_run_ids, hook_points, run_with_cache


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


def check_repeated(tokens: Tensor, block_size: int) -> Tensor:
    """tokens (B, 2n) whose halves are equal, n >= 2, 2n <= block_size; else InputError."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.shape[1] % 2 \
            or not 4 <= tokens.shape[1] <= block_size:
        shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise InputError(f"tokens must be (batch, 2n) with 4 <= 2n <= block_size = "
                         f"{block_size}, got {shape}")
    check_run_ids(tokens)  # a batch of at least one, integer ids
    half = tokens.shape[1] // 2
    if not torch.equal(tokens[:, :half], tokens[:, half:]):
        raise InputError("tokens must repeat: their second half must equal their first")
    return tokens


def diagonal_mean(pattern: Tensor, offset: int, start: int) -> Tensor:
    """pattern (B, H, T, T) -> (H,): the mean of pattern[:, :, i, i - offset] for i >= start."""
    T = pattern.shape[-1]
    queries = torch.arange(start, T)
    return pattern[:, :, queries, queries - offset].mean(dim=(0, 2))


def head_scores(model: nn.Module, half: int | None = None, batch: int = 8,
                seed: int = 0, tokens: Tensor | None = None) -> HeadScores:
    """Every head's previous-token, duplicate-token and induction score (each (L, H)).

    `tokens` (B, 2n), whose second half repeats the first, replaces the random ones: a model
    trained on text may copy only what looks like its text (a character model's words, say)."""
    hook_points(model)
    block_size = model.config.block_size
    if tokens is not None:
        ids = check_repeated(tokens, block_size)
        half = ids.shape[1] // 2
    else:
        half = block_size // 2 if half is None else half
        if isinstance(half, bool) or not isinstance(half, int) \
                or not 2 <= half <= block_size // 2:
            raise InputError(f"half must be an int in [2, block_size // 2 = "
                             f"{block_size // 2}], got {half!r}")
        checks.within("batch", batch, 1, 2**20)
        checks.within("seed", seed, 0, 2**63 - 1)  # what torch.Generator.manual_seed takes
        ids = repeated_random_tokens(model.config.vocab_size, half, batch, seed)
    ids = ids.to(next(model.parameters()).device)
    _, cache = run_with_cache(model, ids, names=lambda n: n.endswith("attn.hook_pattern"),
                              stop_at_layer=model.config.n_layer)  # no LM head: patterns only
    patterns = [cache[f"blocks.{l}.attn.hook_pattern"].float()
                for l in range(model.config.n_layer)]
    return HeadScores(
        previous_token=torch.stack([diagonal_mean(p, 1, 1) for p in patterns]).cpu(),
        duplicate_token=torch.stack([diagonal_mean(p, half, half) for p in patterns]).cpu(),
        induction=torch.stack([diagonal_mean(p, half - 1, half) for p in patterns]).cpu(),
        half=half,
    )
