"""Run directories as a whole: where a checkpoint's files are, which directories can take a new
run, and the one writer of a run.

A checkpoint is committed through glassgpt.storage.commit (pending files, a journal, renames);
readers (`sample`, `eval`, `--init-from`, an export) resolve files through `committed_paths`
and never change a run directory. Only the writer holding the lock (`writing`) finishes or drops an
interrupted commit.

Replacing a run (`train --force`) removes nothing up front: the new run's first commit writes
its files and removes the old run's others in the same commit (see checkpoint.save_checkpoint),
so until the new run has a checkpoint, the old one is there whole.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from glassgpt.errors import CheckpointError
from glassgpt.storage import commit, files
from glassgpt.storage.layout import DATA_MARKERS, RUN


def committed_paths(run_dir: str | Path) -> dict[str, Path]:
    """Where each own file of the committed checkpoint is, without changing anything."""
    return commit.committed_paths(run_dir, RUN, CheckpointError)


def fingerprint(run_dir: str | Path) -> dict[str, tuple[int, int, int] | None]:
    """Identity of each committed file (inode, size, mtime): unchanged by finishing a commit,
    changed by any new one. Lets a writer check, once it holds the lock, that the run it
    validated is the run it is about to continue."""
    result: dict[str, tuple[int, int, int] | None] = {}
    for name, path in committed_paths(run_dir).items():
        try:
            st = os.lstat(path)
            result[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            result[name] = None
    return result


def commit_files(run_dir: str | Path, contents: dict[str, bytes],
                 remove: tuple[str, ...] = ()) -> None:
    """Replace several files of a run so that a crash leaves all old or all new; the caller is
    the run's only writer (it holds the lock, or owns the directory)."""
    commit.commit_files(run_dir, RUN, contents, CheckpointError, remove)


def check_recoverable(run_dir: Path) -> None:
    commit.check_recoverable(run_dir, RUN, CheckpointError)


def recover_interrupted_commit(run_dir: Path) -> None:
    """Writers only, under the lock: finish a cut-short commit, drop an uncommitted one."""
    commit.recover(Path(run_dir), RUN, CheckpointError)


@contextlib.contextmanager
def writing(run_dir: Path) -> Iterator[None]:
    """Create `run_dir` if needed and hold its lock while the block writes the run. A block
    that ends before the first commit leaves no directory (or lock file) it made."""
    with commit.Writer(run_dir, RUN, CheckpointError):
        yield


def own_files_present(run_dir: Path) -> list[str]:
    """The run's own names that exist in `run_dir` (a link counts, even a dangling one)."""
    return commit.own_files_present(run_dir, RUN)


def check_out_dir(run_dir: Path, force: bool, init_from: Path | None = None) -> None:
    """Refuse, before any work and changing nothing, a directory that cannot take a new run:
    a place no directory can be made, a data directory, a run in use, the run `init_from`
    starts from, an existing run without `force`, a planted link without `force`, or a
    directory under one of the run's own names."""
    files.check_can_make_dir(run_dir, CheckpointError)
    if not run_dir.is_dir():
        return
    check_not_a_data_dir(run_dir)
    files.check_unlocked(run_dir, CheckpointError)
    if init_from is not None and init_from.is_dir() and run_dir.samefile(init_from):
        raise CheckpointError(f"--init-from and --out both name {run_dir}; training would "
                              f"replace the weights it starts from: give another --out")
    present = own_files_present(run_dir)
    if present and not force:
        links = [name for name in present if files.entry_kind(run_dir / name) == "link"]
        if links:
            raise CheckpointError(f"{run_dir / links[0]} is a symbolic link; glassgpt never "
                                  f"follows links in a run directory: remove it, or replace "
                                  f"the run with --force")
        raise CheckpointError(f"{run_dir} already holds a run ({', '.join(present[:3])}); "
                              f"continue it with --resume or overwrite it with --force")
    check_replaceable(run_dir)


def check_still_free(run_dir: Path, force: bool) -> None:
    """Under the lock: check again (another process may have written meanwhile). Nothing is
    removed here: the new run's first commit replaces the old run's files."""
    if own_files_present(run_dir) and not force:
        raise CheckpointError(f"{run_dir} already holds a run; continue it with --resume or "
                              f"overwrite it with --force")
    check_replaceable(run_dir)
    recover_interrupted_commit(run_dir)


def continue_run(run_dir: Path, validated: dict[str, tuple[int, int, int] | None]) -> None:
    """Under the lock: the run must be the one that was checked (its `fingerprint` then),
    and an interrupted commit is finished (or its leftovers dropped) before the next."""
    if fingerprint(run_dir) != validated:
        raise CheckpointError(f"{run_dir} changed while it was being checked (another glassgpt "
                              f"process?); run the command again")
    recover_interrupted_commit(run_dir)


def check_replaceable(run_dir: Path) -> None:
    """Raise unless a commit can replace every own file (none is a directory)."""
    for name in own_files_present(run_dir):
        kind = files.entry_kind(run_dir / name)
        if kind not in ("file", "link"):
            raise CheckpointError(f"{run_dir / name} is {files.KIND_PHRASES[kind]}, where "
                                  f"glassgpt keeps a file of its own; move it away (glassgpt "
                                  f"does not delete it)")


def check_not_a_data_dir(run_dir: Path) -> None:
    """Refuse a prepared data directory as a run directory: training would mix the two and
    `--force` would delete its tokenizer."""
    found = [name for name in DATA_MARKERS if files.entry_kind(run_dir / name) != "missing"]
    if found:
        raise CheckpointError(f"{run_dir} is a prepared data directory (it holds "
                              f"{', '.join(found)}), not a run directory; give --out another "
                              f"directory")
