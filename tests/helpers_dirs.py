"""What a command changed on disk: snapshots of directories, compared before and after.

    before = snapshot(run, data, outside)
    code = main([...])
    assert_unchanged(before, snapshot(run, data, outside))

A snapshot records every entry under each directory, links included and never followed: a
file by its sha256, a link by its target, a directory by its presence. So a file written
through a planted link, a link swapped for a file, a file created or deleted, or a directory
made where none was all show up, each named. A file over FULL_HASH_BYTES (a sparse 64 GiB test
file, say) is recorded by its size, modification time and the hash of its first and last MiB.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

Snapshot = dict[str, str]


def snapshot(*directories: Path, skip: tuple[str, ...] = ()) -> Snapshot:
    """Entry -> what it is, for every entry under each of `directories` (and the directory
    itself). Entries whose path relative to their directory starts with one of `skip` are left
    out. A directory that does not exist is recorded as missing."""
    entries: Snapshot = {}
    for directory in directories:
        entries[str(directory)] = _describe(directory)
        if not directory.is_dir() or directory.is_symlink():
            continue
        for root, dirs, names in os.walk(directory):  # os.walk does not follow links
            for name in sorted(dirs + names):
                path = Path(root) / name
                relative = str(path.relative_to(directory))
                if not relative.startswith(skip):
                    entries[str(path)] = _describe(path)
    return entries


FULL_HASH_BYTES = 64 * 2**20
EDGE_BYTES = 2**20


def _describe(path: Path) -> str:
    if path.is_symlink():
        return f"link -> {os.readlink(path)}"
    if path.is_dir():
        return "directory"
    if path.is_file():
        return "file " + _file_digest(path)
    return "missing" if not os.path.lexists(path) else "other"


def _file_digest(path: Path) -> str:
    st = path.stat()
    if st.st_size <= FULL_HASH_BYTES:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256(f"{st.st_size} {st.st_mtime_ns}".encode())
    with open(path, "rb") as file:
        digest.update(file.read(EDGE_BYTES))
        file.seek(-EDGE_BYTES, os.SEEK_END)
        digest.update(file.read(EDGE_BYTES))
    return digest.hexdigest()


def changes(before: Snapshot, after: Snapshot) -> dict[str, tuple[str | None, str | None]]:
    """Path -> (before, after) for every entry that differs."""
    return {path: (before.get(path), after.get(path))
            for path in sorted(before.keys() | after.keys())
            if before.get(path) != after.get(path)}


def assert_unchanged(before: Snapshot, after: Snapshot) -> None:
    changed = changes(before, after)
    assert not changed, "changed on disk:\n" + "\n".join(
        f"  {path}: {old} -> {new}" for path, (old, new) in changed.items())


class Crash(BaseException):
    """Raised in place of a file operation (a BaseException: nothing in glassgpt may catch it)."""


def crash_after(monkeypatch, points: int) -> None:
    """Let `points` calls of os.replace / os.fsync / os.unlink through, then raise Crash: a
    process killed at that moment of a commit. `monkeypatch.undo()` ends it."""
    calls: list[tuple] = []

    def crash_at_point(real, *args):
        calls.append(args)
        if len(calls) > points:
            raise Crash
        return real(*args)

    for name in ("replace", "fsync", "unlink"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, real=real: crash_at_point(real, *a))
