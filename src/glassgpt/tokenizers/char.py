"""The character-level tokenizer: one id per distinct character (nanoGPT's `stoi`/`itos`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from glassgpt.errors import TokenizerError
from glassgpt.storage.files import write_text_atomic
from glassgpt.tokenizers.base import checked_ids


class CharTokenizer:
    """One id per character, ids in sorted character order."""

    kind = "char"

    def __init__(self, chars: Sequence[str]):
        if not chars:
            raise TokenizerError("a character tokenizer needs at least one character")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise TokenizerError(f"character vocabulary entries must be single characters, "
                                 f"got {bad[:5]!r}")
        surrogates = [c for c in chars if "\ud800" <= c <= "\udfff"]
        if surrogates:  # they have no UTF-8 form: no text holds them and none can be printed
            raise TokenizerError(f"character vocabulary holds lone surrogates "
                                 f"{surrogates[:5]!r}, which are not text")
        if len(set(chars)) != len(chars):
            raise TokenizerError("character vocabulary has duplicate entries")
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        self._order = np.argsort(codes)  # the id of the k-th smallest code point
        self._sorted_codes = codes[self._order]

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def leading_special_ids(self) -> list[int]:
        return []  # characters only: no special tokens

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            raise self._unknown(set(text)) from None

    def encode_array(self, text: str, dtype: np.dtype) -> np.ndarray:
        """`encode` for long texts: a binary search over code points, no Python loop."""
        try:
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # (N,)
        except UnicodeEncodeError:  # a lone surrogate, never in the vocabulary
            raise self._unknown(set(text)) from None
        at = np.searchsorted(self._sorted_codes, codes).clip(max=len(self.chars) - 1)  # (N,)
        known = self._sorted_codes[at] == codes
        if not known.all():
            raise self._unknown({chr(c) for c in np.unique(codes[~known])[:20]})
        return self._order[at].astype(dtype)

    def _unknown(self, chars: set[str]) -> TokenizerError:
        unknown = sorted(chars - self.stoi.keys())
        shown = ", ".join(repr(c) for c in unknown[:20])
        more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
        return TokenizerError(f"{len(unknown)} character{'s' if len(unknown) > 1 else ''} "
                              f"not in the tokenizer's vocabulary: {shown}{more}; a character "
                              f"tokenizer knows only the characters of the text it was made "
                              f"from: remove these, or prepare the data with --tokenizer bpe "
                              f"(byte-level BPE encodes any text)")

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in checked_ids(ids, self.vocab_size))

    def safe_cut(self, text: str) -> int | None:
        """Every character is a token of its own, so a text may be cut anywhere."""
        return len(text)

    def token_byte_lengths(self) -> list[int]:
        return [len(c.encode("utf-8")) for c in self.chars]

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "chars": self.chars}, ensure_ascii=False)

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json())
