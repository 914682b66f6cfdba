"""One way to change a directory of several files so that a crash leaves all old or all new.

Run directories (a checkpoint) and data directories (a preparation) both change like a tiny
database transaction:
  1. each new file is written in full under `<name>.pending` and fsynced;
  2. the journal (`checkpoint.journal`, `prepare.journal`) is written atomically, naming the
     files written and the files removed: this is the commit point;
  3. each pending file is renamed over its name, each removed name unlinked, the journal removed.
A crash before 2 leaves the old files whole; a crash after it leaves the new ones, half moved.

One reader rule for both kinds: readers never write. `committed_paths` resolves each name
through the journal (a pending file the journal names is the committed one; a name it removes
is gone), so `sample`, `eval` or training on a data directory read a half-moved commit as the
new one without touching it. Only a writer holding the directory's lock (`Writer`, or a caller
that holds `files.locked_directory`) finishes or drops an interrupted commit (`recover`), and it
touches glassgpt's own names only: pending files, the journal, its own temporary files. Nothing
is opened through a symbolic link.

A directory that is made whole in one go (a Hugging Face export or import) needs no journal:
`staged_directory` writes it beside its destination and renames it into place, so it appears
whole or not at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from glassgpt.errors import CheckpointError, GlassGPTError
from glassgpt.storage import files
from glassgpt.storage.layout import LOCK_FILE, PENDING_SUFFIX, DirKind

MAX_JOURNAL_BYTES = 4096
ErrorType = type[GlassGPTError]


def _temp_pattern(kind: DirKind) -> re.Pattern[str]:
    """files.write_bytes_atomic's temporary names for a kind's own files: ".NAME.<hex>.tmp"."""
    names = "|".join(re.escape(name) for name in (*kind.files, kind.journal))
    return re.compile(rf"\.({names})\.[0-9a-f]{{12}}\.tmp")


# --- reading (never writes) -------------------------------------------------------------------

def read_journal(directory: Path, kind: DirKind, error: ErrorType
                 ) -> tuple[list[str], list[str]] | None:
    """(names written, names removed) of a committed but unfinished change, or None."""
    path = directory / kind.journal
    if files.entry_kind(path) == "missing":
        return None
    data = files.read_json(path, error, MAX_JOURNAL_BYTES)
    if isinstance(data, list):  # the format before removals existed: names written only
        data = {"write": data, "remove": []}
    written = data.get("write") if isinstance(data, dict) else None
    removed = data.get("remove", []) if isinstance(data, dict) else None
    if not (_names_of(written, kind) and _names_of(removed, kind)):
        raise error(f"{path} may only name the {kind.what} files {list(kind.files)}, got "
                    f"{data!r:.200}")
    return written, removed


def _names_of(names: Any, kind: DirKind) -> bool:
    return (isinstance(names, list) and all(isinstance(n, str) for n in names)
            and set(names) <= set(kind.files))


def committed_paths(directory: str | Path, kind: DirKind, error: ErrorType) -> dict[str, Path]:
    """Where each file of the committed state is, changing nothing: its pending file while a
    commit is half moved, else its own name. A name the commit removes maps to its pending
    path, which is absent (pending files exist only for names written), so it reads as missing.
    """
    directory = Path(directory)
    written, removed = read_journal(directory, kind, error) or ([], [])
    paths = {}
    for name in kind.files:
        pending = directory / (name + PENDING_SUFFIX)
        moving = name in written and files.entry_kind(pending) != "missing"
        paths[name] = pending if moving or name in removed else directory / name
    return paths


# --- writing (one writer, holding the lock) ---------------------------------------------------

def commit_files(directory: str | Path, kind: DirKind, contents: dict[str, bytes],
                 error: ErrorType, remove: tuple[str, ...] = ()) -> None:
    """Replace several files of `directory` all at once; `remove` names files that go in the
    same commit. The caller is the directory's only writer (it holds its lock)."""
    directory = Path(directory)
    written: list[str] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        recover(directory, kind, error)
        for name, data in contents.items():
            with files.open_new_file(directory / (name + PENDING_SUFFIX)) as file:
                written.append(name)
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
    except OSError as exc:  # a full disk, a read-only mount: nothing was committed
        drop_pending(directory, kind, written)
        raise error(f"cannot save {kind.noun} in {directory} ({exc.strerror or exc}); {kind.kept} "
                    f"there is kept") from None
    commit_pending(directory, kind, written, error, remove)


