"""What every glassgpt tokenizer offers, and the checks they share."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from glassgpt.errors import TokenizerError

TOKENIZER_KINDS = ("char", "bpe")
END_OF_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    kind: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str, dtype: np.dtype) -> np.ndarray:
        """`encode` into an array of `dtype`, for long texts."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def safe_cut(self, text: str) -> int | None:
        """The last position p where encode(text[:p]) + encode(text[p:] + more) equals
        encode(text + more) whatever follows, or None; `prepare` cuts a corpus there."""
        ...

    def token_byte_lengths(self) -> list[int]:
        """For each id, the UTF-8 bytes of text that the token stands for."""
        ...

    def to_json(self) -> str: ...

    def save(self, path: str | Path) -> None: ...


def checked_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """`ids` as a list when each is an integer in [0, vocab_size): a negative id would
    otherwise index from the end of the vocabulary."""
    ids = list(ids)
    try:
        bad = [i for i in ids if not 0 <= i < vocab_size]
    except TypeError:
        raise TokenizerError(f"token ids must be integers, got {ids[:10]}") from None
    if bad:
        raise TokenizerError(f"token ids outside [0, {vocab_size}): {bad[:10]}")
    return ids
