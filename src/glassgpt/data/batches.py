"""Random training windows, and the sequential windows of an evaluation.

`BatchSampler` draws random windows from the ids as nanoGPT does, from its own seeded generator
so that its state can be saved in a checkpoint and training resumes on exactly the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from glassgpt.errors import DataError


class BatchSampler:
    """Random windows (x, y) of `block_size` tokens, y shifted by one, from a split's ids.

    Draws from its own torch.Generator: the global RNG (dropout) and this stream stay apart,
    and `get_state`/`set_state` let a checkpoint resume on the very next batch.
    """

    def __init__(self, ids: np.ndarray, block_size: int, batch_size: int, seed: int,
                 device: str | torch.device = "cpu", vocab_size: int | None = None):
        if len(ids) <= block_size:
            raise DataError(f"{len(ids)} tokens are too few for block_size={block_size}")
        self.ids, self.block_size, self.batch_size = ids, block_size, batch_size
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = np.arange(block_size + 1)  # (T + 1,)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """x, y: (B, T) int64 on the sampler's device."""
        starts = torch.randint(len(self.ids) - self.block_size, (self.batch_size,),
                               generator=self.generator).numpy()
        windows = self.ids[starts[:, None] + self.offsets]  # (B, T + 1), still on the host
        check_window_ids(windows, self.vocab_size)
        windows = torch.from_numpy(windows.astype(np.int64))
        if self.device.type == "cuda":
            windows = windows.pin_memory().to(self.device, non_blocking=True)
        else:
            windows = windows.to(self.device)
        return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)

    def get_state(self) -> Tensor:
        return self.generator.get_state()

    def set_state(self, state: Tensor) -> None:
        self.generator.set_state(state)


def check_window_ids(windows: np.ndarray, vocab_size: int | None) -> None:
    """Raise DataError for an id outside the vocabulary. Checked here, on the host, where it
    costs a few microseconds: the model then need not read ids back from a GPU each step."""
    if vocab_size is not None and windows.size and int(windows.max()) >= vocab_size:
        raise DataError(f"the data holds token id {int(windows.max())}, outside the "
                        f"vocabulary [0, {vocab_size}); prepare it again")


def sequential_batches(ids: np.ndarray, block_size: int, batch_size: int, max_batches: int,
                       device: str | torch.device = "cpu", vocab_size: int | None = None
                       ) -> Iterator[tuple[Tensor, Tensor]]:
    """Non-overlapping windows from the start of `ids`, for a deterministic evaluation."""
    n_windows = min((len(ids) - 1) // block_size, batch_size * max_batches)
    for first in range(0, n_windows, batch_size):
        starts = np.arange(first, min(first + batch_size, n_windows)) * block_size
        windows = ids[starts[:, None] + np.arange(block_size + 1)]  # (B, T + 1)
        check_window_ids(windows, vocab_size)
        windows = torch.from_numpy(windows.astype(np.int64)).to(device)
        yield windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)