def commit_pending(directory: Path, kind: DirKind, names: list[str], error: ErrorType,
                   remove: tuple[str, ...] = ()) -> None:
    """Make the pending files of `names` (each written in full and fsynced) the directory's,
    and remove `remove`, all at once."""
    removed = sorted(set(remove) - set(names))
    try:
        files.fsync_dir(directory)
        journal = json.dumps({"write": sorted(names), "remove": removed})
        files.write_text_atomic(directory / kind.journal, journal)  # the commit point
    except BaseException as exc:  # a full disk, or an interrupt: nothing was committed
        drop_pending(directory, kind, names)
        if not isinstance(exc, OSError):
            raise
        raise error(f"cannot save {kind.noun} in {directory} ({exc.strerror or exc}); {kind.kept} "
                    f"there is kept") from None
    try:
        _roll_forward(directory, kind, sorted(names), removed, error)
    except OSError as exc:
        raise error(f"saved {kind.noun} in {directory} but could not move all the files into place "
                    f"({exc.strerror or exc}); the change is complete, and {kind.finisher} "
                    f"finishes the move") from None


def drop_pending(directory: Path, kind: DirKind, names: list[str] | tuple[str, ...]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            files.remove_file(directory / (name + PENDING_SUFFIX))


def check_recoverable(directory: Path, kind: DirKind, error: ErrorType) -> None:
    """Raise unless `recover` can do its work: what a journal names is a regular file, and no
    own pending name is a directory. Checked before a writer takes the lock, so that a refusal
    leaves the directory as it was."""
    written, _ = read_journal(directory, kind, error) or ([], [])
    for name in kind.files:
        pending = directory / (name + PENDING_SUFFIX)
        found = files.entry_kind(pending)
        if name in written and found not in ("missing", "file"):
            # glassgpt writes regular files only: this one was planted
            raise error(f"{pending} is {files.KIND_PHRASES[found]}, not a file glassgpt wrote, "
                        f"and glassgpt never follows links: remove it (and "
                        f"{directory / kind.journal}) and try again")
        if found not in ("missing", "file", "link"):
            raise error(f"{pending} is {files.KIND_PHRASES[found]}, where glassgpt keeps a "
                        f"file of its own; move it away (glassgpt does not delete it)")


def recover(directory: Path, kind: DirKind, error: ErrorType) -> None:
    """Writers only, under the lock: finish a commit a crash cut short, then drop what an
    uncommitted one left behind (pending files, temporary files; links as links)."""
    check_recoverable(directory, kind, error)
    journal = read_journal(directory, kind, error)
    if journal is not None:
        try:
            _roll_forward(directory, kind, *journal, error)
        except OSError as exc:
            raise error(f"cannot finish the interrupted change in {directory}: "
                        f"{exc.strerror or exc}") from None
    for name in kind.pending_files:
        files.remove_file_or_link(directory / name, error)
    pattern = _temp_pattern(kind)
    for entry in os.listdir(directory):
        if pattern.fullmatch(entry):
            files.remove_file_or_link(directory / entry, error)


def _roll_forward(directory: Path, kind: DirKind, written: list[str], removed: list[str],
                  error: ErrorType) -> None:
    for name in written:
        pending = directory / (name + PENDING_SUFFIX)
        if files.entry_kind(pending) == "file":  # missing when renamed before a crash
            os.replace(pending, directory / name)
    for name in removed:
        files.remove_file_or_link(directory / name, error)
    files.fsync_dir(directory)
    files.remove_file(directory / kind.journal)
    files.fsync_dir(directory)


def own_files_present(directory: Path, kind: DirKind) -> list[str]:
    """The kind's own names that exist in `directory` (a link counts, even a dangling one)."""
    return [name for name in kind.own_files if files.entry_kind(directory / name) != "missing"]


class Writer:
    """The one writer of a directory, as a context manager: creates the directory (and its
    parents) if needed, holds its lock, and finishes an interrupted commit first.

    Leaving the block before anything was committed removes every trace: pending files, and
    the lock file and directories it made. So a full disk at the first save, or a failure
    before it, leaves no half-made directory behind.
    """

    def __init__(self, directory: str | Path, kind: DirKind, error: ErrorType):
        self.dir, self.kind, self.error = Path(directory), kind, error
        self._stack = contextlib.ExitStack()
        self._made_dirs: list[Path] = []
        self._made_lock = False
        self._written: list[str] = []

    def __enter__(self) -> Writer:
        try:
            self._make_dirs()
            self._made_lock = files.entry_kind(self.dir / LOCK_FILE) == "missing"
            self._stack.enter_context(files.locked_directory(self.dir, self.error))
            recover(self.dir, self.kind, self.error)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _make_dirs(self) -> None:
        missing = [p for p in [self.dir, *self.dir.parents] if not os.path.lexists(p)]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self.error(f"cannot create {self.dir}: {exc.strerror or exc}") from None
        self._made_dirs = missing  # deepest first

    def pending(self, name: str) -> Path:
        """Where the new `name` is written before `commit`."""
        if name not in self._written:
            self._written.append(name)
        return self.dir / (name + PENDING_SUFFIX)

    def write_pending(self, name: str, data: bytes) -> None:
        with files.open_new_file(self.pending(name)) as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())

    def commit(self, remove: tuple[str, ...] = ()) -> None:
        """Make the pending files written so far the directory's (and `remove` gone)."""
        names, self._written = self._written, []  # past the journal they are no longer pending
        commit_pending(self.dir, self.kind, names, self.error, remove)

    def holds_anything(self) -> bool:
        """Whether the directory holds a file of its kind, or a commit (its journal)."""
        return any(files.entry_kind(self.dir / name) != "missing"
                   for name in (*self.kind.files, self.kind.journal))

    def __exit__(self, *exc: object) -> None:
        try:
            drop_pending(self.dir, self.kind, self._written)
            if not self.holds_anything():
                self._remove_what_it_made()
        finally:
            self._stack.close()

    def _remove_what_it_made(self) -> None:
        with contextlib.suppress(OSError, GlassGPTError):
            recover(self.dir, self.kind, self.error)  # temporary files of a failed write
        if self._made_lock or self._made_dirs:
            files.remove_file(self.dir / LOCK_FILE)
        for made in self._made_dirs:
            with contextlib.suppress(OSError):
                made.rmdir()  # only when empty: nothing of the user's is ever removed


