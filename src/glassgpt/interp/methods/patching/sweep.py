"""One patching sweep: `generic_activation_patch` and the functions that fix its arguments.

For every index over the swept axes (layer first: (layer, pos), (layer, head), ...) the
corrupted prompt runs with one slice of one activation put back from the clean cache (the
setter says which slice), and the metric of that run's logits is kept. The functions below are
TransformerLens 4.3's of the same names, with their axes and shapes;
`glassgpt.interp.methods.patching` gathers them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core.cache import cached
from glassgpt.interp.core.hooked import check_run_ids, hook_points, run_with_hooks
from glassgpt.interp.core.utils import get_act_name
from glassgpt.interp.methods.patching.result import Metric, Metrics, PatchingResult

Progress = Callable[[int, int], None]
Setter = Callable[[Tensor, tuple[int, ...], Tensor], Tensor]

AXES = ("layer", "pos", "head_index", "head", "src_pos", "dest_pos")


def check_patchable(model: nn.Module, activation: str) -> None:
    """The model has `activation` to patch (an attention-only block has no MLP, so no
    mlp_out): refused by name before any run, not as a cache miss midway."""
    name = get_act_name(activation, 0)
    if name not in hook_points(model):
        raise InputError(f"this model has no hook point {name}, so {activation!r} cannot be "
                         "patched (an attention-only model has no MLP)")


# --- where a patch goes: index = (layer, ...) ---------------------------------------------------

def layer_pos_setter(corrupted: Tensor, index: tuple[int, ...], clean: Tensor) -> Tensor:
    """(batch, pos, ...) activations: position `pos` from the clean run."""
    _, pos = index
    corrupted[:, pos] = clean[:, pos]
    return corrupted


def layer_head_vector_setter(corrupted: Tensor, index: tuple[int, ...], clean: Tensor) -> Tensor:
    """(batch, pos, head, d_head) activations: head `head` at every position."""
    _, head = index
    corrupted[:, :, head] = clean[:, :, head]
    return corrupted


def layer_pos_head_vector_setter(corrupted: Tensor, index: tuple[int, ...],
                                 clean: Tensor) -> Tensor:
    """(batch, pos, head, d_head) activations: head `head` at position `pos`."""
    _, pos, head = index
    corrupted[:, pos, head] = clean[:, pos, head]
    return corrupted


def layer_head_pattern_setter(corrupted: Tensor, index: tuple[int, ...], clean: Tensor) -> Tensor:
    """(batch, head, query, key) patterns: head `head`'s whole pattern."""
    _, head = index
    corrupted[:, head] = clean[:, head]
    return corrupted


def layer_head_pos_pattern_setter(corrupted: Tensor, index: tuple[int, ...],
                                  clean: Tensor) -> Tensor:
    """(batch, head, query, key) patterns: head `head`'s row of query `dest_pos`."""
    _, head, dest_pos = index
    corrupted[:, head, dest_pos] = clean[:, head, dest_pos]
    return corrupted


def layer_head_dest_src_pos_pattern_setter(corrupted: Tensor, index: tuple[int, ...],
                                           clean: Tensor) -> Tensor:
    """(batch, head, query, key) patterns: one weight, query `dest_pos` on key `src_pos`.
    The row no longer sums to 1: the patch is of that one number, as TransformerLens's."""
    _, head, dest_pos, src_pos = index
    corrupted[:, head, dest_pos, src_pos] = clean[:, head, dest_pos, src_pos]
    return corrupted


# --- the sweep ----------------------------------------------------------------------------------

def sweep_shape(model: nn.Module, activation: str, axes: object, n_pos: int) -> tuple[int, ...]:
    """The size of each swept axis: layers, positions, heads (a K/V sweep: the K/V heads)."""
    if isinstance(axes, str) or not isinstance(axes, Sequence) or not axes \
            or axes[0] != "layer" or not all(axis in AXES for axis in axes):
        raise InputError(f"index_axis_names must name the swept axes, 'layer' first, from "
                         f"{', '.join(AXES)}; got {axes!r:.60}")
    attn = model.blocks[0].attn
    heads = attn.n_kv_head if activation in ("k", "v") else attn.n_heads
    sizes = {"layer": model.config.n_layer, "pos": n_pos, "src_pos": n_pos, "dest_pos": n_pos,
             "head": heads, "head_index": heads}
    return tuple(sizes[axis] for axis in axes)


def refuse_index_df(index_df: object, return_index_df: object) -> None:
    if index_df is not None or return_index_df is not False:
        raise InputError("index_df and return_index_df are not offered: they are pandas "
                         "DataFrames and glassgpt does not depend on pandas; sweep whole axes "
                         "with index_axis_names (the index of a cell is its place in the map)")


