"""Training sparse dictionaries (SAELens's SAEs and transcoders) on a glassgpt model's hook
points: `train_dictionary` (a run and its data) or `DictionaryTrainer` (any activation source),
with `DictionarySettings`. See docs/interpretability.md, "Dictionaries"."""

from glassgpt.interp.sae.training.run import train_dictionary
from glassgpt.interp.sae.training.settings import ARCHITECTURES, DictionarySettings
from glassgpt.interp.sae.training.trainer import DictionaryResult, DictionaryTrainer

__all__ = ["ARCHITECTURES", "DictionaryResult", "DictionarySettings", "DictionaryTrainer",
           "train_dictionary"]
