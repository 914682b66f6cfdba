"""Training sparse dictionaries (SAELens's SAEs and transcoders) on a glassgpt model's hook
points: `train_dictionary` (a run and its data) or `DictionaryTrainer` (any activation source),
with `DictionarySettings`. See docs/interpretability.md, "Dictionaries"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from glassgpt.interp.core.lazyface import lazy_names

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


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
