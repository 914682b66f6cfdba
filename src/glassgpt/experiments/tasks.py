"""Synthetic "copy the token k positions back" data for the training experiments.

Notation: B = batch, T = positions, K = number of offsets asked for at once.
At position t the target for offset k is the token at t - k; positions where t - k falls before
the start of the sequence have no answer and carry the target IGNORE, which the loss and the
accuracy skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.experiments.results import step_taken

IGNORE = -1


def copy_back_batch(batch_size: int, seq_len: int, vocab_size: int, offsets: tuple[int, ...],
                    generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random tokens (B, T) and their targets (B, T, K): the token `offsets[k]` positions back."""
    tokens = torch.randint(vocab_size, (batch_size, seq_len), generator=generator)  # (B, T)
    targets = torch.full((batch_size, seq_len, len(offsets)), IGNORE, dtype=torch.long)
    for k, offset in enumerate(offsets):
        targets[:, offset:, k] = tokens[:, :seq_len - offset]
    return tokens, targets  # (B, T), (B, T, K)


def accuracy_per_target(logits: Tensor, targets: Tensor) -> list[float]:
    """Share of answerable positions predicted right, one number per offset.

    logits (B, T, K, V), targets (B, T, K).
    """
    answered = targets != IGNORE  # (B, T, K)
    correct = (logits.argmax(dim=-1) == targets) & answered  # (B, T, K)
    return (correct.sum(dim=(0, 1)) / answered.sum(dim=(0, 1))).tolist()


@contextmanager
def single_thread() -> Iterator[None]:
    """Run the block with one intra-op thread, then restore the previous count.

    The experiment models are tiny (a few thousand to a few hundred thousand parameters): handing
    each small matmul to several threads costs more than it saves, badly so on a busy machine.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train_copier(model: nn.Module, offsets: tuple[int, ...], vocab_size: int, seq_len: int,
                 steps: int, batch_size: int, lr: float, data: torch.Generator) -> list[float]:
    """Train `model` (idx (B, T) -> logits (B, T, K, V)) with Adam on fresh batches every step.

    Returns the training loss of every step.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        idx, targets = copy_back_batch(batch_size, seq_len, vocab_size, offsets, data)
        logits = model(idx)  # (B, T, K, V)
        loss = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1),
                               ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        step_taken()
    return losses