def generic_activation_patch(model: nn.Module, corrupted_tokens: Tensor,
                             clean_cache: Mapping[str, Tensor],
                             patching_metric: Metric | Mapping[str, Metric],
                             patch_setter: Setter, activation_name: str,
                             index_axis_names: Sequence[str] | None = None,
                             index_df: object = None, return_index_df: bool = False, *,
                             reduce: str = "scalar", baseline: bool = False,
                             progress: Progress | None = None) -> Tensor | PatchingResult:
    """The patching metric for every index over `index_axis_names` (layer first): a tensor
    with one axis per name (e.g. (L, T) for ("layer", "pos")). `progress(done, total)` is
    called after each patched run (one forward pass each: a caller can show how far it is).
    `reduce`, `baseline` and a mapping of metrics are TransformerLens 4.x's
    (glassgpt.interp.methods.patching.result): with reduce="none", baseline=True or a mapping the
    answer is a PatchingResult.

    The clean cache must come from a prompt of the corrupted one's batch and length (and from
    this model's shape): each activation is put back where the same one stood, so a cache of
    8 tokens patched into 6, or a batch of 1 spread over 2, is refused naming both shapes."""
    hook_points(model)
    check_run_ids(corrupted_tokens)
    refuse_index_df(index_df, return_index_df)
    metrics = Metrics(patching_metric, reduce, baseline, corrupted_tokens.shape[0])
    check_patchable(model, activation_name)
    shape = sweep_shape(model, activation_name, index_axis_names, corrupted_tokens.shape[-1])
    store = torch.zeros(metrics.store_shape(shape))  # [metric, *shape, batch?]
    unpatched = None
    if baseline:
        with torch.no_grad():
            unpatched = metrics.measure(run_with_hooks(model, corrupted_tokens), "the baseline")
    total = math.prod(shape)
    for done, index in enumerate(itertools.product(*(range(n) for n in shape))):
        logits = patched_run(model, corrupted_tokens, clean_cache, patch_setter,
                             get_act_name(activation_name, index[0]), index)
        store[(slice(None), *index)] = metrics.measure(logits, index)
        if progress is not None:
            progress(done + 1, total)
    return metrics.result(store, index_axis_names, unpatched)


def patched_run(model: nn.Module, corrupted_tokens: Tensor, clean_cache: Mapping[str, Tensor],
                patch_setter: Setter, name: str, index: tuple[int, ...]) -> Tensor:
    """The logits of the corrupted run with the setter's slice of `name` from the clean cache."""
    clean = cached(clean_cache, name)

    def patch(corrupted: Tensor, _name: str) -> Tensor:
        check_same_run_shape(clean, corrupted, _name)
        patched = corrupted.clone()
        replaced = patch_setter(patched, index, clean)
        # a setter that edits in place and returns None (TransformerLens's hooks may) patched
        # the copy: that copy is the patch, not the untouched corrupted activation
        return patched if replaced is None else replaced

    with torch.no_grad():
        return run_with_hooks(model, corrupted_tokens, [(name, patch)])


def check_same_run_shape(clean: Tensor, corrupted: Tensor, name: str) -> None:
    if not isinstance(clean, Tensor) or clean.shape != corrupted.shape:
        got = tuple(clean.shape) if isinstance(clean, Tensor) else type(clean).__name__
        raise InputError(f"the clean cache's {name} is {got} but the corrupted run's is "
                         f"{tuple(corrupted.shape)}: patching needs a clean prompt of the "
                         "corrupted one's batch and length, run through this model")


def _patcher(setter: Setter, activation: str, axes: tuple[str, ...]) -> Callable[..., Tensor]:
    return partial(generic_activation_patch, patch_setter=setter, activation_name=activation,
                   index_axis_names=axes)


# Each: (model, corrupted_tokens, clean_cache, patching_metric) -> the map over its axes.
# k and v sweep the K/V heads (n_kv_head of them with grouped K/V heads), as TransformerLens.
get_act_patch_resid_pre = _patcher(layer_pos_setter, "resid_pre", ("layer", "pos"))
get_act_patch_resid_mid = _patcher(layer_pos_setter, "resid_mid", ("layer", "pos"))
get_act_patch_attn_out = _patcher(layer_pos_setter, "attn_out", ("layer", "pos"))
get_act_patch_mlp_out = _patcher(layer_pos_setter, "mlp_out", ("layer", "pos"))
get_act_patch_attn_head_out_all_pos = _patcher(layer_head_vector_setter, "z", ("layer", "head"))
get_act_patch_attn_head_q_all_pos = _patcher(layer_head_vector_setter, "q", ("layer", "head"))
get_act_patch_attn_head_k_all_pos = _patcher(layer_head_vector_setter, "k", ("layer", "head"))
get_act_patch_attn_head_v_all_pos = _patcher(layer_head_vector_setter, "v", ("layer", "head"))
get_act_patch_attn_head_pattern_all_pos = _patcher(layer_head_pattern_setter, "pattern",
                                                   ("layer", "head_index"))
BY_POS = ("layer", "pos", "head")
get_act_patch_attn_head_out_by_pos = _patcher(layer_pos_head_vector_setter, "z", BY_POS)
get_act_patch_attn_head_q_by_pos = _patcher(layer_pos_head_vector_setter, "q", BY_POS)
get_act_patch_attn_head_k_by_pos = _patcher(layer_pos_head_vector_setter, "k", BY_POS)
get_act_patch_attn_head_v_by_pos = _patcher(layer_pos_head_vector_setter, "v", BY_POS)
# A pattern's axes are (layer, head, dest_pos[, src_pos]): the pattern's own order.
get_act_patch_attn_head_pattern_by_pos = _patcher(
    layer_head_pos_pattern_setter, "pattern", ("layer", "head_index", "dest_pos"))
get_act_patch_attn_head_pattern_dest_src_pos = _patcher(
    layer_head_dest_src_pos_pattern_setter, "pattern",
    ("layer", "head_index", "dest_pos", "src_pos"))
