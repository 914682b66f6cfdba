"""Where text comes from, read in blocks so that memory never depends on its size.

Tiny Shakespeare, the default corpus, ships inside the package (bz2-compressed package data,
checked against its sha256 every time it is read), so the default run needs no network. A copy
named by $GLASSGPT_TINYSHAKESPEARE, or one in the user's cache, wins when present.

Any other corpus is one or more UTF-8 files; glob patterns expand in sorted order. A `Corpus`
reads its files as one text, their concatenation, in decoded blocks of bounded size.
"""

from __future__ import annotations

import bz2
import codecs
import glob
import hashlib
import io
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from glassgpt.errors import DataError
from glassgpt.storage.files import check_can_make_dir, write_bytes_atomic

TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINYSHAKESPEARE_BYTES = 1_115_394
TINYSHAKESPEARE_ENV = "GLASSGPT_TINYSHAKESPEARE"
TINYSHAKESPEARE_FILE = "tinyshakespeare.txt"
PACKAGED_TINYSHAKESPEARE = "corpora/tinyshakespeare.txt.bz2"  # inside the glassgpt package
CACHE_ENV = "XDG_CACHE_HOME"
GLOB_CHARACTERS = "*?["


# --- Tiny Shakespeare -----------------------------------------------------------------------

def cache_dir() -> Path:
    """Where glassgpt keeps data it makes for itself: $XDG_CACHE_HOME/glassgpt, checked to be
    a directory glassgpt can create and write (a DataError names the problem otherwise)."""
    path = _cache_base() / "glassgpt"
    try:
        return check_can_make_dir(path, DataError)
    except DataError as error:
        raise DataError(f"the cache directory is unusable ({CACHE_ENV}="
                        f"{os.environ.get(CACHE_ENV, '')!r:.200}): {error}") from None


def _cache_base() -> Path:
    base = os.environ.get(CACHE_ENV, "")
    # The XDG spec ignores a relative path here.
    return Path(base) if os.path.isabs(base) else Path.home() / ".cache"


def tinyshakespeare() -> tuple[bytes, str]:
    """The text of Tiny Shakespeare, checked, and where it came from: the file named by
    $GLASSGPT_TINYSHAKESPEARE, else the cache's copy, else the copy inside the package."""
    env_path = os.environ.get(TINYSHAKESPEARE_ENV)
    if env_path:
        return _read_shakespeare_file(Path(env_path), f"{TINYSHAKESPEARE_ENV}={env_path}"), \
            env_path
    cached = _cached_shakespeare()
    if cached is not None:
        return _read_shakespeare_file(cached, str(cached)), str(cached)
    return packaged_tinyshakespeare(), f"glassgpt/{PACKAGED_TINYSHAKESPEARE}"


def tinyshakespeare_path() -> Path:
    """A checked plain-text file of Tiny Shakespeare: $GLASSGPT_TINYSHAKESPEARE, the cache's
    copy, or the packaged copy unpacked into the cache (no network, ever)."""
    env_path = os.environ.get(TINYSHAKESPEARE_ENV)
    if env_path:
        _read_shakespeare_file(Path(env_path), f"{TINYSHAKESPEARE_ENV}={env_path}")
        return Path(env_path)
    cached = _cached_shakespeare()
    if cached is not None:
        _read_shakespeare_file(cached, str(cached))
        return cached
    target = cache_dir() / TINYSHAKESPEARE_FILE
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(target, packaged_tinyshakespeare())
    except OSError as error:
        raise DataError(f"cannot unpack Tiny Shakespeare into {target}: {error}") from None
    return target


def packaged_tinyshakespeare() -> bytes:
    """The copy inside the package, decompressed (at most its known size) and checked."""
    resource = resources.files("glassgpt").joinpath(PACKAGED_TINYSHAKESPEARE)
    try:
        with resource.open("rb") as packed, bz2.BZ2File(packed) as unpacked:
            data = unpacked.read(TINYSHAKESPEARE_BYTES + 1)
    except (OSError, EOFError, ValueError) as error:
        raise DataError(f"the Tiny Shakespeare copy inside the glassgpt package is unreadable "
                        f"({error}); reinstall glassgpt, or set {TINYSHAKESPEARE_ENV}=PATH to a "
                        f"copy of the text") from None
    return _checked_shakespeare(data, f"glassgpt/{PACKAGED_TINYSHAKESPEARE}")


def _cached_shakespeare() -> Path | None:
    path = _cache_base() / "glassgpt" / TINYSHAKESPEARE_FILE
    try:
        return path if stat.S_ISREG(path.stat().st_mode) else None
    except OSError:  # absent, or a cache that is not a directory: there is no copy
        return None


def _read_shakespeare_file(path: Path, name: str) -> bytes:
    with _open_text_file(path) as file:
        size = os.fstat(file.fileno()).st_size
        if size != TINYSHAKESPEARE_BYTES:  # checked before reading: a huge file costs nothing
            raise DataError(f"{name} is not Tiny Shakespeare: {size:,} bytes, expected "
                            f"{TINYSHAKESPEARE_BYTES:,}")
        data = file.read(TINYSHAKESPEARE_BYTES + 1)
    return _checked_shakespeare(data, name)


