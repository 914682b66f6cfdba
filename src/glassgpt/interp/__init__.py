"""Asking a model *why*: hook points read and replaced, activation patching, direct logit
attribution and head scores, with TransformerLens's names, on any glassgpt model (imported
Hugging Face models included).

    from glassgpt.interp import run_with_cache, run_with_hooks
    logits, cache = run_with_cache(model, ids)            # cache["blocks.0.attn.hook_pattern"]
    run_with_hooks(model, ids, [("blocks.0.attn.hook_z", ablate_head_1)])

`HookedGPT` is a glassgpt model with TransformerLens's face (`model.run_with_cache(text)`,
`model.W_Q`, `hook.ctx`, ...), on which TransformerLens's and ARENA's code runs unchanged:
`from glassgpt.interp import ActivationCache, FactoredMatrix, HookPoint, HookedGPT, utils` is
the one line such code changes (`utils.get_act_name`, `utils.to_numpy`; `patching` too).

The package is in rooms by concern: `core/` (the hook API, the cache and the stream's
analysis), `methods/` (the lens, head steps, attribution, patching, scores, steering, diffing),
`hooked_gpt/` (TransformerLens's face), `sae/` (dictionaries) and `graph/` (attribution graphs).
The names below are imported on first use, not with the package, so that a torch-free part
(a dictionary's training settings) imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from glassgpt.interp.core.lazyface import lazy_names

# public name -> the module that defines it
_HOMES = {
    "ActivationCache": "glassgpt.interp.core.cache",
    "FactoredMatrix": "glassgpt.interp.hooked_gpt.factored",
    "HookPoint": "glassgpt.hooks",
    "HookedGPT": "glassgpt.interp.hooked_gpt",
    "hook_points": "glassgpt.interp.core.hooked",
    "run_with_cache": "glassgpt.interp.core.hooked",
    "run_with_hooks": "glassgpt.interp.core.hooked",
    "zero_heads": "glassgpt.interp.core.hooked",
}
# TransformerLens's modules by their names there (`from transformer_lens import patching, utils`)
_MODULES = {
    "patching": "glassgpt.interp.methods.patching",
    "utils": "glassgpt.interp.core.utils",
}

__all__ = ["ActivationCache", "FactoredMatrix", "HookPoint", "HookedGPT", "hook_points",
           "patching", "run_with_cache", "run_with_hooks", "utils", "zero_heads"]

if TYPE_CHECKING:  # what a type checker and an editor see; nothing here runs
    from glassgpt.hooks import HookPoint
    from glassgpt.interp.core import utils
    from glassgpt.interp.core.cache import ActivationCache
    from glassgpt.interp.core.hooked import hook_points, run_with_cache, run_with_hooks, zero_heads
    from glassgpt.interp.hooked_gpt import HookedGPT
    from glassgpt.interp.hooked_gpt.factored import FactoredMatrix
    from glassgpt.interp.methods import patching


__getattr__, __dir__ = lazy_names(__name__, _HOMES, _MODULES)
