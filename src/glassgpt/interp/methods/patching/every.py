"""Several patching sweeps stacked on a leading patch_type axis, TransformerLens's *_every:

    get_act_patch_block_every              (3, L, T)     resid_pre, attn_out, mlp_out
    get_act_patch_attn_head_all_pos_every  (5, L, H)     out (z), q, k, v, pattern
    get_act_patch_attn_head_by_pos_every   (5, L, T, H)  the same, at each position

With grouped K/V heads the k and v sweeps cover n_kv_head heads; their rows are padded with
zeros to H (placeholders, as TransformerLens's). The pattern sweep's (layer, head, dest_pos) is
put in the others' (layer, pos, head) order. `reduce`, `baseline` and a mapping of metrics go
to each sweep (the unpatched baseline runs once); `progress(done, total)` counts every run of
every sweep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core.hooked import check_run_ids, hook_points
from glassgpt.interp.methods.patching import sweep as sweeps
from glassgpt.interp.methods.patching.result import (
    Metric,
    PatchingResult,
    as_result,
    stack_patch_types,
)
from glassgpt.interp.methods.patching.sweep import Progress, sweep_shape

HEAD_TYPES = ("out", "q", "k", "v", "pattern")
BLOCK_TYPES = ("resid_pre", "attn_out", "mlp_out")
Sweep = Callable[..., Tensor | PatchingResult]


def run_sweeps(model: nn.Module, corrupted_tokens: Tensor, clean_cache: Mapping[str, Tensor],
               metric: Metric | Mapping[str, Metric], chosen: Sequence[Sweep], reduce: str,
               baseline: bool, progress: Progress | None) -> list[Tensor | PatchingResult]:
    """Each sweep's answer; the baseline from the first alone (it is the same unpatched run),
    progress counted over all of them."""
    check_run_ids(corrupted_tokens)
    for sweep in chosen:  # every activation is checked before the first run
        sweeps.check_patchable(model, sweep.keywords["activation_name"])
    sizes = [count_runs(model, sweep, corrupted_tokens.shape[-1]) for sweep in chosen]
    answers = []
    for i, sweep in enumerate(chosen):
        counted = None if progress is None else offset_progress(progress, sum(sizes[:i]),
                                                                sum(sizes))
        answers.append(sweep(model, corrupted_tokens, clean_cache, metric, reduce=reduce,
                             baseline=baseline and i == 0, progress=counted))
    return answers


def count_runs(model: nn.Module, sweep: Sweep, n_pos: int) -> int:
    return math.prod(sweep_shape(model, sweep.keywords["activation_name"],
                                 sweep.keywords["index_axis_names"], n_pos))


def offset_progress(progress: Progress, before: int, total: int) -> Progress:
    def report(done: int, _: int) -> None:
        progress(before + done, total)
    return report


def stacked(model: nn.Module, answers: list[Tensor | PatchingResult], chosen: Sequence[Sweep],
            axis_order: tuple[str, ...], type_names: tuple[str, ...]) -> Tensor | PatchingResult:
    """The answers on one patch_type axis: a tensor when every sweep gave one, else a result."""
    results = [as_result(answer, sweep.keywords["index_axis_names"])
               for answer, sweep in zip(answers, chosen, strict=True)]
    together = stack_patch_types(results, axis_order, model.blocks[0].attn.n_heads, type_names)
    if all(isinstance(answer, Tensor) for answer in answers):
        return together.values
    return together


def get_act_patch_block_every(model: nn.Module, corrupted_tokens: Tensor,
                              clean_cache: Mapping[str, Tensor],
                              metric: Metric | Mapping[str, Metric], *, reduce: str = "scalar",
                              baseline: bool = False,
                              progress: Progress | None = None) -> Tensor | PatchingResult:
    """(3, L, T): the residual stream at each block's start, each attention layer's output and
    each MLP's output patched at each position. An attention-only model has no MLP output:
    it is refused before any run (patch resid_pre and attn_out alone), where TransformerLens
    fails midway."""
    if "blocks.0.hook_mlp_out" not in hook_points(model):
        raise InputError("get_act_patch_block_every patches resid_pre, attn_out and mlp_out, "
                         "and this model's blocks have no MLP (attention-only); use "
                         "get_act_patch_resid_pre and get_act_patch_attn_out")
    chosen = (sweeps.get_act_patch_resid_pre, sweeps.get_act_patch_attn_out,
              sweeps.get_act_patch_mlp_out)
    answers = run_sweeps(model, corrupted_tokens, clean_cache, metric, chosen, reduce, baseline,
                         progress)
    return stacked(model, answers, chosen, ("layer", "pos"), BLOCK_TYPES)


def get_act_patch_attn_head_all_pos_every(model: nn.Module, corrupted_tokens: Tensor,
                                          clean_cache: Mapping[str, Tensor],
                                          metric: Metric | Mapping[str, Metric], *,
                                          reduce: str = "scalar", baseline: bool = False,
                                          progress: Progress | None = None,
                                          ) -> Tensor | PatchingResult:
    """(5, L, H): each head's output, query, key, value and pattern patched at every position
    at once."""
    chosen = (sweeps.get_act_patch_attn_head_out_all_pos, sweeps.get_act_patch_attn_head_q_all_pos,
              sweeps.get_act_patch_attn_head_k_all_pos, sweeps.get_act_patch_attn_head_v_all_pos,
              sweeps.get_act_patch_attn_head_pattern_all_pos)
    answers = run_sweeps(model, corrupted_tokens, clean_cache, metric, chosen, reduce, baseline,
                         progress)
    return stacked(model, answers, chosen, ("layer", "head"), HEAD_TYPES)


def get_act_patch_attn_head_by_pos_every(model: nn.Module, corrupted_tokens: Tensor,
                                         clean_cache: Mapping[str, Tensor],
                                         metric: Metric | Mapping[str, Metric], *,
                                         reduce: str = "scalar", baseline: bool = False,
                                         progress: Progress | None = None,
                                         ) -> Tensor | PatchingResult:
    """(5, L, T, H): each head's output, query, key, value and pattern patched at one position
    (the pattern: its row of that query position)."""
    chosen = (sweeps.get_act_patch_attn_head_out_by_pos, sweeps.get_act_patch_attn_head_q_by_pos,
              sweeps.get_act_patch_attn_head_k_by_pos, sweeps.get_act_patch_attn_head_v_by_pos,
              sweeps.get_act_patch_attn_head_pattern_by_pos)
    answers = run_sweeps(model, corrupted_tokens, clean_cache, metric, chosen, reduce, baseline,
                         progress)
    return stacked(model, answers, chosen, ("layer", "pos", "head"), HEAD_TYPES)
