"""Asking a model *why*: hook points read and replaced, activation patching, direct logit
attribution and head scores, with TransformerLens's names, on any glassgpt model (imported
Hugging Face models included).

    from glassgpt.interp import run_with_cache, run_with_hooks
    logits, cache = run_with_cache(model, ids)            # cache["blocks.0.attn.hook_pattern"]
    run_with_hooks(model, ids, [("blocks.0.attn.hook_z", ablate_head_1)])

`HookedGPT` is a glassgpt model with TransformerLens's face (`model.run_with_cache(text)`,
`model.W_Q`, `hook.ctx`, ...), on which TransformerLens's and ARENA's code runs unchanged:
`from glassgpt.interp import ActivationCache, FactoredMatrix, HookPoint, HookedGPT, utils` is
the one line such code changes (`utils.get_act_name`, `utils.to_numpy`).
`glassgpt.interp.patching` holds the patching functions, `.attribution` the logit attribution
and `.scores` the previous-token, duplicate-token and induction scores.
"""

from glassgpt.hooks import HookPoint
from glassgpt.interp.cache import ActivationCache
from glassgpt.interp.factored import FactoredMatrix
from glassgpt.interp.hooked import (
    hook_points,
    run_with_cache,
    run_with_hooks,
    zero_heads,
)
from glassgpt.interp.hooked_gpt import HookedGPT

__all__ = ["ActivationCache", "FactoredMatrix", "HookPoint", "HookedGPT", "hook_points",
           "run_with_cache", "run_with_hooks", "zero_heads"]
