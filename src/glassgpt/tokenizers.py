"""Tokenizers: text <-> token ids, stored as JSON next to the data and in every run.

Two kinds share one interface (`encode`, `decode`, `vocab_size`, `kind`, `save`):
- `CharTokenizer`: one id per distinct character of the corpus (the classic Shakespeare model).
- `BPETokenizer`: byte-level BPE, a thin wrapper of a Hugging Face `tokenizers.Tokenizer`. Every
  string is made of bytes, so nothing is ever unknown and `decode(encode(x)) == x`. It is trained
  on a corpus here, or built from any byte-level `tokenizer.json` (GPT-2's, for instance).
Files are JSON only: loading one never runs code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from glassgpt.errors import TokenizerError
from glassgpt.files import write_text_atomic

TOKENIZER_KINDS = ("char", "bpe")
END_OF_TEXT = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # the 256 byte symbols plus the end-of-text token
MAX_FILE_BYTES = 64 * 2**20  # GPT-2's tokenizer.json is 1.4 MB


class Tokenizer(Protocol):
    kind: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def to_json(self) -> str: ...

    def save(self, path: str | Path) -> None: ...


class CharTokenizer:
    """One id per character, ids in sorted character order (nanoGPT's `stoi`/`itos`)."""

    kind = "char"

    def __init__(self, chars: Sequence[str]):
        if not chars:
            raise TokenizerError("a character tokenizer needs at least one character")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise TokenizerError(f"character vocabulary entries must be single characters, "
                                 f"got {bad[:5]!r}")
        if len(set(chars)) != len(chars):
            raise TokenizerError("character vocabulary has duplicate entries")
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unknown = sorted(set(text) - self.stoi.keys())
            raise TokenizerError(f"characters not in the tokenizer's vocabulary: "
                                 f"{''.join(unknown)!r}") from None

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return "".join(self.chars[i] for i in ids)
        except (IndexError, TypeError):
            raise TokenizerError(f"token ids outside [0, {self.vocab_size}) in "
                                 f"{list(ids)[:10]}") from None

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "chars": self.chars}, ensure_ascii=False)

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json())


class BPETokenizer:
    """Byte-level BPE: a thin wrapper of `tokenizers.Tokenizer`."""

    kind = "bpe"

    def __init__(self, tokenizer: HFTokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Learn merges on `text` until the vocabulary holds `vocab_size` tokens."""
        if vocab_size < MIN_BPE_VOCAB:
            raise TokenizerError(f"BPE vocab_size must be at least {MIN_BPE_VOCAB} "
                                 f"(256 bytes + end-of-text), got {vocab_size}")
        tokenizer = HFTokenizer(models.BPE())
        # No prefix space: a leading space would break decode(encode(x)) == x.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def from_json(cls, text: str) -> BPETokenizer:
        try:
            return cls(HFTokenizer.from_str(text))
        except Exception as error:  # the Rust side raises plain Exceptions
            raise TokenizerError(f"not a valid Hugging Face tokenizer: {error}") from None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids outside [0, {self.vocab_size}): {bad[:10]}")
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json())


def train_tokenizer(kind: str, text: str, vocab_size: int | None = None) -> Tokenizer:
    """A new tokenizer of `kind` ('char' or 'bpe') fitted to `text`."""
    if kind == "char":
        return CharTokenizer.from_text(text)
    if kind == "bpe":
        return BPETokenizer.train(text, vocab_size if vocab_size is not None else 1024)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; choose one of {TOKENIZER_KINDS}")


def tokenizer_from_json(text: str, source: str = "tokenizer JSON") -> Tokenizer:
    """Parse and validate a tokenizer file's contents; `source` names it in errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TokenizerError(f"{source} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{source} must hold a JSON object, got {type(data).__name__}")
    if data.get("kind") == "char":
        unknown = sorted(set(data) - {"kind", "chars"})
        if unknown or not isinstance(data.get("chars"), list):
            raise TokenizerError(f"{source}: a char tokenizer holds exactly 'kind' and a list "
                                 f"'chars' (unknown keys: {unknown})")
        try:
            return CharTokenizer(data["chars"])
        except TokenizerError as error:
            raise TokenizerError(f"{source}: {error}") from None
    if isinstance(data.get("model"), dict):  # the Hugging Face tokenizer.json layout
        if data["model"].get("type", "BPE") != "BPE":
            raise TokenizerError(f"{source} holds a {data['model'].get('type')!r:.40} "
                                 f"tokenizer; glassgpt takes byte-level BPE ones")
        try:
            return BPETokenizer.from_json(text)
        except TokenizerError as error:
            raise TokenizerError(f"{source}: {error}") from None
    raise TokenizerError(f"{source} is neither a glassgpt char tokenizer nor a Hugging Face "
                         f"tokenizer.json")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a tokenizer saved by `save` (or a Hugging Face tokenizer.json)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:  # checked before reading: a huge file cannot exhaust memory
            raise TokenizerError(f"{path} is {size:,} bytes; a tokenizer file holds at most "
                                 f"{MAX_FILE_BYTES:,}")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise TokenizerError(f"cannot read tokenizer file {path}: {error}") from None
    return tokenizer_from_json(text, source=str(path))
