"""The trainer state a dictionary's training keeps beside SAELens's files, read without
trusting it:

    trainer_state.json          written_by "glassgpt", step, window_tokens, settings
    trainer_state.safetensors   sae.* (the weights as trained), adam.{i}.{step,exp_avg,
                                exp_avg_sq}, tokens_since_fired, fired, batch_threshold,
                                data_state (the activation source's position)

`read_state` checks the JSON's fields; `read_state_tensors` the names, shapes and dtypes of the
tensors against those of the trainer that resumes, before any is read, and then that they are
finite. A damaged or edited state is one CheckpointError naming what is wrong, never a shape
error or a division by zero steps later.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.interp.sae.training.settings import DictionarySettings
from glassgpt.storage import files
from glassgpt.storage.tensorfile import DTYPES, SafetensorsFile, check_finite

STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"
FLOATS = (torch.float32, torch.float64)  # Adam's step: float64 when that is torch's default
# A tensor the state must hold: its shape and the dtypes it may have.
Expected = tuple[tuple[int, ...], tuple[torch.dtype, ...]]
# Settings added after states were saved without them, at the values those trainings used
# (not today's defaults): a state saved before them resumes as it was trained.
SETTINGS_ADDED = {"normalize_activations": "none", "resample_every": 0}


def read_state(out: Path) -> dict[str, Any]:
    """trainer_state.json of the training in `out`, its counts checked."""
    if files.entry_kind(out / STATE_JSON) == "missing":
        raise CheckpointError(f"{out} holds no glassgpt dictionary training to resume "
                              f"({STATE_JSON} is missing)")
    state = files.read_json_object(out / STATE_JSON, CheckpointError)
    if state.get("written_by") != "glassgpt" or not isinstance(state.get("settings"), dict):
        raise CheckpointError(f"{out / STATE_JSON} is not a glassgpt trainer state")
    for name in ("step", "window_tokens"):
        value = state.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{out / STATE_JSON}: {name} must be a whole number >= 0, "
                                  f"got {value!r:.40}")
    state["settings"] = {**SETTINGS_ADDED, **state["settings"]}
    return state


def saved_settings(out: Path) -> dict[str, Any]:
    """The settings the training in `out` was started with, checked as DictionarySettings
    checks its own (a resume repeats none of them)."""
    settings = read_state(out)["settings"]
    known = {field.name for field in dataclasses.fields(DictionarySettings)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise CheckpointError(f"{out / STATE_JSON}: unknown settings {unknown[:3]}")
    try:
        DictionarySettings(**settings)
    except ConfigError as error:
        raise CheckpointError(f"{out / STATE_JSON}: {error}") from None
    return dict(settings)


def expected_of(tensors: dict[str, Tensor]) -> dict[str, Expected]:
    """The shapes and dtypes of `tensors`, as read_state_tensors expects them."""
    return {name: (tuple(t.shape), (t.dtype,)) for name, t in tensors.items()}


def read_state_tensors(path: Path, expected: dict[str, Expected]) -> dict[str, Tensor]:
    """The tensors of trainer_state.safetensors, which must be exactly `expected` (names,
    shapes, dtypes) and finite."""
    with SafetensorsFile(path, CheckpointError) as file:
        missing = sorted(set(expected) - set(file.header))
        extra = sorted(set(file.header) - set(expected))
        if missing or extra:
            what = f"lacks {', '.join(missing[:3])}" if missing else \
                f"holds {', '.join(extra[:3])}, which this training has not"
            raise CheckpointError(f"{path} {what}: it is not the state of this training")
        for name, (shape, dtypes) in expected.items():
            info = file.header[name]
            if info.shape != shape or DTYPES[info.dtype] not in dtypes:
                want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise CheckpointError(f"{path}: tensor {name} is {info.dtype} of shape "
                                      f"{info.shape}; this training's is {want} of shape "
                                      f"{shape}")
        tensors = {name: file.read(name) for name in expected}
    check_finite(tensors, path, CheckpointError)
    return tensors
