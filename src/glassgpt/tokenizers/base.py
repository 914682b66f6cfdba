"""What every glassgpt tokenizer offers, and the checks they share."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from glassgpt.errors import TokenizerError

END_OF_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    kind: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def leading_special_ids(self) -> list[int]:
        """The special tokens transformers' `tokenizer(text)` puts before a text (an imported
        Llama 3's or Gemma's begin-of-sequence token); none for most tokenizers."""
        ...

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


# Texts that exercise what a tokenizer does: spaces and newlines, digits, punctuation, case,
# characters outside ASCII; a char tokenizer encodes only the ones its vocabulary covers.
PROBE_TEXTS = ("ROMEO:\nBut soft, what light through yonder window breaks?\n\n",
               "  two  spaces,\ttabs\r\n and 1234567890 digits!",
               "café naïve Ünïcödé — “quotes” 日本語 🙂", "The the THE tHe", "")
# Parts of a Hugging Face tokenizer.json that decide what it does. (A post-processor that adds
# nothing, as transformers writes one, and padding/truncation settings change no encoding.)
BEHAVIOUR_KEYS = ("model", "normalizer", "pre_tokenizer", "decoder")


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether `a` and `b` do the same thing: same kind and vocabulary (and merges), and the
    same ids for every probe text. Their JSON text may differ in what changes no encoding."""
    if a.kind != b.kind or a.vocab_size != b.vocab_size:
        return False
    if _behaviour(a) != _behaviour(b):
        return False
    return all(_probe(a, text) == _probe(b, text) for text in PROBE_TEXTS)


def _behaviour(tokenizer: Tokenizer) -> Any:
    data = json.loads(tokenizer.to_json())
    return {key: data.get(key) for key in BEHAVIOUR_KEYS} if "model" in data else data


def _probe(tokenizer: Tokenizer, text: str) -> list[int] | None:
    try:
        return tokenizer.encode(text)
    except TokenizerError:  # a character the vocabulary lacks: the same for both or not
        return None
