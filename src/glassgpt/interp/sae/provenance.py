"""Which run a dictionary was trained on, and the check that it is used on that run.

A dictionary glassgpt trains on a run records, in cfg.json's metadata, SAELens's `model_name`
(the run directory) and two fields of glassgpt's own: `glassgpt_run`, the run directory's
absolute path, and `glassgpt_weights_sha256`, the sha256 of the weights file it read. Such a
dictionary fits a run that is that directory (whose weights may have trained on since) or that
holds those very weights (the run copied, moved, or on another machine); on any other run it
reads activations of another model, and is refused by name. A dictionary without these fields
(SAELens's, circuit-tracer's, one built in code) says nothing of where it came from, and is not
checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from glassgpt.data import sha256_of
from glassgpt.errors import InputError
from glassgpt.interp.sae.config import TRAINED_ON_RUN, TRAINED_ON_WEIGHTS
from glassgpt.interp.sae.model import SAE
from glassgpt.rundir import checkpoint as ckpt


def run_record(run: ckpt.Run, checkpoint: str = "best") -> dict[str, str]:
    """What a dictionary trained on the `checkpoint` weights of `run` records of it."""
    _, weights = run.weights_file(checkpoint)
    directory = str(run.dir.resolve())
    return {"model_name": directory, TRAINED_ON_RUN: directory,
            TRAINED_ON_WEIGHTS: sha256_of(weights)}


def trained_elsewhere(recorded: Mapping[str, Any], run_dir: str | Path,
                      weights_sha256: Callable[[], str | None]) -> bool:
    """Whether the metadata `recorded` says its dictionary was trained on another run than
    `run_dir`: neither that directory nor its weights (`weights_sha256()`, asked only when the
    directories differ). False when it records no run."""
    if recorded.get(TRAINED_ON_RUN) is None:
        return False
    if Path(recorded[TRAINED_ON_RUN]) == Path(run_dir).resolve():
        return False
    sha256 = recorded.get(TRAINED_ON_WEIGHTS)
    return sha256 is None or sha256 != weights_sha256()


def check_trained_on(dictionaries: Iterable[tuple[str, SAE | Mapping[str, Any]]],
                     run_dir: str | Path | ckpt.Run, checkpoint: str = "best",
                     hint: str = "") -> None:
    """Each (name, dictionary or its cfg metadata) fits the `checkpoint` weights of the run
    `run_dir` (see the module docstring), or InputError naming the first that does not, the
    run it was trained on, and `hint` (what to do instead)."""
    run = ckpt.open_run(run_dir)

    @cache
    def weights_sha256() -> str:
        return sha256_of(run.weights_file(checkpoint)[1])

    for name, dictionary in dictionaries:
        recorded = dictionary.cfg.metadata if isinstance(dictionary, SAE) else dictionary
        if trained_elsewhere(recorded, run.dir, weights_sha256):
            raise InputError(f"{name} was trained on the model of "
                             f"{recorded[TRAINED_ON_RUN]}, not of {run.dir.resolve()} "
                             f"(another directory, other weights){'; ' + hint if hint else ''}")
