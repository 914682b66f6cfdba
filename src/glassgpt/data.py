"""Text corpora, prepared token-id files, and random training windows.

`prepare` turns a UTF-8 text into a data directory:
    train.bin, val.bin   token ids, uint16 when the vocabulary fits (else uint32), read by memmap
    tokenizer.json       the tokenizer that made them
    meta.json            corpus sha256, tokenizer kind, vocab size, token counts, id dtype
`BatchSampler` draws random windows from those ids as nanoGPT does, from its own seeded generator
so that its state can be saved in a checkpoint and training resumes on exactly the same batches.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from glassgpt.errors import DataError, TokenizerError
from glassgpt.files import write_bytes_atomic, write_text_atomic
from glassgpt.tokenizers import Tokenizer, load_tokenizer, train_tokenizer

TINYSHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                       "tinyshakespeare/input.txt")
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINYSHAKESPEARE_ENV = "GLASSGPT_TINYSHAKESPEARE"
TINYSHAKESPEARE_FILE = "tinyshakespeare.txt"
SPLITS = ("train", "val")
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"


# --- the corpus ----------------------------------------------------------------------------

def cache_dir() -> Path:
    """Where glassgpt keeps downloads and prepared data: $XDG_CACHE_HOME/glassgpt."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "glassgpt"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tinyshakespeare_path(download: bool = True) -> Path:
    """A checked copy of Tiny Shakespeare: $GLASSGPT_TINYSHAKESPEARE, the cache, or a download."""
    env_path = os.environ.get(TINYSHAKESPEARE_ENV)
    if env_path:
        path = Path(env_path)
        if not path.is_file():
            raise DataError(f"{TINYSHAKESPEARE_ENV}={env_path} is not a file")
        return _checked_shakespeare(path)
    cached = cache_dir() / TINYSHAKESPEARE_FILE
    if cached.is_file():
        return _checked_shakespeare(cached)
    if not download:
        raise DataError(f"Tiny Shakespeare is not in {cached}")
    return _download_shakespeare(cached)


def _checked_shakespeare(path: Path) -> Path:
    digest = sha256_of(path)
    if digest != TINYSHAKESPEARE_SHA256:
        raise DataError(f"{path} is not Tiny Shakespeare: sha256 {digest}, expected "
                        f"{TINYSHAKESPEARE_SHA256}")
    return path


def _download_shakespeare(target: Path) -> Path:
    try:
        with urllib.request.urlopen(TINYSHAKESPEARE_URL, timeout=30) as response:
            data = response.read()
    except OSError as error:
        raise DataError(f"cannot download Tiny Shakespeare ({error}); download "
                        f"{TINYSHAKESPEARE_URL} yourself and set {TINYSHAKESPEARE_ENV}=PATH, "
                        f"or copy it to {target}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != TINYSHAKESPEARE_SHA256:
        raise DataError(f"the download from {TINYSHAKESPEARE_URL} has sha256 {digest}, "
                        f"expected {TINYSHAKESPEARE_SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target, data)
    return target


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents; a missing, unreadable or empty file is a DataError."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"text file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 text (byte {error.start}: "
                        f"{error.object[error.start:error.start + 1]!r})") from None
    if not text.strip():
        raise DataError(f"{path} is empty")
    return text


# --- prepared data -------------------------------------------------------------------------

def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned integer type that holds every token id."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def prepare(out_dir: str | Path, text_path: str | Path | None = None, tokenizer: str = "char",
            vocab_size: int | None = None, val_fraction: float = 0.1,
            tokenizer_file: str | Path | None = None) -> dict[str, Any]:
    """Tokenize a text (default: Tiny Shakespeare) into `out_dir`; returns the metadata.

    The first (1 - val_fraction) of the tokens train, the rest validate (nanoGPT's split).
    `tokenizer_file` reuses an existing tokenizer (e.g. a run's, to fine-tune it) instead of
    fitting a new one of kind `tokenizer`.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    path = Path(text_path) if text_path is not None else tinyshakespeare_path()
    text = read_text(path)
    tok = load_tokenizer(tokenizer_file) if tokenizer_file else train_tokenizer(
        tokenizer, text, vocab_size)
    ids = np.array(tok.encode(text), dtype=id_dtype(tok.vocab_size))
    n_train = int(len(ids) * (1 - val_fraction))
    if n_train < 2 or len(ids) - n_train < 2:
        raise DataError(f"{path} is too short to split: {len(ids)} tokens")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out / "train.bin", ids[:n_train].tobytes())
    write_bytes_atomic(out / "val.bin", ids[n_train:].tobytes())
    tok.save(out / TOKENIZER_FILE)
    meta = {"source": str(path.resolve()), "sha256": sha256_of(path), "tokenizer": tok.kind,
            "vocab_size": tok.vocab_size, "dtype": ids.dtype.name,
            "train_tokens": n_train, "val_tokens": len(ids) - n_train}
    # meta.json last: its presence marks a complete data directory.
    write_text_atomic(out / META_FILE, json.dumps(meta, indent=2) + "\n")
    return meta


class PreparedData:
    """A prepared data directory: memory-mapped ids per split, its tokenizer and metadata."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        meta_path = self.dir / META_FILE
        if not meta_path.is_file():
            raise DataError(f"{self.dir} is not a prepared data directory (no {META_FILE}); "
                            f"run `glassgpt prepare --out {self.dir}` first")
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
            self.tokenizer: Tokenizer = load_tokenizer(self.dir / TOKENIZER_FILE)
        except (json.JSONDecodeError, UnicodeDecodeError, TokenizerError) as error:
            raise DataError(f"{self.dir}: unreadable metadata or tokenizer ({error})") from None
        _check_meta(self.meta, meta_path)
        self.splits = {split: self._open(split) for split in SPLITS}

    def _open(self, split: str) -> np.ndarray:
        path = self.dir / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"{path} is missing; prepare the data again")
        expected = self.meta.get(f"{split}_tokens")
        ids = np.memmap(path, dtype=np.dtype(self.meta.get("dtype", "uint16")), mode="r")
        if expected is not None and len(ids) != expected:
            raise DataError(f"{path} holds {len(ids)} tokens, meta.json says {expected}")
        return ids

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