# --- a directory made whole in one go ---------------------------------------------------

@contextlib.contextmanager
def staged_directory(out: Path, replacing: bool = False) -> Iterator[Path]:
    """A fresh directory beside `out` to write into; when the block ends well it becomes `out`
    in one rename, and whatever goes wrong it is removed: `out` appears whole or not at all
    (a full disk leaves nothing behind, not even an empty directory).

    `out` must be missing or an empty directory, unless `replacing` (an earlier export, checked
    by the caller): that one goes only once the new one is complete. OSError (a full disk, a
    directory that appeared meanwhile) is raised as one CheckpointError naming `out`.
    """
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as error:
        raise CheckpointError(f"cannot create {out} ({error})") from None
    try:
        yield staging
        usual_permissions(staging)
        fsync_tree(staging)
        _move_into_place(staging, out, replacing)
    except OSError as error:
        raise CheckpointError(_nothing_written(out, error)) from None
    except CheckpointError as error:  # a writer that named the disk's error in its own words
        if isinstance(error.__context__, OSError):  # ... about a staging name the user never gave
            raise CheckpointError(_nothing_written(out, error.__context__)) from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _nothing_written(out: Path, error: OSError) -> str:
    """The disk's reason without the staging path it happened at (the user never named it)."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    return f"cannot write {out} ({reason}); nothing was left there"


def _move_into_place(staging: Path, out: Path, replacing: bool) -> None:
    """Rename the finished directory to `out`; an earlier export there goes only once the new
    one is complete, so a crash leaves one whole export."""
    if not replacing:
        os.replace(staging, out)  # atomic; replaces `out` only when it is an empty directory
        return
    old = out.with_name(f".{out.name}.replaced")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def usual_permissions(directory: Path) -> None:
    """mkdtemp makes a private directory (0700) and transformers writes some files 0600; the
    export should read like any directory the user writes (their umask decides)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def fsync_tree(directory: Path) -> None:
    """Make every file of `directory`, and the directory itself, durable."""
    for path in directory.iterdir():
        if not path.is_file() or path.is_symlink():
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    files.fsync_dir(directory)
