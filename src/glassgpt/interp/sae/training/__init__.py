"""Training sparse dictionaries (SAELens's SAEs and transcoders) on a glassgpt model's hook
points: `train_dictionary` (a run and its data) or `DictionaryTrainer` (any activation source),
with `DictionarySettings`. See docs/interpretability.md, "Dictionaries"."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> its module, imported on first use: the settings import without torch
_HOMES = {
    "ARCHITECTURES": "glassgpt.interp.sae.training.settings",
    "DictionaryResult": "glassgpt.interp.sae.training.trainer",
    "DictionarySettings": "glassgpt.interp.sae.training.settings",
    "DictionaryTrainer": "glassgpt.interp.sae.training.trainer",
    "train_dictionary": "glassgpt.interp.sae.training.run",
}

__all__ = ["ARCHITECTURES", "DictionaryResult", "DictionarySettings", "DictionaryTrainer",
           "train_dictionary"]

if TYPE_CHECKING:  # what a type checker and an editor see; nothing here runs
    from glassgpt.interp.sae.training.run import train_dictionary
    from glassgpt.interp.sae.training.settings import ARCHITECTURES, DictionarySettings
    from glassgpt.interp.sae.training.trainer import DictionaryResult, DictionaryTrainer


def __getattr__(name: str) -> Any:
    """Import a public name's module the first time the name is asked for (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