def _checked_shakespeare(data: bytes, name: str) -> bytes:
    digest = hashlib.sha256(data).hexdigest()
    if digest != TINYSHAKESPEARE_SHA256:
        raise DataError(f"{name} is not Tiny Shakespeare: sha256 {digest}, expected "
                        f"{TINYSHAKESPEARE_SHA256}")
    return data


# --- the user's files -----------------------------------------------------------------------

def find_text_files(paths: Sequence[str | Path]) -> list[Path]:
    """Files and glob patterns (`owt/*.txt`, `books/**/*.txt`) -> files in the order given,
    each pattern's matches sorted, each file once. A path is a pattern only when no file has
    that very name."""
    found: dict[Path, None] = {}  # ordered, without repeats
    for given in paths:
        path = Path(given).expanduser()
        if os.path.lexists(path):
            matches = [path]
        elif any(c in str(given) for c in GLOB_CHARACTERS):
            matches = [Path(m) for m in sorted(glob.glob(str(path), recursive=True))
                       if os.path.isfile(m)]
            if not matches:
                raise DataError(f"no text file matches {given}")
        else:
            raise DataError(f"text file not found: {given}")
        for match in matches:
            found.setdefault(match.absolute(), None)
    if not found:
        raise DataError("no text file given")
    return list(found)


def _open_text_file(path: Path) -> BinaryIO:
    """A file the user named, opened for reading: links are followed (the user chose it), but
    it must be a regular file (a directory, a FIFO or /dev/zero is an error, not a hang)."""
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer; regular files ignore it.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise DataError(f"text file not found: {path}") from None
    except IsADirectoryError:
        raise DataError(f"{path} is a directory; give text files, or a pattern such as "
                        f"'{path}/*.txt'") from None
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror or error}") from None
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):
        os.close(fd)
        raise DataError(f"{path} is a directory; give text files, or a pattern such as "
                        f"'{path}/*.txt'")
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DataError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


# --- reading a corpus -----------------------------------------------------------------------

@dataclass
class Corpus:
    """Text to prepare: files read in order as one text, or Tiny Shakespeare's bytes.

    `blocks` reads it all once; afterwards `sha256` and `text_bytes` describe what was read.
    """

    files: list[Path]
    source: str | list[str]  # what meta.json records: a path, or the paths and patterns given
    data: bytes | None = None  # the whole text, when it is already in memory
    sha256: str | None = None
    text_bytes: int = 0

    @classmethod
    def from_paths(cls, paths: str | Path | Sequence[str | Path] | None) -> Corpus:
        """Files and patterns (None: Tiny Shakespeare), checked before any work starts."""
        if paths is None:
            data, where = tinyshakespeare()
            return cls([], where, data)
        given = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
        files = find_text_files(given)
        for path in given:  # a named file is checked now; a pattern only matches files
            if os.path.lexists(Path(path).expanduser()):
                _open_text_file(Path(path).expanduser()).close()
        source = str(files[0].resolve()) if len(given) == len(files) == 1 else \
            [str(p) for p in given]
        return cls(files, source)

    @property
    def name(self) -> str:
        """The corpus in an error message."""
        if self.data is not None or len(self.files) == 1:
            return str(self.source)
        return f"the {len(self.files)} files of {', '.join(map(str, self.source))}"[:300]

    def blocks(self, block_bytes: int) -> Iterator[str]:
        """The text in blocks of at most `block_bytes` bytes (each decoded; a character never
        straddles two blocks). Invalid UTF-8 is a DataError naming the file and byte; a text
        with nothing but whitespace is a DataError too."""
        digest, size, has_text = hashlib.sha256(), 0, False
        for name, opener in self._parts():
            with opener() as stream:
                for block, raw_bytes in _decoded_blocks(name, stream, block_bytes):
                    digest.update(raw_bytes)
                    size += len(raw_bytes)
                    has_text = has_text or (bool(block) and not block.isspace())
                    yield block
        if not has_text:
            raise DataError(f"{self.name} is empty")
        self.sha256, self.text_bytes = digest.hexdigest(), size

    def _parts(self) -> Iterator[tuple[str, Callable[[], BinaryIO]]]:
        if self.data is not None:
            yield str(self.source), lambda: io.BytesIO(self.data)
        for path in self.files:
            yield str(path), lambda path=path: _open_text_file(path)


def _decoded_blocks(name: str, stream: BinaryIO, block_bytes: int
                    ) -> Iterator[tuple[str, bytes]]:
    """(text, the bytes read for it) per block of one file, decoded as strict UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0  # bytes of the file read before this block
    while True:
        data = stream.read(block_bytes)
        # Where the text decoded now starts in the file: a character may have begun in the
        # last block, its first bytes held by the decoder.
        start = offset - len(decoder.getstate()[0])
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as error:
            raise DataError(f"{name} is not UTF-8 text (byte {start + error.start}: "
                            f"{error.object[error.start:error.start + 1]!r}); if it is text "
                            f"in another encoding, convert it first, e.g. `iconv -f latin1 "
                            f"-t utf-8 {name} > {name}.utf8` (Latin-1 / Windows-1252)") from None
        if "\x00" in text:  # valid UTF-8, but binary: a sparse file, or UTF-16 text
            position = start + len(text[:text.index("\x00")].encode("utf-8"))
            raise DataError(f"{name} holds a NUL byte (byte {position}): binary data or "
                            f"UTF-16, not UTF-8 text")
        offset += len(data)
        if text or data:
            yield text, data
        if not data:
            return
