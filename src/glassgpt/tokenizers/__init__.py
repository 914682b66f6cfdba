"""Tokenizers: text <-> token ids, stored as JSON next to the data and in every run.

Two kinds share one interface (`base.Tokenizer`):
- `CharTokenizer`: one id per distinct character of the corpus (the classic Shakespeare model).
- `BPETokenizer`: byte-level BPE, a thin wrapper of a Hugging Face `tokenizers.Tokenizer`,
  trained on a corpus here or built from GPT-2's files.
Files are JSON (and merges.txt) only: loading one never runs code.
"""

from __future__ import annotations

from glassgpt.config import DEFAULT_BPE_VOCAB, TOKENIZER_KINDS
from glassgpt.errors import TokenizerError
from glassgpt.tokenizers.base import END_OF_TEXT, Tokenizer, same_tokenizer
from glassgpt.tokenizers.bpe import (
    MAX_BPE_VOCAB,
    MIN_BPE_VOCAB,
    BPETokenizer,
    check_bpe_vocab_size,
    cut_candidates,
)
from glassgpt.tokenizers.char import CharTokenizer
from glassgpt.tokenizers.loading import (
    load_tokenizer,
    load_tokenizer_files,
    read_tokenizer_file,
    tokenizer_from_json,
)

__all__ = [
    "DEFAULT_BPE_VOCAB",
    "END_OF_TEXT",
    "MAX_BPE_VOCAB",
    "MIN_BPE_VOCAB",
    "TOKENIZER_KINDS",
    "BPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "check_bpe_vocab_size",
    "same_tokenizer",
    "check_tokenizer_kind",
    "cut_candidates",
    "load_tokenizer",
    "load_tokenizer_files",
    "read_tokenizer_file",
    "tokenizer_from_json",
    "train_tokenizer",
]


def check_tokenizer_kind(kind: str) -> None:
    if kind not in TOKENIZER_KINDS:
        raise TokenizerError(f"unknown tokenizer kind {kind!r}; choose one of {TOKENIZER_KINDS}")


def train_tokenizer(kind: str, text: str, vocab_size: int | None = None) -> Tokenizer:
    """A new tokenizer of `kind` ('char' or 'bpe') fitted to `text`."""
    check_tokenizer_kind(kind)
    if kind == "char":
        return CharTokenizer.from_text(text)
    return BPETokenizer.train(text, DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size)
