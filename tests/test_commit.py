"""One commit primitive for run and data directories (glassgpt.storage.commit), tested on both
kinds.

A crash at every file operation of a commit leaves the old files or the new, every one from
the same commit; readers resolve through the journal and never write; a writer that fails
before its first commit leaves no directory behind.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glassgpt.errors import CheckpointError, DataError
from glassgpt.storage import commit, files
from glassgpt.storage.layout import DATA, LOCK_FILE, RUN
from helpers_dirs import Crash, crash_after

KINDS = {"run": (RUN, CheckpointError), "data": (DATA, DataError)}



def contents(kind, version: str) -> dict[str, bytes]:
    """Every file of the kind but its last (which the commit removes), marked with `version`."""
    return {name: f"{version}:{name}".encode() for name in kind.files[:-1]}


def committed_view(directory: Path, kind, error) -> dict[str, bytes | None]:
    """What a reader sees: each own file's bytes through the journal, None when missing."""
    view = {}
    for name, path in commit.committed_paths(directory, kind, error).items():
        view[name] = path.read_bytes() if path.is_file() else None
    return view


def hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


@pytest.mark.parametrize("which", KINDS)
def test_a_crash_at_any_step_of_a_commit_leaves_all_old_or_all_new(which, tmp_path,
                                                                   monkeypatch):
    kind, error = KINDS[which]
    old = {**contents(kind, "old"), kind.files[-1]: f"old:{kind.files[-1]}".encode()}
    new = contents(kind, "new")
    expected_new = {name: new.get(name) for name in kind.files}  # the last one removed
    points = 0
    while True:
        directory = tmp_path / f"crash{points}"
        commit.commit_files(directory, kind, old, error)
        crash_after(monkeypatch, points)
        try:
            commit.commit_files(directory, kind, new, error, remove=(kind.files[-1],))
            finished = True
        except Crash:
            finished = False
        monkeypatch.undo()
        on_disk = hashes(directory)
        seen = committed_view(directory, kind, error)
        assert seen in (old, expected_new), f"a mix after {points} operations: {seen}"
        assert hashes(directory) == on_disk  # reading changed nothing
        commit.recover(directory, kind, error)  # what the next writer does first
        assert committed_view(directory, kind, error) == seen
        assert sorted(p.name for p in directory.iterdir()) == sorted(
            name for name, data in seen.items() if data is not None)
        if finished:
            break
        points += 1
    assert points >= 8  # pending writes, journal, renames, the removal: every one was cut


@pytest.mark.parametrize("which", KINDS)
def test_a_full_disk_at_the_first_commit_leaves_no_directory(which, tmp_path, monkeypatch):
    kind, error = KINDS[which]
    target = tmp_path / "new" / "dir"

    def no_space(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    with pytest.raises(error, match="No space left"), commit.Writer(target, kind, error):
        assert (target / LOCK_FILE).is_file()
        monkeypatch.setattr(files, "open_new_file", no_space)
        commit.commit_files(target, kind, contents(kind, "new"), error)
    assert not (tmp_path / "new").exists()  # the directories it made went, lock file and all


@pytest.mark.parametrize("which", KINDS)
def test_a_writer_keeps_a_directory_that_was_there(which, tmp_path):
    kind, error = KINDS[which]
    (tmp_path / "notes.txt").write_text("mine")
    with commit.Writer(tmp_path, kind, error):
        pass  # nothing committed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_preparing_data_does_not_import_the_model(tmp_path):
    """Data code names a run's files through glassgpt.storage.layout, never through checkpoint code:
    `prepare` and reading a data directory load neither the model nor the run modules."""
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be " * 40, encoding="utf-8")
    script = (f"import sys\nfrom glassgpt.data import PreparedData, prepare\n"
              f"prepare({str(tmp_path / 'd')!r}, {str(text)!r})\n"
              f"PreparedData({str(tmp_path / 'd')!r})\n"
              f"print(sorted(m for m in sys.modules if m in ('glassgpt.model', "
              f"'glassgpt.rundir.checkpoint', 'glassgpt.rundir.directory', "
              f"'glassgpt.training.trainer')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout
