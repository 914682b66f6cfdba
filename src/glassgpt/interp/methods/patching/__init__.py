"""Activation patching, with TransformerLens 4.3's function names and signatures: this module
is `transformer_lens.patching`'s counterpart (one import changed runs ARENA's patching code).

Run the corrupted prompt, and at one place (a layer and a position, a layer and a head, ...)
put back the activation the clean prompt had there; the metric of the patched logits says how
much of the clean answer that one place carries. `normalized_logit_diff` is the usual metric:
0 where the patched run answers like the corrupted one, 1 where it answers like the clean one.

    clean_logits, clean_cache = run_with_cache(model, clean_ids)
    corrupted_logits, _ = run_with_cache(model, corrupted_ids, names=[])
    metric = normalized_logit_diff(clean_logits, corrupted_logits, answer, wrong)
    get_act_patch_resid_pre(model, corrupted_ids, clean_cache, metric)  # (L, T)

Where each part lives: one sweep and the functions fixing its arguments in `.sweep`, the
metric's reduce modes and `PatchingResult` in `.result`, the stacked *_every functions in
`.every`, direct path patching in `.direct`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glassgpt.errors import InputError
from glassgpt.interp.core import checks
from glassgpt.interp.methods.patching.direct import (
    get_act_patch_direct_path,
    get_act_patch_direct_path_all_sources,
)
from glassgpt.interp.methods.patching.every import (
    get_act_patch_attn_head_all_pos_every,
    get_act_patch_attn_head_by_pos_every,
    get_act_patch_block_every,
)
from glassgpt.interp.methods.patching.result import (
    REDUCE_MODES,
    Metric,
    PatchingResult,
    metric_value,
)
from glassgpt.interp.methods.patching.sweep import (
    Progress,
    Setter,
    generic_activation_patch,
    get_act_patch_attn_head_k_all_pos,
    get_act_patch_attn_head_k_by_pos,
    get_act_patch_attn_head_out_all_pos,
    get_act_patch_attn_head_out_by_pos,
    get_act_patch_attn_head_pattern_all_pos,
    get_act_patch_attn_head_pattern_by_pos,
    get_act_patch_attn_head_pattern_dest_src_pos,
    get_act_patch_attn_head_q_all_pos,
    get_act_patch_attn_head_q_by_pos,
    get_act_patch_attn_head_v_all_pos,
    get_act_patch_attn_head_v_by_pos,
    get_act_patch_attn_out,
    get_act_patch_mlp_out,
    get_act_patch_resid_mid,
    get_act_patch_resid_pre,
    layer_head_dest_src_pos_pattern_setter,
    layer_head_pattern_setter,
    layer_head_pos_pattern_setter,
    layer_head_vector_setter,
    layer_pos_head_vector_setter,
    layer_pos_setter,
)

__all__ = [
    "REDUCE_MODES", "Metric", "PatchingResult", "Progress", "Setter",
    "check_logits_and_tokens", "generic_activation_patch",
    "get_act_patch_attn_head_all_pos_every", "get_act_patch_attn_head_by_pos_every",
    "get_act_patch_attn_head_k_all_pos", "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_out_all_pos", "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_attn_head_pattern_all_pos", "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_pattern_dest_src_pos", "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_q_by_pos", "get_act_patch_attn_head_v_all_pos",
    "get_act_patch_attn_head_v_by_pos", "get_act_patch_attn_out", "get_act_patch_block_every",
    "get_act_patch_direct_path", "get_act_patch_direct_path_all_sources",
    "get_act_patch_mlp_out", "get_act_patch_resid_mid", "get_act_patch_resid_pre",
    "layer_head_dest_src_pos_pattern_setter", "layer_head_pattern_setter",
    "layer_head_pos_pattern_setter", "layer_head_vector_setter", "layer_pos_head_vector_setter",
    "layer_pos_setter", "logit_diff", "metric_value", "normalized_logit_diff",
]


def logit_diff(logits: Tensor, answer: int, wrong: int, pos: int = -1) -> Tensor:
    """logit(answer) - logit(wrong) at position `pos`, averaged over the batch."""
    return (logits[:, pos, answer] - logits[:, pos, wrong]).mean()


def check_logits_and_tokens(clean_logits: object, corrupted_logits: object, answer: object,
                            wrong: object, pos: object) -> None:
    """Both runs' logits (B, T, V) of one vocabulary; answer and wrong token ids in it; pos a
    position of the prompt."""
    for name, logits in (("clean_logits", clean_logits), ("corrupted_logits", corrupted_logits)):
        if not isinstance(logits, Tensor) or logits.dim() != 3 or not logits.is_floating_point():
            got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise InputError(f"{name} must be a float tensor (batch, pos, vocab), got {got}")
    if clean_logits.shape[-1] != corrupted_logits.shape[-1]:
        raise InputError(f"the clean and corrupted logits have vocabularies of "
                         f"{clean_logits.shape[-1]} and {corrupted_logits.shape[-1]}")
    checks.token_id("answer", answer, clean_logits.shape[-1])
    checks.token_id("wrong", wrong, clean_logits.shape[-1])
    checks.position("pos", pos, min(clean_logits.shape[1], corrupted_logits.shape[1]))


def normalized_logit_diff(clean_logits: Tensor, corrupted_logits: Tensor, answer: int,
                          wrong: int, pos: int = -1) -> Metric:
    """A metric: 0 for the corrupted run's logit difference, 1 for the clean run's."""
    check_logits_and_tokens(clean_logits, corrupted_logits, answer, wrong, pos)
    clean = logit_diff(clean_logits, answer, wrong, pos)
    corrupted = logit_diff(corrupted_logits, answer, wrong, pos)
    if torch.isclose(clean, corrupted):
        raise InputError(f"the clean and corrupted prompts give the same logit difference "
                         f"({clean.item():.4g}) between tokens {answer} and {wrong}: nothing to "
                         "recover; choose prompts or answers that differ")

    def metric(logits: Tensor) -> Tensor:
        return (logit_diff(logits, answer, wrong, pos) - corrupted) / (clean - corrupted)
    return metric
