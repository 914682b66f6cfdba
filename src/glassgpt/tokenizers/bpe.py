"""Byte-level BPE: a thin wrapper of a Hugging Face `tokenizers.Tokenizer`.

Every string is made of bytes, so nothing is ever unknown and `decode(encode(x)) == x`. A BPE
tokenizer is trained here, or built from a byte-level tokenizer.json or from GPT-2's vocabulary
and merges; one from elsewhere is tried on a probe text first, so that a tokenizer that cannot
give text back fails when it is loaded rather than in the middle of sampling.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from glassgpt.errors import TokenizerError
from glassgpt.storage.files import write_text_atomic
from glassgpt.tokenizers.base import END_OF_TEXT, checked_ids

MIN_BPE_VOCAB = 257  # the 256 byte symbols plus the end-of-text token
# 4x the largest published vocabularies (about 256k); ids above 65,535 are stored as uint32.
MAX_BPE_VOCAB = 2**20
# Measured with tokenizers 0.23: BpeTrainer reserves about 66 bytes per requested token before
# it reads any text (10**8 tokens reserve 6.8 GB; 10**9 abort the whole process).
TRAINER_BYTES_PER_TOKEN = 72
# A BPE tokenizer must give this back unchanged: spaces, tabs, CR LF, accents, CJK, an emoji.
ROUND_TRIP_PROBE = "Hello, world! It's 1,234.5\n\tTabs,  two spaces \r\n\nÉté, 東京 🙂 end "
# Where a text may be cut: after a non-space, before a space or newline that a non-space
# follows. No pre-token of GPT-2's pattern spans such a place (see `BPETokenizer.safe_cut`).
CUT_CANDIDATE = re.compile(r"(?<=\S)(?=[ \n]\S)")
CUT_CHECK_CHARS = 64  # context on each side when a cut is checked by encoding
MAX_CUT_TRIES = 8

Result = TypeVar("Result")


class BPETokenizer:
    """Byte-level BPE: a thin wrapper of `tokenizers.Tokenizer`."""

    kind = "bpe"

    def __init__(self, tokenizer: HFTokenizer):
        self.tokenizer = tokenizer
        self._leading: list[int] | None = None  # leading_special_ids, once asked

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Learn merges on `text` until the vocabulary holds `vocab_size` tokens."""
        return cls.train_from_pieces([text], vocab_size)

    @classmethod
    def train_from_pieces(cls, pieces: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Learn merges on a text given in pieces cut at `cut_candidates` (or whole): the
        trainer counts the same pre-tokens either way, so it learns the same merges."""
        check_bpe_vocab_size(vocab_size)
        tokenizer = _byte_level(HFTokenizer(models.BPE()))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tokenizer.train_from_iterator(pieces, trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def from_json(cls, text: str, source: str = "tokenizer JSON") -> BPETokenizer:
        hf = _rust_call(f"{source} is not a valid Hugging Face tokenizer", HFTokenizer.from_str,
                        text)
        return cls(hf).checked(source)

    @classmethod
    def from_vocab_and_merges(cls, vocab: dict[str, int], merges: list[tuple[str, str]],
                              source: str) -> BPETokenizer:
        """GPT-2's tokenizer (the contents of `vocab.json` and `merges.txt`)."""
        model = _rust_call(f"{source} do not make a BPE tokenizer", models.BPE, vocab=vocab,
                           merges=merges)
        tokenizer = _byte_level(HFTokenizer(model))
        if END_OF_TEXT in vocab:  # GPT-2's document separator keeps its id (50256)
            tokenizer.add_special_tokens([END_OF_TEXT])
        return cls(tokenizer).checked(source)

    def checked(self, source: str) -> BPETokenizer:
        """Self, after making sure that it gives a probe text back unchanged."""
        try:
            back = self.decode(self.encode(ROUND_TRIP_PROBE))
        except TokenizerError as error:
            raise TokenizerError(f"{source}: {error}") from None
        if back != ROUND_TRIP_PROBE:
            raise TokenizerError(f"{source} does not give text back unchanged "
                                 f"({ROUND_TRIP_PROBE[:24]!r}... came back as {back[:24]!r}...);"
                                 f" glassgpt takes byte-level BPE tokenizers, which do")
        return self

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._encoding(text).ids

    def leading_special_ids(self) -> list[int]:
        """The special tokens the tokenizer's post-processor puts before a text (Llama 3's
        `<|begin_of_text|>`, Gemma's `<bos>`): what transformers' `tokenizer(text)` starts
        with; none for GPT-2, Qwen and glassgpt's own BPE. (Tokens a post-processor adds after
        the text, an end-of-sequence, are left out: a prompt is continued, not ended.) Found
        once, from a probe text, since every prompt of the view and of `sample` asks."""
        if self._leading is None:
            self._leading = self._find_leading_special_ids()
        return self._leading

    def _find_leading_special_ids(self) -> list[int]:
        plain = self.encode(ROUND_TRIP_PROBE)
        full = _rust_call("cannot encode the text", self.tokenizer.encode, ROUND_TRIP_PROBE,
                          add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start]
        return []

    def encode_array(self, text: str, dtype: np.dtype) -> np.ndarray:
        return np.array(self._encoding(text).ids, dtype=dtype)

    def _encoding(self, text: str) -> Any:
        _check_unicode(text)
        return _rust_call("cannot encode the text", self.tokenizer.encode, text,
                          add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return _rust_call("cannot decode the ids", self.tokenizer.decode,
                          checked_ids(ids, self.vocab_size), skip_special_tokens=False)

    def safe_cut(self, text: str) -> int | None:
        """The last place where `text` may be cut without changing its tokens, or None.

        BPE merges only within a pre-token, so a cut between two pre-tokens changes nothing.
        With GPT-2's pattern no pre-token spans a `CUT_CANDIDATE`: the one before ends in a
        non-space, which no space-only alternative takes and the others stop at; the one after
        starts afresh, as the pattern has no look-behind. A tokenizer from a file may split
        otherwise, so each candidate is checked on its neighbourhood: the pre-tokenizer must
        split there, and encoding the two sides apart must give the ids of encoding them as one.
        """
        pre_tokenizer = self.tokenizer.pre_tokenizer
        if pre_tokenizer is None:  # the whole text is one word: no place is safe
            return None
        for tries, cut in enumerate(cut_candidates(text)):
            if tries == MAX_CUT_TRIES:
                return None
            left = text[max(0, cut - CUT_CHECK_CHARS):cut]
            right = text[cut:cut + CUT_CHECK_CHARS]
            pieces = _rust_call("cannot pre-tokenize the text", pre_tokenizer.pre_tokenize_str,
                                left + right)
            splits_there = any(end == len(left) for _, (_, end) in pieces)
            if splits_there and \
                    self.encode(left + right) == self.encode(left) + self.encode(right):
                return cut
        return None

    def token_byte_lengths(self) -> list[int]:
        """UTF-8 bytes each token stands for: one per symbol of a byte-level token."""
        byte_symbols = _byte_symbols()
        added = {i: token.content for i, token in
                 self.tokenizer.get_added_tokens_decoder().items()}
        lengths = []
        for i in range(self.vocab_size):
            token = added[i] if i in added else self.tokenizer.id_to_token(i)
            if token is None:  # a hole in the vocabulary
                lengths.append(0)
            elif i not in added and all(symbol in byte_symbols for symbol in token):
                lengths.append(len(token))
            else:
                lengths.append(len(self.decode([i]).encode("utf-8")))
        return lengths

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json())


def cut_candidates(text: str) -> Iterator[int]:
    """Positions p, last first, with a non-space at p - 1, a space or newline at p and a
    non-space at p + 1; searched in windows that grow from the end of the text."""
    end, window = len(text), 4096
    while end > 0:
        start = max(0, end - window)
        # endpos one past `end`: the look-ahead of a candidate at end - 1 reads text[end].
        found = [m.start() for m in CUT_CANDIDATE.finditer(text, start, min(len(text), end + 1))]
        yield from reversed([p for p in found if p < end])
        end, window = start, window * 4


def _byte_level(tokenizer: HFTokenizer) -> HFTokenizer:
    # No prefix space: a leading space would break decode(encode(x)) == x.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@cache
def _byte_symbols() -> frozenset[str]:
    return frozenset(pre_tokenizers.ByteLevel.alphabet())


def _check_unicode(text: str) -> None:
    if not isinstance(text, str):
        raise TokenizerError(f"text to encode must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise TokenizerError(f"the text holds {text[error.start]!r} at position {error.start}: "
                             f"a lone surrogate, not Unicode text (bytes that are not UTF-8 on "
                             f"a command line arrive as these)") from None


def _rust_call(failure: str, function: Callable[..., Result], *args: Any,
               **kwargs: Any) -> Result:
    """Call into the `tokenizers` library; its errors become one TokenizerError line."""
    try:
        return function(*args, **kwargs)
    except Exception as error:  # the Rust side raises plain Exceptions
        raise TokenizerError(f"{failure}: {_first_line(error)}") from None
    except BaseException as error:
        # A panic inside the library arrives as pyo3's PanicException, a BaseException.
        if type(error).__name__ != "PanicException":
            raise
        raise TokenizerError(f"{failure}: the tokenizers library failed "
                             f"({_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def check_bpe_vocab_size(vocab_size: int) -> None:
    """Refuse a vocabulary the BPE trainer cannot or should not build, before any work."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TokenizerError(f"BPE vocab_size must be an integer, got {vocab_size!r:.40}")
    if vocab_size < MIN_BPE_VOCAB:
        raise TokenizerError(f"BPE vocab_size must be at least {MIN_BPE_VOCAB} "
                             f"(256 bytes + end-of-text), got {vocab_size}")
    if vocab_size > MAX_BPE_VOCAB:
        raise TokenizerError(f"BPE vocab_size {vocab_size:,} is more than glassgpt trains "
                             f"(at most {MAX_BPE_VOCAB:,}; GPT-2 has 50,257)")
    needed, available = vocab_size * TRAINER_BYTES_PER_TOKEN, available_memory()
    if available is not None and needed > available // 2:
        raise TokenizerError(f"training a BPE vocabulary of {vocab_size:,} tokens takes about "
                             f"{needed / 2**20:,.0f} MiB, and only {available / 2**20:,.0f} MiB "
                             f"of memory is free; choose a smaller --vocab-size")


def available_memory() -> int | None:
    """Bytes of memory free for new allocations (Linux: MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
