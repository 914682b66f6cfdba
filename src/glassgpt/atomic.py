"""Atomic file writes: a reader (or a crash) sees a file's old contents or its new ones, never a
part. Write to a temporary file in the same directory, fsync it, then `os.replace` it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    # A fresh name opened with "x" (not mkstemp, which makes files only the owner can read): the
    # file gets the usual permissions of the user's umask, like any file they write.
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(temp, "xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def fsync_dir(directory: str | Path) -> None:
    """Make renames inside `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
