"""One forward pass over a prompt, kept: what it showed (`Inside`: attention weights and
scores, the logit lens, the residual stream and the loss), and the most recent ones within a
byte budget (`TraceCache`), so that switching layers or heads on the page does not run the model
again. Notation: L = layers, H = heads, T = prompt tokens, k = top tokens kept, C = width.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

from glassgpt.interp.methods.lens import TopK

TRACE_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Inside:
    """What one forward pass over a prompt showed: kept for the page's next questions."""

    attention: Tensor  # (L, H, T, T)
    scores: Tensor  # (L, H, T, T): before the softmax, -inf where the model hid a key
    lens: TopK  # (L + 1, T, MAX_TOP_K): after the embeddings, then after each layer
    residuals: Tensor  # (L + 1, 1, T, C): for the scores, one head's steps, sampling's view
    loss: float | None  # mean cross-entropy of the prompt's next tokens (None: one token)

    @property
    def nbytes(self) -> int:
        tensors = (self.attention, self.scores, self.lens.probs, self.lens.ids, self.residuals)
        return sum(t.numel() * t.element_size() for t in tensors)


class TraceCache:
    """The `Inside` of the most recent prompts, by token ids, within a byte budget."""

    def __init__(self, budget_bytes: int = TRACE_CACHE_BYTES):
        self.budget = budget_bytes
        # Keyed by the prompt's ids and what was switched off (None: the intact model).
        self.entries: OrderedDict[tuple, Inside] = OrderedDict()
        self.lock = threading.Lock()  # the server asks from several threads

    def get(self, key: tuple) -> Inside | None:
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
            return self.entries.get(key)

    def put(self, key: tuple, inside: Inside) -> None:
        with self.lock:
            self.entries[key] = inside
            self.entries.move_to_end(key)
            # The newest entry stays even over budget: it is the one being looked at.
            while len(self.entries) > 1 and self._total() > self.budget:
                self.entries.popitem(last=False)

    def _total(self) -> int:
        return sum(inside.nbytes for inside in self.entries.values())
