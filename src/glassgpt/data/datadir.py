"""A prepared data directory on disk: its files, how a new one is committed, how it is read.

    train.bin, val.bin   token ids, uint16 when the vocabulary fits (else uint32), memory-mapped
    tokenizer.json       the tokenizer that made them
    meta.json            source, corpus sha256, tokenizer kind, vocab size, id dtype, token counts

A data directory changes as a whole, like a checkpoint, through glassgpt.storage.commit:
every new file under a `.pending` name, then the journal `prepare.journal` (the commit point),
then renames. Readers never write: `PreparedData` resolves each file through the journal, so it
sees the old files or the new ones, never old metadata beside new ids; the next `prepare` into
the directory finishes an interrupted commit. File names come from glassgpt.storage.layout,
which imports nothing: preparing data never loads the model.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from glassgpt.errors import DataError, TokenizerError
from glassgpt.storage import commit
from glassgpt.storage.files import (
    check_can_make_dir,
    entry_kind,
    open_regular_file,
    read_json_object,
)
from glassgpt.storage.layout import (
    DATA,
    META_FILE,
    MODEL_FILE,
    RUN_MARKERS,
    TOKENIZER_FILE,
    TRAIN_FILE,
    VAL_FILE,
)
from glassgpt.tokenizers import Tokenizer, read_tokenizer_file

SPLITS = ("train", "val")
SPLIT_FILES = {"train": TRAIN_FILE, "val": VAL_FILE}
JOURNAL_FILE = DATA.journal
ID_DTYPES = ("uint16", "uint32")
# meta.json's mark of a data directory glassgpt wrote (a run's config.json says "glassgpt-run/1")
DATA_FORMAT = "glassgpt-data/1"
# What meta.json held before it carried DATA_FORMAT: those directories are glassgpt's too.
LEGACY_META_KEYS = frozenset({"source", "sha256", "tokenizer", "vocab_size", "dtype",
                              "train_tokens", "val_tokens"})


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned integer type that holds every token id."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# --- writing --------------------------------------------------------------------------------

def check_prepare_target(out_dir: str | Path, force: bool) -> Path:
    """`out_dir`, once it is known to be a place `prepare` may write: never a run directory,
    and one holding any file prepare would write only with `force`. Checked before any work
    starts."""
    out = check_can_make_dir(out_dir, DataError)
    run_files = [name for name in RUN_MARKERS if os.path.lexists(out / name)]
    if run_files:
        raise DataError(f"{out} is a run directory (it holds {run_files[0]}); prepare data into "
                        f"a directory of its own, e.g. --out {out / 'data'}")
    present = commit.own_files_present(out, DATA) if out.is_dir() else []
    if present and not force:
        what = ("already holds prepared data" if META_FILE in present
                else f"already holds {', '.join(present[:3])}")
        raise DataError(f"{out} {what}; pass --force to replace it")
    # --force replaces only what glassgpt wrote: a train.bin of nanoGPT's is the user's data
    # (pending files and a journal are glassgpt's names, whatever the directory holds).
    files = [name for name in present if name in DATA.files]
    if files and not written_by_glassgpt(out):
        raise DataError(f"{out} holds {', '.join(files[:3])}, but not data glassgpt prepared "
                        f"(no {META_FILE} of glassgpt's); --force does not replace it: prepare "
                        f"into another directory")
    for name in present:
        if entry_kind(out / name) not in ("file", "link"):
            raise DataError(f"{out / name} is a directory, where prepare writes a file; move "
                            f"it away (glassgpt does not delete it)")
    return out


def written_by_glassgpt(data_dir: Path) -> bool:
    """Whether `data_dir` is a data directory `prepare` wrote: its committed meta.json says
    so (DATA_FORMAT, or the keys it held before that mark), whatever its other file names."""
    try:
        paths = commit.committed_paths(data_dir, DATA, DataError)
        meta = read_json_object(paths[META_FILE], DataError)
    except DataError:
        return False
    return meta.get("format") == DATA_FORMAT or meta.keys() >= LEGACY_META_KEYS


def data_writer(out_dir: str | Path) -> commit.Writer:
    """The one writer of a data directory: creates and locks it, and leaves no trace (no
    pending file, no directory or lock file it made) unless it commits."""
    return commit.Writer(out_dir, DATA, DataError)


# --- reading --------------------------------------------------------------------------------

class PreparedData:
    """A prepared data directory: memory-mapped ids per split, its tokenizer and metadata.

    Reading changes nothing: a commit a crash cut short reads as the new data (see
    glassgpt.storage.commit)."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        paths = (commit.committed_paths(self.dir, DATA, DataError) if self.dir.is_dir()
                 else {})
        meta_path = paths.get(META_FILE)
        if meta_path is None or entry_kind(meta_path) == "missing":
            if entry_kind(self.dir / MODEL_FILE) != "missing":
                raise DataError(f"{self.dir} is a run directory, not prepared data; give the "
                                f"data directory it was trained on (its config.json names it "
                                f"as data_dir), or prepare a text with `glassgpt prepare "
                                f"--text FILE --out DATA_DIR`")
            raise DataError(f"{self.dir} is not a prepared data directory (no {META_FILE}); "
                            f"run `glassgpt prepare --out {self.dir}` first")
        self.meta = read_json_object(meta_path, DataError)
        try:
            self.tokenizer: Tokenizer = read_tokenizer_file(paths[TOKENIZER_FILE])
        except TokenizerError as error:
            raise DataError(f"{self.dir}: unusable tokenizer ({error})") from None
        _check_meta(self.meta, self.dir / META_FILE, self.tokenizer)
        self.splits = {split: self._open(split, paths[SPLIT_FILES[split]]) for split in SPLITS}

    def _open(self, split: str, path: Path) -> np.ndarray:
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
        paths = commit.committed_paths(Path(data_dir), DATA, DataError)
        meta = read_json_object(paths[META_FILE], DataError)
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
