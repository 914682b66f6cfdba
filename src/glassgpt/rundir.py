"""Run directories on disk: which files are a run's own, how a checkpoint is committed, how it is
read, and how a run is replaced.

A checkpoint is several files, so it is committed like a tiny database transaction: each file is
first written in full under its `.pending` name, then a journal naming them is written atomically
(the commit point), then each is renamed into place and the journal removed. A crash before the
journal leaves the old checkpoint whole; a crash after it leaves the new one, half renamed.

Readers (`sample`, `eval`, `--init-from`, an export) never change a run directory:
`committed_paths` resolves each file through the journal, so a half-renamed commit reads as the
new checkpoint (a pending file the journal names) and an uncommitted one as the old. Only a
writer holding the directory's lock (`train`) finishes or drops an interrupted commit, and it
only ever touches glassgpt's own names: `<checkpoint file>.pending`, the journal, its own
temporary files. Nothing is opened through a symbolic link: a planted one is removed as a link
where glassgpt is about to write its own file, or refused where a reader would follow it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from glassgpt import files
from glassgpt.errors import CheckpointError
from glassgpt.metrics import METRICS_FILE, PLOT_FILE

CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"  # the weights of the last checkpoint (what --resume continues)
BEST_FILE = "best.safetensors"  # the weights of the evaluation with the lowest val loss
TOKENIZER_FILE = "tokenizer.json"
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"
JOURNAL_FILE = "checkpoint.journal"
PENDING_SUFFIX = ".pending"
CHECKPOINT_FILES = (CONFIG_FILE, MODEL_FILE, BEST_FILE, TOKENIZER_FILE, STATE_TENSORS_FILE,
                    STATE_JSON_FILE)
PENDING_FILES = tuple(name + PENDING_SUFFIX for name in CHECKPOINT_FILES)
# What `train --force` replaces; anything else in the directory (notes, a README) is kept.
RUN_FILES = (*CHECKPOINT_FILES, METRICS_FILE, PLOT_FILE, JOURNAL_FILE, *PENDING_FILES)
# A prepared data directory has these; a run never does, so --out naming one is a typo.
DATA_FILES = ("meta.json", "train.bin", "val.bin")
MAX_JOURNAL_BYTES = 4096
# files.write_bytes_atomic's temporary names for the run's own files: ".NAME.<12 hex>.tmp".
_OWN_NAMES = "|".join(re.escape(name) for name in
                      (*CHECKPOINT_FILES, METRICS_FILE, PLOT_FILE, JOURNAL_FILE))
_OWN_TEMP = re.compile(rf"\.({_OWN_NAMES})\.[0-9a-f]{{12}}\.tmp")


# --- reading ----------------------------------------------------------------------------------

def read_journal(run_dir: Path) -> list[str] | None:
    """The names a committed but unfinished checkpoint lists, or None when there is none."""
    path = run_dir / JOURNAL_FILE
    if files.entry_kind(path) == "missing":
        return None
    names = files.read_json(path, CheckpointError, MAX_JOURNAL_BYTES)
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)
            and set(names) <= set(CHECKPOINT_FILES)):
        raise CheckpointError(f"{path} may only name the checkpoint files "
                              f"{list(CHECKPOINT_FILES)}, got {names!r:.200}")
    return names


def committed_paths(run_dir: str | Path) -> dict[str, Path]:
    """Where each checkpoint file of the committed checkpoint is, without changing anything:
    its pending file while a commit is half renamed, else its own name."""
    run_dir = Path(run_dir)
    journal = read_journal(run_dir) or []
    paths = {}
    for name in CHECKPOINT_FILES:
        pending = run_dir / (name + PENDING_SUFFIX)
        committed = name in journal and files.entry_kind(pending) != "missing"
        paths[name] = pending if committed else run_dir / name
    return paths


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


# --- committing -------------------------------------------------------------------------------

def commit_files(run_dir: str | Path, contents: dict[str, bytes]) -> None:
    """Replace several checkpoint files of `run_dir` so that a crash leaves all old or all new.

    The caller is the run's only writer (it holds `files.locked_directory`).
    """
    run_dir = Path(run_dir)
    written: list[Path] = []
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        recover_interrupted_commit(run_dir)
        for name, data in contents.items():
            pending = run_dir / (name + PENDING_SUFFIX)
            with files.open_new_file(pending) as file:  # O_EXCL: never through a link
                written.append(pending)
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        files.fsync_dir(run_dir)
        # From here on the new checkpoint is the one: the journal is the commit point.
        files.write_text_atomic(run_dir / JOURNAL_FILE, json.dumps(sorted(contents)))
    except OSError as error:  # a full disk, a read-only mount: nothing was committed
        for pending in written:
            with contextlib.suppress(OSError):
                pending.unlink()
        raise CheckpointError(f"cannot save a checkpoint in {run_dir} ({error}); the previous "
                              f"checkpoint there is kept") from None
    try:
        _roll_forward(run_dir, sorted(contents))
    except OSError as error:
        raise CheckpointError(f"saved a checkpoint in {run_dir} but could not move all its "
                              f"files into place ({error}); it is complete, and the next "
                              f"`train --resume` finishes the move") from None


def check_recoverable(run_dir: Path) -> None:
    """Raise unless `recover_interrupted_commit` can do its work: what a journal names is a
    regular file, and no own pending name is a directory. Checked before a writer takes the
    lock, so that a refusal leaves the directory as it was."""
    journal = read_journal(run_dir) or []
    for name in CHECKPOINT_FILES:
        pending = run_dir / (name + PENDING_SUFFIX)
        kind = files.entry_kind(pending)
        if name in journal and kind not in ("missing", "file"):
            # glassgpt writes regular files only: this one was planted
            raise CheckpointError(f"{pending} is {files.KIND_PHRASES[kind]}, not a file "
                                  f"glassgpt wrote, and glassgpt never follows links in a run "
                                  f"directory: remove it (and {run_dir / JOURNAL_FILE}) and "
                                  f"resume again")
        if kind not in ("missing", "file", "link"):
            raise CheckpointError(f"{pending} is {files.KIND_PHRASES[kind]}, where glassgpt "
                                  f"keeps a file of its own; move it away (glassgpt does not "
                                  f"delete it)")


def recover_interrupted_commit(run_dir: Path) -> None:
    """Finish a commit a crash cut short, then drop what an uncommitted one left behind.

    Writers only, under the lock. Touches glassgpt's own names only; a planted link among
    them is removed as a link (never followed), unless the journal names it: then nothing
    happens and the user is told.
    """
    check_recoverable(run_dir)
    journal = read_journal(run_dir)
    if journal is not None:
        _roll_forward(run_dir, journal)
    for name in PENDING_FILES:
        files.remove_file_or_link(run_dir / name, CheckpointError)
    for entry in os.listdir(run_dir):
        if _OWN_TEMP.fullmatch(entry):
            files.remove_file_or_link(run_dir / entry, CheckpointError)


def _roll_forward(run_dir: Path, names: list[str]) -> None:
    for name in names:
        pending = run_dir / (name + PENDING_SUFFIX)
        if files.entry_kind(pending) == "file":  # missing when renamed before a crash
            os.replace(pending, run_dir / name)
    files.fsync_dir(run_dir)
    files.remove_file(run_dir / JOURNAL_FILE)
    files.fsync_dir(run_dir)


# --- the one writer of a run -------------------------------------------------------------------

@contextlib.contextmanager
def writing(run_dir: Path) -> Iterator[None]:
    """Create `run_dir` if needed and hold its lock while the block writes the run."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"cannot create {run_dir} ({error})") from None
    with files.locked_directory(run_dir, CheckpointError):
        yield


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


