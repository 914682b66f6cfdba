"""Files of run and data directories, read and written without surprises.

Every file glassgpt writes into a run or data directory, and every file it reads from one, goes
through these functions, which hold four promises:
  * No symbolic link is followed. A link planted in a run directory (`model.safetensors.pending`
    pointing at a file elsewhere, say) can neither redirect a write nor feed a read: it is an
    error, never a way out of the directory.
  * Reads are bounded: a file's size is checked before it is read, so a huge (or sparse) file
    cannot exhaust memory.
  * Writes are atomic: a temporary file in the same directory, fsynced, then renamed over the
    target, so a reader or a crash sees the old contents or the new, never a part.
  * JSON is parsed with bounds: size, nesting depth, integers within int64, finite numbers only.
    A file a stranger hands you cannot crash the parser (deep nesting), overflow a tensor size,
    or slip a NaN into a setting.
Functions take the `error` class to raise (`CheckpointError` for runs, `DataError` for data, ...),
so each caller's user sees the kind of mistake it is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import secrets
import stat
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from glassgpt.errors import GlassGPTError
from glassgpt.storage.layout import LOCK_FILE

MAX_JSON_BYTES = 64 * 2**20  # GPT-2's tokenizer.json, the largest JSON file a run holds, is 1.4 MB
MAX_JSON_DEPTH = 32  # tokenizer.json nests 4 deep; anything far deeper is not a real file
INT64_MAX = 2**63 - 1
MAX_NAME_BYTES = 255  # the longest file name most file systems take
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NON_BLOCK = getattr(os, "O_NONBLOCK", 0)

ErrorType = type[GlassGPTError]


# --- reading --------------------------------------------------------------------------------

def open_regular_file(path: str | Path, error: ErrorType) -> int:
    """A read-only descriptor of `path`, which must be a regular file and not a symbolic link.

    The caller closes it. The check is made on the opened file (fstat), so nothing can swap the
    file between the check and the read. The file is opened without blocking (O_NONBLOCK), so a
    FIFO planted where a file belongs is refused at once instead of waiting forever for a
    writer; a regular file reads the same either way.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | _NO_FOLLOW | _CLOEXEC | _NON_BLOCK)
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except OSError as exc:
        raise error(_describe_os_error(path, exc)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{path} is not a regular file")
    return fd


def read_bytes(path: str | Path, max_bytes: int, error: ErrorType) -> bytes:
    """The contents of a regular file of at most `max_bytes` bytes (checked before reading)."""
    fd = open_regular_file(path, error)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise error(f"{path} is {size:,} bytes, more than the {max_bytes:,} such a file may "
                        f"hold; it was not read")
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(max_bytes + 1)[:max_bytes]
    except OSError as exc:
        raise error(_describe_os_error(Path(path), exc)) from None
    finally:
        os.close(fd)


def read_text(path: str | Path, max_bytes: int, error: ErrorType) -> str:
    """A UTF-8 text file of at most `max_bytes` bytes."""
    data = read_bytes(path, max_bytes, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path} is not UTF-8 text (byte {exc.start}: "
                    f"{exc.object[exc.start:exc.start + 1]!r})") from None


def read_json(path: str | Path, error: ErrorType, max_bytes: int = MAX_JSON_BYTES,
              read_as: Mapping[str, Any] | None = None) -> Any:
    """A JSON file, parsed with `parse_json`'s bounds."""
    return parse_json(read_text(path, max_bytes, error), str(path), error, read_as)


def read_json_object(path: str | Path, error: ErrorType, max_bytes: int = MAX_JSON_BYTES,
                     read_as: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A JSON file that must hold an object."""
    data = read_json(path, error, max_bytes, read_as)
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


class _OutOfBoundsError(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        raise _OutOfBoundsError(f"number {text[:40]} is not finite")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise _OutOfBoundsError(f"integer {text[:40]}... does not fit in 64 bits")
    return value


def _no_constant(name: str) -> Any:
    raise _OutOfBoundsError(f"{name} is not a number JSON allows")


def parse_json(text: str, source: str, error: ErrorType,
               read_as: Mapping[str, Any] | None = None) -> Any:
    """JSON text -> Python values, refusing NaN/Infinity, integers beyond int64 and nesting
    deeper than MAX_JSON_DEPTH; `source` names the text in the error.

    `read_as` maps integers written exactly so (their JSON text) to the value they are read
    as instead: a file another program writes may hold one such number on purpose
    (transformers' 10**30, "no limit"), which its reader then looks for by that value."""
    exact = read_as or {}

    def parse_int(number: str) -> Any:
        return exact[number] if number in exact else _int64(number)

    try:
        data = json.loads(text, parse_float=_finite_float, parse_int=parse_int,
                          parse_constant=_no_constant)
    except RecursionError:
        raise error(f"{source}: JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)") \
            from None
    except _OutOfBoundsError as exc:
        raise error(f"{source}: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, and ints of more digits than Python converts
        raise error(f"{source} is not valid JSON: {exc}") from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise error(f"{source}: JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return data


def parse_json_lines(text: str, where: Callable[[int], str], error: ErrorType
                     ) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each line of JSON Lines text that is not blank, parsed with
    `parse_json`'s bounds; `where(n)` names line n in an error. Lines end at "\n" alone (a
    "\r" before it is dropped): a JSON string may hold U+2028, U+2029 or U+0085 unescaped,
    where `str.splitlines()` would cut the line in two."""
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip(" \t\r"):  # JSON's whitespace; anything else is the line's to parse
            yield number, parse_json(line, where(number), error)


def _depth(data: Any) -> int:
    """Nesting depth of parsed JSON, walked without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:  # only containers go deeper (a tokenizer.json holds
                # hundreds of thousands of strings)
                stack.extend((item, depth + 1) for item in value
                             if isinstance(item, dict | list))
    return deepest


def read_toml(path: str | Path, error: ErrorType, max_bytes: int = 2**20) -> dict[str, Any]:
    """A TOML file (a config), bounded like JSON: size, depth, finite numbers."""
    text = read_text(path, max_bytes, error)
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise error(f"{path}: TOML nested too deeply") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path} is not valid TOML: {exc}") from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise error(f"{path}: TOML nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return data


# --- writing --------------------------------------------------------------------------------

@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """The one way a file replaces `path` all at once: a temporary name beside it
    (".NAME.<hex>.tmp", in the same directory, so the rename cannot cross file systems) for
    the block to write; fsynced and renamed over `path` when the block ends well, removed when
    it does not, so a reader or a crash sees the old file or the new, never a part, and a full
    disk leaves no half file. A symbolic link at `path` is replaced, not followed. For a writer
    that needs a path of its own (gguf's); `write_bytes_atomic` writes bytes through it."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        yield temp
        fd = os.open(temp, os.O_RDONLY | _NO_FOLLOW | _CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` all at once (`atomic_path`). The new file gets the
    permissions of the user's umask, like any file they write."""
    with atomic_path(path) as temp, open_new_file(temp) as file:
        file.write(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def open_new_file(path: str | Path) -> Any:
    """A binary file object for a file that must not exist yet (O_EXCL: never an existing
    file, never through a link)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW | _CLOEXEC
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def append_text(path: str | Path, text: str, error: ErrorType) -> None:
    """Append `text` to a regular file (created if missing); a link at `path` is an error."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NO_FOLLOW | _CLOEXEC | _NON_BLOCK
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO no process reads
            raise error(f"{path} is not a regular file") from None
        raise error(_describe_os_error(path, exc)) from None
    with os.fdopen(fd, "a", encoding="utf-8") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path} is not a regular file")
        file.write(text)


def remove_file(path: str | Path) -> None:
    """Remove a file or a link (the link itself, never its target); a missing one is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


KIND_PHRASES = {"file": "a file", "link": "a symbolic link", "directory": "a directory",
                "other": "a socket, FIFO or device", "unreadable": "an entry that cannot be read"}


def entry_kind(path: str | Path) -> str:
    """What `path` itself is, a link not followed: 'missing', 'file', 'link', 'directory',
    'other' (a socket, a FIFO, a device) or 'unreadable' (lstat was refused)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a part is a file
        return "missing"
    except OSError:
        return "unreadable"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    return "directory" if stat.S_ISDIR(mode) else "other"


def remove_file_or_link(path: str | Path, error: ErrorType) -> None:
    """Remove a regular file or a link (the link itself); refuse anything else (a directory
    is never deleted, it may hold what a user keeps); a missing path is fine."""
    kind = entry_kind(path)
    if kind == "missing":
        return
    if kind not in ("file", "link"):
        raise error(f"{path} is {KIND_PHRASES[kind]}, where glassgpt keeps a file of its own; "
                    f"move it away (glassgpt does not delete it)")
    try:
        remove_file(path)
    except OSError as exc:
        raise error(_describe_os_error(Path(path), exc)) from None


def fsync_dir(directory: str | Path) -> None:
    """Make renames inside `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- places to write ------------------------------------------------------------------------

def check_path_given(path: str | Path, error: ErrorType, name: str = "") -> Path:
    """`path` as a Path, unless it is empty: `Path("")` is the working directory, so an empty
    string (a variable left unset) would write there; the CLI refuses `--out ''` the same way.
    `name` says which argument it was (`out=''`)."""
    if isinstance(path, str) and not path:
        given = f"{name}='': " if name else ""
        raise error(f"{given}an empty path names no file or directory; give one (\".\" for "
                    f"the working directory)")
    return Path(path)


def check_can_make_dir(path: str | Path, error: ErrorType) -> Path:
    """Raise unless `path` is a directory glassgpt can write into, or one it can create.

    Checked before any work starts, so a typo in `--out` costs nothing: an empty path, a file,
    a path below a file, a link, a read-only place, a name too long for the file system.
    """
    path = check_path_given(path, error)
    _check_name_lengths(path, error)
    if path.is_symlink():
        raise error(f"{path} is a symbolic link; give the directory it points to")
    if path.exists():
        if not path.is_dir():
            raise error(f"{path} is a file, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise error(f"{path} is not writable")
        return path
    parent = _nearest_existing(path)
    if not parent.is_dir():
        raise error(f"cannot create {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"cannot create {path}: {parent} is not writable")
    return path


def check_can_write_file(path: str | Path, error: ErrorType) -> Path:
    """Raise unless a file can be written at `path` (checked before a long run, not after)."""
    path = check_path_given(path, error)
    _check_name_lengths(path, error)
    if path.is_dir():
        raise error(f"{path} is a directory; give a file name")
    if path.is_symlink():
        raise error(f"{path} is a symbolic link; give a plain file name")
    check_can_make_dir(path.parent if str(path.parent) else Path("."), error)
    return path


def _nearest_existing(path: Path) -> Path:
    for candidate in [path, *path.parents]:
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return Path(".")


def _check_name_lengths(path: Path, error: ErrorType) -> None:
    for part in path.parts:
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise error(f"the name {part[:40]}... is {len(part.encode('utf-8'))} bytes long; "
                        f"file systems take at most {MAX_NAME_BYTES}")


# --- one writer at a time -------------------------------------------------------------------

@contextlib.contextmanager
def locked_directory(directory: str | Path, error: ErrorType) -> Iterator[None]:
    """Hold an exclusive lock on `directory` (which must exist) while the block runs.

    A second process asking for the same directory gets `error` at once, naming the process that
    holds it, instead of two writers interleaving their files. The lock is the operating
    system's (flock), so it goes away with its process, even after kill -9.
    """
    lock_path = Path(directory) / LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | _NO_FOLLOW | _CLOEXEC | _NON_BLOCK
    try:
        fd = os.open(lock_path, flags, 0o666)
    except OSError as exc:
        raise error(_describe_os_error(lock_path, exc)) from None
    try:
        _check_regular(fd, lock_path, error)
        _take_lock(fd, directory, error)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode("ascii"), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _check_regular(fd: int, path: Path, error: ErrorType) -> None:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise error(f"{path} is not a regular file")


def _take_lock(fd: int, directory: str | Path, error: ErrorType) -> None:
    """flock `fd` at once, or raise `error` naming the process that holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "another process"
        raise error(f"{directory} is in use by another glassgpt process (pid {holder}); "
                    f"wait for it to finish") from None


def check_unlocked(directory: str | Path, error: ErrorType) -> None:
    """Raise `error` if another process holds `locked_directory(directory)` now.

    Only looks: creates nothing, so a command can ask before it validates its inputs (and
    leave the directory untouched when they are wrong), then take the lock itself.
    """
    lock_path = Path(directory) / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDONLY | _NO_FOLLOW | _CLOEXEC | _NON_BLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise error(_describe_os_error(lock_path, exc)) from None
    try:
        _check_regular(fd, lock_path, error)
        _take_lock(fd, directory, error)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _describe_os_error(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return (f"{path} is a symbolic link; glassgpt never follows links inside run and data "
                f"directories")
    if exc.errno == errno.EISDIR:
        return f"{path} is a directory, not a file"
    if exc.errno == errno.ENOTDIR:
        return f"{path}: a part of this path is a file, not a directory"
    if exc.errno == errno.ENAMETOOLONG:
        return f"{path}: name too long for the file system"
    return f"cannot use {path}: {exc.strerror or exc}"
