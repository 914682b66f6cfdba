"""The arguments of `train_run`, checked before anything is read or written, and how its
messages name them.

A library caller writes `resume=True` and `train={"lr": 1e-3}`; `glassgpt train` writes
`--resume` and `--lr 1e-3`. The same mistake is told in the caller's words: `spelling` gives the
function that names a setting either way (`glassgpt train` asks for "cli").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glassgpt.config import TrainConfig, check_choice
from glassgpt.errors import ConfigError
from glassgpt.machine.threadsetting import AUTO, parse_threads
from glassgpt.rundir.directory import as_flag  # `--max-iters`, `--optimizer muon`
from glassgpt.storage.layout import checkpoint_step

Spell = Callable[..., str]  # (name, value=None) -> "--name value" or "name=value"
WORDINGS = ("api", "cli")
BOOLEAN_ARGUMENTS = ("resume", "force")  # train_run's switches: resume=True, --resume
PATH_ARGUMENTS = ("out", "data", "config", "init_from")
REPORTER_METHODS = ("start", "log", "eval", "stop")
MUON_SETTINGS = ("muon_lr", "muon_momentum", "muon_weight_decay")  # read by Muon only


def as_argument(name: str, value: Any = None) -> str:
    """`resume=True`, `out`, `optimizer='muon'`: how a train_run caller writes it."""
    if value is not None:
        return f"{name}={value!r}"
    return f"{name}=True" if name in BOOLEAN_ARGUMENTS else name


def spelling(wording: str) -> Spell:
    check_choice("wording", wording, WORDINGS)
    return as_flag if wording == "cli" else as_argument


def check_arguments(values: dict[str, Any]) -> None:
    """Refuse, by name, an argument of train_run of the wrong kind (a path that is a number,
    `threads=0`, `reporter=42`, `stop="yes"`), so that no bad one fails halfway through a run."""
    for name in PATH_ARGUMENTS:
        value = values[name]
        if value is not None and not isinstance(value, str | os.PathLike):
            raise ConfigError(f"{name} must be a path (str or Path), got {value!r:.80}")
    for name in BOOLEAN_ARGUMENTS:
        if not isinstance(values[name], bool):
            raise ConfigError(f"{name} must be True or False, got {values[name]!r:.80}")
    for name in ("model", "train"):
        if values[name] is not None and not isinstance(values[name], dict):
            raise ConfigError(f"{name} must be a dict of settings by name, got "
                              f"{values[name]!r:.80}")
    if values["preset"] is not None and not isinstance(values["preset"], str):
        raise ConfigError(f"preset must be a preset's name, got {values['preset']!r:.80}")
    try:
        checkpoint_step(values["checkpoint"])  # "best", "last" or a snapshot's "step:N"
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_threads(values["threads"])
    _check_callbacks(values["reporter"], values["stop"], values["on_start"])
    if "vocab_size" in (values["model"] or {}):
        raise ConfigError("vocab_size is decided by the data's tokenizer, not by a setting: "
                          "drop it from model (prepare the data with the tokenizer you want)")


def check_threads(threads: Any) -> None:
    """None, "auto", or a thread count this machine can run (see machine.threadsetting)."""
    if threads is None or threads == AUTO:
        return
    if not isinstance(threads, int) or isinstance(threads, bool):
        raise ConfigError(f"threads must be a positive integer, 'auto' or None, got "
                          f"{threads!r:.80}")
    parse_threads(threads)


def _check_callbacks(reporter: Any, stop: Any, on_start: Any) -> None:
    if reporter is not None:
        missing = [m for m in REPORTER_METHODS if not callable(getattr(reporter, m, None))]
        if missing:
            raise ConfigError(f"reporter must have the methods {list(REPORTER_METHODS)} "
                              f"(a glassgpt.training.metrics.Reporter); {reporter!r:.60} lacks "
                              f"{missing}")
    if stop is not None and not isinstance(stop, threading.Event):
        raise ConfigError(f"stop must be a threading.Event (or None), got {stop!r:.80}")
    if on_start is not None and not callable(on_start):
        raise ConfigError(f"on_start must be callable (or None), got {on_start!r:.80}")


def check_optimizer_settings(cfg: TrainConfig, given: dict[str, Any], spell: Spell) -> None:
    """Muon's own settings, given for a run whose optimizer is AdamW, would be ignored
    without a word: refuse them. `given` is what the user set (config file, then flags)."""
    if cfg.optimizer == "muon":
        return
    ignored = [name for name in MUON_SETTINGS if name in given]
    if ignored:
        raise ConfigError(f"{spell(ignored[0])} is a setting of the Muon optimizer, but this "
                          f"run's optimizer is {cfg.optimizer}, which would ignore it: add "
                          f"{spell('optimizer', 'muon')}, or drop {spell(ignored[0])}")


def user_train_settings(config_file: str | Path | None, train: dict[str, Any],
                        read_config_file: Callable[[str | Path], dict]) -> dict[str, Any]:
    """The training settings the user gave: the config file's [train] table, then `train`."""
    from_file = read_config_file(config_file).get("train", {}) if config_file else {}
    return {**from_file, **train}
