"""`prepare`: a corpus of any size -> a data directory, in memory bounded by a buffer size.

The text streams through in pieces, never whole:
  1. fit the tokenizer, unless one is given: one pass over the corpus (char: its characters;
     BPE: the trainer counts the pre-tokens of each piece);
  2. encode the pieces (in `workers` processes when there are several, with at most two pieces
     per worker in flight) and append the ids to train.bin through a fixed buffer;
  3. move the last `val_fraction` of the ids to val.bin, then commit the directory as a whole.
Pieces are cut only where the tokenizer's own pre-tokenization splits (`Tokenizer.safe_cut`),
so the ids are exactly those of encoding the whole text at once.

Memory: a piece is `buffer_bytes / 256` bytes of text (4 to 256 KiB; encoding it with BPE takes
about 200 bytes per character), the id buffer `buffer_bytes / 2`: about 1.5 x the buffer per
process, whatever the corpus size. Only BPE training keeps a table that grows with the number of
distinct words, as any BPE trainer must.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from glassgpt.config import DEFAULT_BUFFER_BYTES
from glassgpt.data.corpus import TINYSHAKESPEARE_SHA256, Corpus, cache_dir
from glassgpt.data.datadir import (
    DATA_FORMAT,
    check_prepare_target,
    data_writer,
    holds_corpus,
    id_dtype,
)
from glassgpt.errors import ConfigError, DataError
from glassgpt.storage.commit import Writer
from glassgpt.storage.files import open_new_file
from glassgpt.storage.layout import META_FILE, TOKENIZER_FILE, TRAIN_FILE, VAL_FILE
from glassgpt.tokenizers import (
    DEFAULT_BPE_VOCAB,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    check_bpe_vocab_size,
    check_tokenizer_kind,
    cut_candidates,
    load_tokenizer_files,
    tokenizer_from_json,
)

MIN_BUFFER_BYTES = 2**16
MAX_WORKERS = 256
# A piece is buffer / 256, within these bounds: encoding takes about 200 bytes per character of a
# piece (the Hugging Face Encoding holds offsets, token strings, masks), so memory stays near
# the buffer. Small pieces are no slower: 4 KiB ones encoded faster than 256 KiB ones (measured).
PIECE_FRACTION = 256
MIN_PIECE_BYTES, MAX_PIECE_BYTES = 2**12, 2**18
# Text with no safe cut may pile up to this many characters before it is an error.
MAX_UNCUT_CHARS = 2**22
IN_FLIGHT_PER_WORKER = 2
# `prepare(progress=...)`: called with (bytes of text read, bytes to read in all) as it reads.
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class Budget:
    """How much of the corpus is in memory at once."""

    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    workers: int = 1

    @property
    def piece_bytes(self) -> int:
        """Text read and encoded as one piece (a piece may reach twice this at a cut)."""
        return min(MAX_PIECE_BYTES, max(MIN_PIECE_BYTES, self.buffer_bytes // PIECE_FRACTION))

    @property
    def id_buffer_bytes(self) -> int:
        return self.buffer_bytes // 2


def prepare(out_dir: str | Path, text_path: str | Path | Sequence[str | Path] | None = None,
            tokenizer: str = "char", vocab_size: int | None = None, val_fraction: float = 0.1,
            tokenizer_file: str | Path | Sequence[str | Path] | None = None, *,
            force: bool = False, workers: int = 1, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
            progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Tokenize a text into `out_dir`; returns the metadata written to meta.json.

    `text_path`: a file, a glob pattern, or a list of them, read in order as one text (default:
    Tiny Shakespeare). The first (1 - val_fraction) of the tokens train, the rest validate
    (nanoGPT's split). `tokenizer_file` reuses a tokenizer (a run's, to fine-tune it; GPT-2's
    vocab.json and merges.txt) instead of fitting a new one of kind `tokenizer`. `out_dir` may
    not be a run directory, nor hold prepared data unless `force`. `progress(done, total)`, if
    given, hears how many bytes of text have been read (each pass over the text counts).
    """
    budget = _checked_budget(val_fraction, workers, buffer_bytes)
    given = load_tokenizer_files(tokenizer_file) if tokenizer_file is not None else None
    if given is None:
        _check_trainable(tokenizer, vocab_size)
    elif vocab_size is not None:
        raise ConfigError(f"a vocabulary size ({vocab_size}) applies to a BPE tokenizer trained "
                          f"here; the tokenizer file given has its own "
                          f"({given.vocab_size} tokens)")
    corpus = Corpus.from_paths(text_path)
    out = check_prepare_target(out_dir, force)
    meter = TextMeter(corpus, 1 if given else 2, progress)
    try:
        with data_writer(out) as writer:
            meta = _write_files(writer, corpus, given, tokenizer, vocab_size, val_fraction,
                                budget, meter)
            writer.commit()
    except OSError as error:  # a full disk, a read-only place, a file that failed to read
        where = error.filename or out
        raise DataError(f"cannot prepare {out}: {where}: {error.strerror or error}; nothing "
                        f"was changed") from None
    return meta


