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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from glassgpt.errors import CheckpointError
from glassgpt.storage import commit, files
from glassgpt.storage.layout import (
    CONFIG_FILE,
    DATA_MARKERS,
    RUN,
    RUN_JOURNAL,
    STATE_JSON_FILE,
)

RUN_FORMAT = "glassgpt-run/1"  # config.json's "format": the mark of a run glassgpt wrote
RUN_FORMAT_PREFIX = "glassgpt-run/"
RUN_CONFIG_KEYS = ("format", "model", "train", "data_dir", "tokenizer", "extra")
# The files of the other directories glassgpt writes, none of which may take a run: a run's
# files would land beside them, and --force cannot make them a run's to replace.
OTHER_DIRECTORIES = {
    "a sparse dictionary (SAELens's format)": ("cfg.json", "sae_weights.safetensors",
                                               "sparsity.safetensors"),
    "a peft LoRA adapter": ("adapter_config.json", "adapter_model.safetensors"),
}


def as_flag(name: str, value: Any = None) -> str:
    """How messages name a setting by default: as `glassgpt train`'s flag."""
    flag = "--" + name.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


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


def check_out_dir(run_dir: Path, force: bool, init_from: Path | None = None,
                  spell: Callable[..., str] = as_flag, writer: bool = True) -> None:
    """Refuse, before any work and changing nothing, a directory that cannot take a new run:
    a place no directory can be made, a data directory or another that glassgpt writes (a
    sparse dictionary's, a peft adapter's: OTHER_DIRECTORIES), a run in use, the run `init_from`
    starts from, an existing run without `force`, a planted link without `force`, a directory
    under one of the run's own names, or files under a run's names that glassgpt did not write
    (a Hugging Face model's), even with `force`. `spell` names the settings in messages.
    Only the `writer` asks whether the run is in use: under torchrun the other ranks write
    nothing there, and rank 0 may already hold the lock for this very run."""
    files.check_can_make_dir(run_dir, CheckpointError)
    if not run_dir.is_dir():
        return
    check_not_a_data_dir(run_dir)
    check_not_another_directory(run_dir, spell)
    if writer:
        files.check_unlocked(run_dir, CheckpointError)
    if init_from is not None and init_from.is_dir() and run_dir.samefile(init_from):
        raise CheckpointError(f"{spell('init_from')} and {spell('out')} both name {run_dir}; "
                              f"training would replace the weights it starts from: give "
                              f"another {spell('out')}")
    present = own_files_present(run_dir)
    if present:
        check_written_by_glassgpt(run_dir, present, spell)
    if present and not force:
        links = [name for name in present if files.entry_kind(run_dir / name) == "link"]
        if links:
            raise CheckpointError(f"{run_dir / links[0]} is a symbolic link; glassgpt never "
                                  f"follows links in a run directory: remove it, or replace "
                                  f"the run with {spell('force')}")
        raise CheckpointError(f"{run_dir} already holds a run ({', '.join(present[:3])}); "
                              f"continue it with {spell('resume')} or overwrite it with "
                              f"{spell('force')}")
    check_replaceable(run_dir)


def check_still_free(run_dir: Path, force: bool, spell: Callable[..., str] = as_flag) -> None:
    """Under the lock: check again (another process may have written meanwhile). Nothing is
    removed here: the new run's first commit replaces the old run's files."""
    present = own_files_present(run_dir)
    if present:
        check_written_by_glassgpt(run_dir, present, spell)
    if present and not force:
        raise CheckpointError(f"{run_dir} already holds a run; continue it with "
                              f"{spell('resume')} or overwrite it with {spell('force')}")
    check_replaceable(run_dir)
    recover_interrupted_commit(run_dir)


def is_glassgpt_run(run_dir: Path) -> bool:
    """Whether glassgpt wrote this run, by its own marks, never by file names alone: a commit
    journal or training state, or a config.json of glassgpt's layout (its `format`, or, in runs
    of earlier versions without one, only glassgpt's keys around a `model` table)."""
    if any(files.entry_kind(run_dir / name) == "file" for name in (RUN_JOURNAL, STATE_JSON_FILE)):
        return True
    config = _config_json(run_dir)
    if config is None:
        return False
    run_format = config.get("format")
    if isinstance(run_format, str):
        return run_format.startswith(RUN_FORMAT_PREFIX)
    return (isinstance(config.get("model"), dict) and "model_type" not in config["model"]
            and set(config) <= set(RUN_CONFIG_KEYS))


def _config_json(run_dir: Path) -> dict | None:
    """config.json as a JSON object, or None when it is missing, a link or not JSON."""
    path = run_dir / CONFIG_FILE
    if files.entry_kind(path) != "file":
        return None
    try:
        return files.read_json_object(path, CheckpointError, files.MAX_JSON_BYTES)
    except CheckpointError:
        return None


def check_written_by_glassgpt(run_dir: Path, present: list[str],
                              spell: Callable[..., str] = as_flag) -> None:
    """Refuse a directory holding files under a run's names that are not a glassgpt run's:
    `force` replaces only what glassgpt wrote."""
    if is_glassgpt_run(run_dir):
        return
    config = _config_json(run_dir) or {}
    links = [name for name in present if files.entry_kind(run_dir / name) == "link"]
    if "model_type" in config or "architectures" in config:
        what = (f"a Hugging Face model directory (its {CONFIG_FILE} names model_type "
                f"{config.get('model_type')!r:.40})")
    elif links:
        what = (f"not a glassgpt run ({run_dir / links[0]} is a symbolic link, which glassgpt "
                f"never follows, and no {CONFIG_FILE} of a run is there)")
    else:
        what = (f"not a glassgpt run (it holds {', '.join(present[:3])}, but no {CONFIG_FILE} "
                f"or {STATE_JSON_FILE} that glassgpt wrote)")
    raise CheckpointError(f"{run_dir} is {what}; glassgpt replaces only runs it wrote, even "
                          f"with {spell('force')}: give {spell('out')} another directory")


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


def check_not_another_directory(run_dir: Path, spell: Callable[..., str] = as_flag) -> None:
    """Refuse a directory holding another thing glassgpt writes (OTHER_DIRECTORIES), with or
    without `force`: only a run is replaced by a run."""
    for what, names in OTHER_DIRECTORIES.items():
        found = [name for name in names if files.entry_kind(run_dir / name) != "missing"]
        if found:
            raise CheckpointError(f"{run_dir} holds {what} ({', '.join(found)}), not a run; "
                                  f"glassgpt writes a run only where no such files are, even "
                                  f"with {spell('force')}: give {spell('out')} another "
                                  f"directory")


def check_not_a_data_dir(run_dir: Path) -> None:
    """Refuse a prepared data directory as a run directory: training would mix the two and
    `--force` would delete its tokenizer."""
    found = [name for name in DATA_MARKERS if files.entry_kind(run_dir / name) != "missing"]
    if found:
        raise CheckpointError(f"{run_dir} is a prepared data directory (it holds "
                              f"{', '.join(found)}), not a run directory; give --out another "
                              f"directory")
