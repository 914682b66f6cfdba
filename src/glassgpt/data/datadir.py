"""A prepared data directory on disk: its files, how a new one is committed, how it is read.

    train.bin, val.bin   token ids, uint16 when the vocabulary fits (else uint32), memory-mapped
    tokenizer.json       the tokenizer that made them
    meta.json            source, corpus sha256, tokenizer kind, vocab size, id dtype, token counts

A data directory changes as a whole, like a checkpoint: `DataDirWriter` writes every new file
under a `.pending` name, then the journal `prepare.journal` naming them (atomically: this is the
commit point), then renames each into place. A crash before the journal leaves the old
directory whole; a crash after it is finished (rolled forward) by the next reader or writer.
So a reader sees the old files or the new ones, never old metadata beside new ids.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from glassgpt import checkpoint as ckpt
from glassgpt.errors import DataError, TokenizerError
from glassgpt.files import (
    LOCK_FILE,
    check_can_make_dir,
    fsync_dir,
    locked_directory,
    open_new_file,
    open_regular_file,
    read_json,
    read_json_object,
    remove_file,
    write_text_atomic,
)
from glassgpt.tokenizers import Tokenizer, read_tokenizer_file

SPLITS = ("train", "val")
TRAIN_FILE, VAL_FILE = "train.bin", "val.bin"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
DATA_FILES = (TRAIN_FILE, VAL_FILE, TOKENIZER_FILE, META_FILE)
JOURNAL_FILE = "prepare.journal"
PENDING_SUFFIX = ".pending"
ID_DTYPES = ("uint16", "uint32")
# Files only a run directory holds: `prepare` never writes beside them (its tokenizer.json would
# replace the run's, which could then no longer sample, evaluate or resume).
RUN_FILES = (ckpt.CONFIG_FILE, ckpt.MODEL_FILE, ckpt.STATE_JSON_FILE, ckpt.STATE_TENSORS_FILE,
             ckpt.JOURNAL_FILE)


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned integer type that holds every token id."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# --- writing --------------------------------------------------------------------------------

def check_prepare_target(out_dir: str | Path, force: bool) -> Path:
    """`out_dir`, once it is known to be a place `prepare` may write: never a run directory,
    and an existing data directory only with `force`. Checked before any work starts."""
    out = check_can_make_dir(out_dir, DataError)
    run_files = [name for name in RUN_FILES if os.path.lexists(out / name)]
    if run_files:
        raise DataError(f"{out} is a run directory (it holds {run_files[0]}); prepare data into "
                        f"a directory of its own, e.g. --out {out / 'data'}")
    if not force and (os.path.lexists(out / META_FILE) or os.path.lexists(out / JOURNAL_FILE)):
        raise DataError(f"{out} already holds prepared data; pass --force to replace it")
    return out


class DataDirWriter:
    """Writes the files of a data directory so that they appear all at once.

    Use as a context manager: it creates the directory (if needed) and locks it; files are
    written to `pending(name)`; `commit()` makes them the directory's. Leaving the block
    without committing removes every trace: pending files, and a directory or lock file it
    made.
    """

    def __init__(self, out_dir: str | Path):
        self.dir = Path(out_dir)
        self.committed = False
        self._stack = contextlib.ExitStack()
        self._made_dirs: list[Path] = []
        self._made_lock = False

    def __enter__(self) -> DataDirWriter:
        try:
            self._make_dirs()
            self._made_lock = not os.path.lexists(self.dir / LOCK_FILE)
            self._stack.enter_context(locked_directory(self.dir, DataError))
            if os.path.lexists(self.dir / JOURNAL_FILE):  # a commit a crash cut short
                _roll_forward(self.dir)
            self._drop_pending()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _make_dirs(self) -> None:
        missing = [p for p in [self.dir, *self.dir.parents] if not os.path.lexists(p)]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DataError(f"cannot create {self.dir}: {error.strerror or error}") from None
        self._made_dirs = missing  # deepest first

    def pending(self, name: str) -> Path:
        return self.dir / (name + PENDING_SUFFIX)

    def write_pending(self, name: str, data: bytes) -> None:
        with open_new_file(self.pending(name)) as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())

    def commit(self) -> None:
        """Make the pending files (each already fsynced) the directory's, all at once."""
        missing = [name for name in DATA_FILES if not os.path.lexists(self.pending(name))]
        if missing:
            raise RuntimeError(f"commit without pending {missing}")  # a bug, not a user error
        fsync_dir(self.dir)
        write_text_atomic(self.dir / JOURNAL_FILE, json.dumps(list(DATA_FILES)))
        self.committed = True
        _roll_forward(self.dir)

    def __exit__(self, *exc: object) -> None:
        try:
            if not self.committed:
                self._drop_pending()
                if self._made_lock or self._made_dirs:
                    remove_file(self.dir / LOCK_FILE)
                for made in self._made_dirs:
                    with contextlib.suppress(OSError):
                        made.rmdir()
        finally:
            self._stack.close()

    def _drop_pending(self) -> None:
        for name in DATA_FILES:
            remove_file(self.pending(name))