def replace_run(run_dir: Path, force: bool) -> None:
    """Under the lock: check again (another process may have written meanwhile), then remove
    the old run's own files, links as links; the directory's other files stay."""
    if own_files_present(run_dir) and not force:
        raise CheckpointError(f"{run_dir} already holds a run; continue it with --resume or "
                              f"overwrite it with --force")
    _remove_run(run_dir)


def continue_run(run_dir: Path, validated: dict[str, tuple[int, int, int] | None]) -> None:
    """Under the lock: the run must be the one that was checked (its `fingerprint` then),
    and an interrupted commit is finished (or its leftovers dropped) before the next."""
    if fingerprint(run_dir) != validated:
        raise CheckpointError(f"{run_dir} changed while it was being checked (another glassgpt "
                              f"process?); run the command again")
    recover_interrupted_commit(run_dir)


def own_files_present(run_dir: Path) -> list[str]:
    """The run's own names that exist in `run_dir` (a link counts, even a dangling one)."""
    return [name for name in RUN_FILES if files.entry_kind(run_dir / name) != "missing"]


def check_replaceable(run_dir: Path) -> None:
    """Raise unless `replace_run` can remove every own file (none is a directory)."""
    for name in own_files_present(run_dir):
        kind = files.entry_kind(run_dir / name)
        if kind not in ("file", "link"):
            raise CheckpointError(f"{run_dir / name} is {files.KIND_PHRASES[kind]}, where "
                                  f"glassgpt keeps a file of its own; move it away (glassgpt "
                                  f"does not delete it)")


def _remove_run(run_dir: Path) -> None:
    check_replaceable(run_dir)
    for name in own_files_present(run_dir):
        files.remove_file_or_link(run_dir / name, CheckpointError)
    for entry in os.listdir(run_dir):
        if _OWN_TEMP.fullmatch(entry):
            files.remove_file_or_link(run_dir / entry, CheckpointError)
    files.fsync_dir(run_dir)


def check_not_a_data_dir(run_dir: Path) -> None:
    """Refuse a prepared data directory as a run directory: training would mix the two and
    `--force` would delete its tokenizer."""
    found = [name for name in DATA_FILES if files.entry_kind(run_dir / name) != "missing"]
    if found:
        raise CheckpointError(f"{run_dir} is a prepared data directory (it holds "
                              f"{', '.join(found)}), not a run directory; give --out another "
                              f"directory")
