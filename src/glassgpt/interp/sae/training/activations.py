"""Where a dictionary's training activations come from: a model run, one batch at a time.

`WindowActivations` draws random windows of a split's token ids (glassgpt's BatchSampler, its
generator's state the data position a checkpoint saves), runs the model on them under no_grad
with `run_with_cache(names=..., stop_at_layer=L + 1)` and flattens the positions: each step's
batch is `batch_tokens` activations of whole windows, and no more than that is ever held.
(SAELens shuffles a buffer of many batches instead; here a batch mixes `batch_tokens / context`
windows drawn from random places of the data.)
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn

from glassgpt.data import BatchSampler
from glassgpt.errors import DataError
from glassgpt.interp.core.hooked import as_glass, run_with_cache
from glassgpt.interp.core.names import stop_at_layer


class ActivationSource(Protocol):
    """next_batch() -> (x (N, d_in), y (N, d_out)); its state resumes it on the next batch."""

    def next_batch(self) -> tuple[Tensor, Tensor]: ...

    def get_state(self) -> Tensor: ...

    def set_state(self, state: Tensor) -> None: ...


class WindowActivations:
    def __init__(self, model: nn.Module, hook: str, target_hook: str, ids: np.ndarray,
                 context: int, batch_tokens: int, seed: int, device: torch.device | str):
        self.model, self.hook, self.target_hook = model, hook, target_hook
        self.names = list(dict.fromkeys([hook, target_hook]))
        self.stop_at_layer = stop_at_layer(self.names, as_glass(model).config.n_layer)
        self.batch_tokens = batch_tokens
        self.sampler = BatchSampler(ids, context, math.ceil(batch_tokens / context), seed,
                                    device, vocab_size=model.config.vocab_size)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        ids, _ = self.sampler.next_batch()  # (B, T)
        _, cache = run_with_cache(self.model, ids, self.names, self.stop_at_layer)
        x = cache[self.hook].flatten(0, -2)[:self.batch_tokens]  # (N, d_in)
        y = cache[self.target_hook].flatten(0, -2)[:self.batch_tokens]  # (N, d_out)
        check_finite_activations(x, self.hook)
        if self.target_hook != self.hook:  # an SAE's target is x itself: read it once
            check_finite_activations(y, self.target_hook)
        return x, y

    def get_state(self) -> Tensor:
        return self.sampler.get_state()

    def set_state(self, state: Tensor) -> None:
        self.sampler.set_state(state)


def check_finite_activations(activations: Tensor, hook: str) -> None:
    if not bool(torch.isfinite(activations).all()):
        raise DataError(f"the model's activations at {hook} hold NaN or infinite values; a "
                        f"dictionary cannot be trained on them (check the run's weights)")


class TensorActivations:
    """Activations already computed (cached to a file, or a toy's), read in order one batch of
    `batch_tokens` rows a step, from the start again when they run out; its state is the
    next row. `targets` (a transcoder's) default to the activations themselves."""

    def __init__(self, activations: Tensor, batch_tokens: int, targets: Tensor | None = None):
        if targets is not None and targets.shape[0] != activations.shape[0]:
            raise DataError(f"{targets.shape[0]} target rows for {activations.shape[0]} "
                            f"activations")
        check_finite_activations(activations, "the activations given")
        self.x = activations  # (rows, d_in)
        self.y = activations if targets is None else targets  # (rows, d_out)
        self.batch_tokens = batch_tokens
        self.row = 0

    def next_batch(self) -> tuple[Tensor, Tensor]:
        if self.row + self.batch_tokens > self.x.shape[0]:
            self.row = 0
        rows = slice(self.row, self.row + self.batch_tokens)
        self.row += self.batch_tokens
        return self.x[rows], self.y[rows]

    def get_state(self) -> Tensor:
        return torch.tensor(self.row)

    def set_state(self, state: Tensor) -> None:
        self.row = int(state)