def recover_interrupted_prepare(data_dir: Path) -> None:
    """Finish a commit that a crash cut short; a no-op unless the journal is there."""
    if not os.path.lexists(data_dir / JOURNAL_FILE):
        return
    with locked_directory(data_dir, DataError):  # a prepare still committing: wait for it
        if os.path.lexists(data_dir / JOURNAL_FILE):
            _roll_forward(data_dir)


def _roll_forward(data_dir: Path) -> None:
    journal = data_dir / JOURNAL_FILE
    names = read_json(journal, DataError)
    if not isinstance(names, list) or not set(names) <= set(DATA_FILES):
        raise DataError(f"{journal} may only name the data files {list(DATA_FILES)}, got "
                        f"{names!r:.200}")
    try:
        for name in names:
            pending = data_dir / (name + PENDING_SUFFIX)
            if os.path.lexists(pending):  # absent when renamed before a crash
                os.replace(pending, data_dir / name)
        fsync_dir(data_dir)
        journal.unlink()
    except OSError as error:
        raise DataError(f"cannot finish the interrupted prepare in {data_dir}: "
                        f"{error.strerror or error}") from None
    fsync_dir(data_dir)


# --- reading --------------------------------------------------------------------------------

class PreparedData:
    """A prepared data directory: memory-mapped ids per split, its tokenizer and metadata."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        meta_path = self.dir / META_FILE
        if self.dir.is_dir():
            recover_interrupted_prepare(self.dir)
        if not self.dir.is_dir() or not os.path.lexists(meta_path):
            if os.path.lexists(self.dir / "model.safetensors"):
                raise DataError(f"{self.dir} is a run directory, not prepared data; give the "
                                f"data directory it was trained on (its config.json names it "
                                f"as data_dir), or prepare a text with `glassgpt prepare "
                                f"--text FILE --out DATA_DIR`")
            raise DataError(f"{self.dir} is not a prepared data directory (no {META_FILE}); "
                            f"run `glassgpt prepare --out {self.dir}` first")
        self.meta = read_json_object(meta_path, DataError)
        try:
            self.tokenizer: Tokenizer = read_tokenizer_file(self.dir / TOKENIZER_FILE)
        except TokenizerError as error:
            raise DataError(f"{self.dir}: unusable tokenizer ({error})") from None
        _check_meta(self.meta, meta_path, self.tokenizer)
        self.splits = {split: self._open(split) for split in SPLITS}

    def _open(self, split: str) -> np.ndarray:
        path = self.dir / f"{split}.bin"
        dtype, count = np.dtype(self.meta["dtype"]), self.meta[f"{split}_tokens"]
        fd = open_regular_file(path, DataError)
        try:
            size = os.fstat(fd).st_size
            if size != count * dtype.itemsize or count == 0:
                raise DataError(f"{path} holds {size:,} bytes, but meta.json says {count:,} "
                                f"{dtype.name} tokens ({count * dtype.itemsize:,} bytes); "
                                f"prepare the data again")
            with os.fdopen(fd, "rb", closefd=False) as file:
                return np.memmap(file, dtype=dtype, mode="r", shape=(count,))
        finally:
            os.close(fd)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check_block_size(self, block_size: int) -> None:
        """Each split needs at least one window of block_size + 1 tokens (input and target)."""
        for split, ids in self.splits.items():
            if len(ids) <= block_size:
                raise DataError(f"the {split} split of {self.dir} has {len(ids)} tokens, too "
                                f"short for block_size={block_size} (needs at least "
                                f"{block_size + 1}); use a longer text or a smaller --block-size")


def _check_meta(meta: dict[str, Any], path: Path, tokenizer: Tokenizer) -> None:
    """meta.json has the fields PreparedData reads, with values that fit each other."""
    dtype = meta.get("dtype")
    if dtype not in ID_DTYPES:
        raise DataError(f"{path}: dtype must be uint16 or uint32, got {dtype!r:.40}")
    vocab_size = meta.get("vocab_size")
    if not _is_count(vocab_size) or vocab_size <= 0:
        raise DataError(f"{path}: vocab_size must be a positive integer, got {vocab_size!r:.40}")
    if vocab_size != tokenizer.vocab_size:
        raise DataError(f"{path} says vocab_size={vocab_size}, but its {TOKENIZER_FILE} has "
                        f"{tokenizer.vocab_size} tokens; prepare the data again")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"{path}: {dtype} ids cannot hold a vocabulary of {vocab_size}")
    for split in SPLITS:
        count = meta.get(f"{split}_tokens")
        if not _is_count(count):
            raise DataError(f"{path}: {split}_tokens must be a non-negative integer, got "
                            f"{count!r:.40}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_prepared_from(data_dir: Path, text_path: Path) -> bool:
    """Whether `data_dir` holds data prepared from exactly the text at `text_path`."""
    try:
        meta = read_json_object(Path(data_dir) / META_FILE, DataError)
        return meta.get("sha256") == sha256_of(text_path)
    except (DataError, OSError):
        return False


def holds_corpus(data_dir: Path, sha256: str) -> bool:
    """Whether `data_dir` is a readable data directory prepared from the text with `sha256`."""
    try:
        return PreparedData(data_dir).meta.get("sha256") == sha256
    except DataError:
        return False


def sha256_of(path: str | Path, block_bytes: int = 2**20) -> str:
    """The sha256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()
