"""Where a command may write an output file: a picture, a JSON report (`attention --out`,
`demo --json`, `bench --json`, `bench ladder --plot`).

One check for every output flag, made before the work that produces the file: a file that is
already there was not made by this command, so it is replaced only with `--force`; and a file
that a run or data directory keeps is never an output, whatever the flags (a picture written
over `RUN/model.safetensors` would lose the weights).
"""

from __future__ import annotations

import os
from pathlib import Path

from glassgpt.storage.files import KIND_PHRASES, ErrorType, check_can_write_file, entry_kind
from glassgpt.storage.layout import DATA, DATA_MARKERS, LOCK_FILE, RUN, RUN_MARKERS

# The names a run or a data directory changes only through its own commits.
_OWN_NAMES = {"run": ({*RUN.own_files, LOCK_FILE}, RUN_MARKERS),
              "data": ({*DATA.own_files, LOCK_FILE}, DATA_MARKERS)}


def check_output_file(path: str | Path, force: bool, error: ErrorType) -> Path:
    """Raise unless a command may write an output file (a picture, a JSON report) at `path`;
    the one check of every output flag, made before the work that produces the file.

    A place `check_can_write_file` accepts; never a file a run or data directory keeps (its
    weights, its ids, its lock: those change only through their commits), even with `force`;
    and a file that is already there, which this command did not make, only with `force`.
    """
    path = check_can_write_file(path, error)
    owner = keeping_directory(path)
    if owner is not None:
        raise error(f"{path} is one of the files of the {owner} directory {path.parent}, "
                    f"which only its own commits change; write the output elsewhere")
    kind = entry_kind(path)
    if kind not in ("missing", "file"):
        raise error(f"{path} is {KIND_PHRASES[kind]}; give the name of a file")
    if kind == "file" and not force:
        raise error(f"{path} already exists; pass --force to replace it, or give another name")
    return path


def keeping_directory(path: Path) -> str | None:
    """'run' or 'data' when `path` is one of the files such a directory keeps: its name is
    one of the kind's own and its directory holds another of the kind's marker files."""
    for kind, (names, markers) in _OWN_NAMES.items():
        if path.name in names and any(os.path.lexists(path.parent / marker)
                                      for marker in markers if marker != path.name):
            return kind
    return None