def default_data_dir() -> Path:
    """Where `prepared_default_corpus` keeps Tiny Shakespeare, prepared at character level."""
    return cache_dir() / "data" / "tinyshakespeare-char"


def is_prepared_from(data_dir: Path, text_path: Path) -> bool:
    """Whether `data_dir` holds data prepared from exactly the text at `text_path`."""
    meta_path = data_dir / META_FILE
    if not meta_path.is_file():
        return False
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("sha256") == sha256_of(text_path)


def _check_meta(meta: Any, path: Path) -> None:
    """meta.json has the fields PreparedData reads, with usable values."""
    if not isinstance(meta, dict):
        raise DataError(f"{path} must hold a JSON object")
    if meta.get("dtype", "uint16") not in ("uint16", "uint32"):
        raise DataError(f"{path}: dtype must be uint16 or uint32, got {meta.get('dtype')!r:.40}")
    vocab_size = meta.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise DataError(f"{path}: vocab_size must be a positive integer, got {vocab_size!r:.40}")
    for split in SPLITS:
        count = meta.get(f"{split}_tokens")
        if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
            raise DataError(f"{path}: {split}_tokens must be an integer, got {count!r:.40}")


# --- batches -------------------------------------------------------------------------------

class BatchSampler:
    """Random windows (x, y) of `block_size` tokens, y shifted by one, from a split's ids.

    Draws from its own torch.Generator: the global RNG (dropout) and this stream stay apart,
    and `get_state`/`set_state` let a checkpoint resume on the very next batch.
    """

    def __init__(self, ids: np.ndarray, block_size: int, batch_size: int, seed: int,
                 device: str | torch.device = "cpu"):
        if len(ids) <= block_size:
            raise DataError(f"{len(ids)} tokens are too few for block_size={block_size}")
        self.ids, self.block_size, self.batch_size = ids, block_size, batch_size
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = np.arange(block_size + 1)  # (T + 1,)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """x, y: (B, T) int64 on the sampler's device."""
        starts = torch.randint(len(self.ids) - self.block_size, (self.batch_size,),
                               generator=self.generator).numpy()
        windows = torch.from_numpy(self.ids[starts[:, None] + self.offsets].astype(np.int64))
        if self.device.type == "cuda":
            windows = windows.pin_memory().to(self.device, non_blocking=True)
        else:
            windows = windows.to(self.device)
        return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)

    def get_state(self) -> Tensor:
        return self.generator.get_state()

    def set_state(self, state: Tensor) -> None:
        self.generator.set_state(state)


def sequential_batches(ids: np.ndarray, block_size: int, batch_size: int, max_batches: int,
                       device: str | torch.device = "cpu"):
    """Non-overlapping windows from the start of `ids`, for a deterministic evaluation."""
    n_windows = min((len(ids) - 1) // block_size, batch_size * max_batches)
    for first in range(0, n_windows, batch_size):
        starts = np.arange(first, min(first + batch_size, n_windows)) * block_size
        windows = torch.from_numpy(ids[starts[:, None] + np.arange(block_size + 1)]
                                   .astype(np.int64)).to(device)
        yield windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)