def _write_files(writer: Writer, corpus: Corpus, given: Tokenizer | None, kind: str,
                 vocab_size: int | None, val_fraction: float, budget: Budget,
                 meter: TextMeter | None = None) -> dict[str, Any]:
    """Steps 1-3 into the writer's pending files; returns the metadata."""
    tok = given or fit_tokenizer(kind, vocab_size, corpus, budget, meter)
    dtype = id_dtype(tok.vocab_size)
    train_path = writer.pending(TRAIN_FILE)
    total = write_ids(train_path, corpus, tok, dtype, budget, meter)
    n_train = int(total * (1 - val_fraction))
    if total < 4:
        raise DataError(f"{corpus.name} is too short to split: {total} tokens")
    if n_train < 2 or total - n_train < 2:  # the text is long enough: the fraction is not
        part, tokens = ("validation", total - n_train) if total - n_train < 2 else \
            ("training", n_train)
        raise DataError(f"val_fraction={val_fraction:g} of {total:,} tokens leaves {tokens} "
                        f"for {part}; each part needs at least 2: choose a fraction between "
                        f"{2 / total:.2g} and {1 - 2 / total:.6g}")
    move_tail(train_path, writer.pending(VAL_FILE), n_train * dtype.itemsize,
              budget.id_buffer_bytes)
    meta = {"format": DATA_FORMAT, "source": corpus.source, "sha256": corpus.sha256,
            "tokenizer": tok.kind, "vocab_size": tok.vocab_size, "dtype": dtype.name,
            "train_tokens": n_train, "val_tokens": total - n_train,
            "text_bytes": corpus.text_bytes,
            "files": max(1, len(corpus.files))}
    writer.write_pending(TOKENIZER_FILE, tok.to_json().encode("utf-8"))
    writer.write_pending(META_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    return meta


def _checked_budget(val_fraction: float, workers: int, buffer_bytes: int) -> Budget:
    if not isinstance(val_fraction, int | float) or not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise ConfigError(f"workers must be between 1 and {MAX_WORKERS}, got {workers}")
    if not isinstance(buffer_bytes, int) or buffer_bytes < MIN_BUFFER_BYTES:
        raise ConfigError(f"the buffer must hold at least {MIN_BUFFER_BYTES:,} bytes, got "
                          f"{buffer_bytes}")
    most = max_buffer_bytes()
    if buffer_bytes > most:  # each process uses about 1.5x the buffer
        raise ConfigError(f"a buffer of {buffer_bytes / 2**20:,.0f} MiB does not fit this "
                          f"machine; at most {most // 2**20:,} MiB (a third of its memory)")
    return Budget(buffer_bytes, workers)


def max_buffer_bytes() -> int:
    """The largest buffer `prepare` takes: a third of the machine's memory (1 TiB where the
    OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 3
    except (AttributeError, ValueError, OSError):
        return 2**40


def _check_trainable(kind: str, vocab_size: int | None) -> None:
    """Refuse a tokenizer that cannot be trained before reading any text."""
    check_tokenizer_kind(kind)
    if kind == "char" and vocab_size is not None:
        raise ConfigError(f"a vocabulary size ({vocab_size}) applies to BPE; a char tokenizer "
                          f"has one id per distinct character of the text")
    if kind == "bpe":
        check_bpe_vocab_size(DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size)


def default_data_dir() -> Path:
    """Where `prepared_tinyshakespeare` keeps Tiny Shakespeare, prepared at character level."""
    return cache_dir() / "data" / "tinyshakespeare-char"


def prepared_tinyshakespeare() -> Path:
    """The default data directory, prepared on first use (and again if it holds anything but
    a readable preparation of Tiny Shakespeare: the cache is glassgpt's own)."""
    data_dir = default_data_dir()
    if not holds_corpus(data_dir, TINYSHAKESPEARE_SHA256):
        prepare(data_dir, force=True)
    return data_dir


class TextMeter:
    """Counts the bytes of text read, for `prepare`'s progress: each pass over the corpus (one
    to fit the tokenizer, one to encode) reads all of it."""

    def __init__(self, corpus: Corpus, passes: int, progress: ProgressCallback | None):
        size = len(corpus.data) if corpus.data is not None else sum(map(_size, corpus.files))
        self.total = passes * size
        self.done = 0
        self.progress = progress

    def blocks(self, corpus: Corpus, block_bytes: int) -> Iterator[str]:
        for block in corpus.blocks(block_bytes):
            if self.progress is not None:
                self.done += len(block.encode("utf-8"))
                self.progress(self.done, max(self.total, self.done))
            yield block


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # reading it says why, in its own words
        return 0


def _blocks(corpus: Corpus, block_bytes: int, meter: TextMeter | None) -> Iterator[str]:
    return meter.blocks(corpus, block_bytes) if meter else corpus.blocks(block_bytes)


# --- 1. fit the tokenizer -------------------------------------------------------------------

def fit_tokenizer(kind: str, vocab_size: int | None, corpus: Corpus, budget: Budget,
                  meter: TextMeter | None = None) -> Tokenizer:
    """A new tokenizer of `kind` fitted to the corpus, read once in blocks."""
    blocks = _blocks(corpus, budget.piece_bytes, meter)
    if kind == "char":
        chars: set[str] = set()
        for block in blocks:
            chars.update(block)
        return CharTokenizer(sorted(chars))
    # BPE: the trainer uses GPT-2's pre-tokenizer pattern, for which every candidate is safe.
    pieces = text_pieces(blocks, _last_candidate, budget.piece_bytes, corpus.name)
    return BPETokenizer.train_from_pieces(pieces, vocab_size or DEFAULT_BPE_VOCAB)


def _last_candidate(text: str) -> int | None:
    return next(cut_candidates(text), None)


def text_pieces(blocks: Iterable[str], safe_cut: Any, piece_chars: int, name: str
                ) -> Iterator[str]:
    """Blocks of text -> pieces of about piece_chars..2*piece_chars characters, each ending
    where `safe_cut` allows; together they are the whole text."""
    pending = ""
    for block in blocks:
        pending += block
        if len(pending) < piece_chars:
            continue
        cut = safe_cut(pending)
        if not cut:
            if len(pending) > max(MAX_UNCUT_CHARS, 2 * piece_chars):
                raise DataError(f"{name}: found no place to cut {len(pending):,} characters "
                                f"into pieces that the tokenizer encodes as it encodes the "
                                f"whole (pieces are cut between words)")
            continue
        yield pending[:cut]
        pending = pending[cut:]
    if pending:
        yield pending


# --- 2. encode ------------------------------------------------------------------------------

def write_ids(path: Path, corpus: Corpus, tokenizer: Tokenizer, dtype: np.dtype,
              budget: Budget, meter: TextMeter | None = None) -> int:
    """Encode the corpus into a new file at `path`; returns the number of ids."""
    pieces = text_pieces(_blocks(corpus, budget.piece_bytes, meter), tokenizer.safe_cut,
                         budget.piece_bytes, corpus.name)
    with open_new_file(path) as file:
        ids = IdWriter(file, dtype, budget.id_buffer_bytes)
        for piece_ids in encode_pieces(pieces, tokenizer, dtype, budget.workers):
            ids.append(piece_ids)
        ids.flush()
        os.fsync(file.fileno())
    return ids.count


class IdWriter:
    """Appends ids to a file through a fixed buffer, written out whenever it fills."""

    def __init__(self, file: BinaryIO, dtype: np.dtype, buffer_bytes: int):
        self.file = file
        self.buffer = np.empty(max(1, buffer_bytes // dtype.itemsize), dtype=dtype)
        self.filled = 0  # ids in the buffer
        self.count = 0  # ids written to the file

    def append(self, ids: np.ndarray) -> None:
        while len(ids):
            n = min(len(ids), len(self.buffer) - self.filled)
            self.buffer[self.filled:self.filled + n] = ids[:n]
            self.filled += n
            ids = ids[n:]
            if self.filled == len(self.buffer):
                self.flush()

    def flush(self) -> None:
        self.file.write(memoryview(self.buffer[:self.filled]).cast("B"))
        self.count += self.filled
        self.filled = 0
        self.file.flush()


def encode_pieces(pieces: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype, workers: int
                  ) -> Iterator[np.ndarray]:
    """The ids of each piece, in order; with workers > 1, encoded in that many processes."""
    if workers == 1:
        for piece in pieces:
            yield tokenizer.encode_array(piece, dtype)
        return
    # An executor (unlike multiprocessing.Pool) reports workers that die instead of waiting.
    with ProcessPoolExecutor(workers, _worker_context(), initializer=_start_worker,
                             initargs=(tokenizer.to_json(), dtype.str)) as pool:
        in_flight: collections.deque[Future] = collections.deque()
        try:
            for piece in pieces:
                in_flight.append(pool.submit(_encode_in_worker, piece))
                if len(in_flight) >= IN_FLIGHT_PER_WORKER * workers:
                    yield in_flight.popleft().result()
            while in_flight:
                yield in_flight.popleft().result()
        except BrokenProcessPool as error:
            raise DataError(f"the {workers} worker processes stopped ({error}); try again with "
                            f"--workers 1") from None
        finally:
            for future in in_flight:
                future.cancel()


def _worker_context() -> multiprocessing.context.BaseContext:
    """Workers start from a clean process, never a fork of this one (whose threads could hold
    locks): forked from a server that imported glassgpt once where the OS allows, else spawned
    (each then imports glassgpt, about a second)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


# Each worker process holds one tokenizer, built once by `_start_worker` (the Pool's
# initializer): the per-process state that multiprocessing workers need.
_worker_tokenizer: tuple[Tokenizer, np.dtype] | None = None


def _start_worker(tokenizer_json: str, dtype: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = (tokenizer_from_json(tokenizer_json, "the tokenizer"), np.dtype(dtype))


def _encode_in_worker(piece: str) -> np.ndarray:
    tokenizer, dtype = _worker_tokenizer
    return tokenizer.encode_array(piece, dtype)


# --- 3. split -------------------------------------------------------------------------------

def move_tail(train_path: Path, val_path: Path, start: int, buffer_bytes: int) -> None:
    """Move the bytes of `train_path` from `start` on into a new file `val_path`."""
    with open(train_path, "r+b") as train, open_new_file(val_path) as val:
        train.seek(start)
        shutil.copyfileobj(train, val, buffer_bytes)
        val.flush()
        os.fsync(val.fileno())
        train.truncate(start)
        os.fsync(train.fileno())

