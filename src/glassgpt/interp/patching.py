"""Activation patching, with TransformerLens's function names and signatures.

Run the corrupted prompt, and at one place (a layer and a position, a layer and a head, ...)
put back the activation the clean prompt had there; the metric of the patched logits says how
much of the clean answer that one place carries. `normalized_logit_diff` is the usual metric:
0 where the patched run answers like the corrupted one, 1 where it answers like the clean one.

    clean_logits, clean_cache = run_with_cache(model, clean_ids)
    corrupted_logits, _ = run_with_cache(model, corrupted_ids, names=[])
    metric = normalized_logit_diff(clean_logits, corrupted_logits, answer, wrong)
    get_act_patch_resid_pre(model, corrupted_ids, clean_cache, metric)  # (L, T)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp import checks
from glassgpt.interp.cache import cached
from glassgpt.interp.hooked import check_run_ids, hook_points, run_with_hooks

Metric = Callable[[Tensor], Tensor | float]
Progress = Callable[[int, int], None]
Setter = Callable[[Tensor, tuple[int, ...], Tensor], Tensor]

# A short activation name -> its hook point in layer l (TransformerLens's get_act_name).
ACTIVATIONS = {
    "resid_pre": "blocks.{l}.hook_resid_pre",
    "resid_mid": "blocks.{l}.hook_resid_mid",
    "mlp_in": "blocks.{l}.hook_mlp_in",
    "resid_post": "blocks.{l}.hook_resid_post",
    "attn_out": "blocks.{l}.hook_attn_out",
    "mlp_out": "blocks.{l}.hook_mlp_out",
    "q": "blocks.{l}.attn.hook_q",
    "k": "blocks.{l}.attn.hook_k",
    "v": "blocks.{l}.attn.hook_v",
    "z": "blocks.{l}.attn.hook_z",
    "pattern": "blocks.{l}.attn.hook_pattern",
}


def act_name(activation: str, layer: int) -> str:
    """("z", 1) -> "blocks.1.attn.hook_z"."""
    if activation not in ACTIVATIONS:
        raise InputError(f"unknown activation {activation!r}; one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[activation].format(l=layer)


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


def axis_sizes(model: nn.Module, activation: str, n_pos: int) -> dict[str, int]:
    attn = model.blocks[0].attn
    heads = attn.n_kv_head if activation in ("k", "v") else attn.n_heads
    return {"layer": model.config.n_layer, "pos": n_pos, "head": heads, "head_index": heads}


def generic_activation_patch(model: nn.Module, corrupted_tokens: Tensor,
                             clean_cache: Mapping[str, Tensor], patching_metric: Metric,
                             patch_setter: Setter, activation_name: str,
                             index_axis_names: Sequence[str], *,
                             progress: Progress | None = None) -> Tensor:
    """The patching metric for every index over `index_axis_names` (layer first): a tensor
    with one axis per name (e.g. (L, T) for ("layer", "pos")). `progress(done, total)` is
    called after each patched run (one forward pass each: a caller can show how far it is).

    The clean cache must come from a prompt of the corrupted one's batch and length (and from
    this model's shape): each activation is put back where the same one stood, so a cache of
    8 tokens patched into 6, or a batch of 1 spread over 2, is refused naming both shapes."""
    hook_points(model)
    check_run_ids(corrupted_tokens)
    if not callable(patching_metric):
        raise InputError(f"patching_metric must be a function logits -> number, got "
                         f"{type(patching_metric).__name__}")
    sizes = axis_sizes(model, activation_name, corrupted_tokens.shape[-1])
    shape = tuple(sizes[axis] for axis in index_axis_names)
    results = torch.zeros(shape)
    for done, index in enumerate(itertools.product(*(range(n) for n in shape))):
        name = act_name(activation_name, index[0])
        clean = cached(clean_cache, name)

        def patch(corrupted: Tensor, _name: str, index: tuple = index,
                  clean: Tensor = clean) -> Tensor:
            check_same_run_shape(clean, corrupted, _name)
            return patch_setter(corrupted.clone(), index, clean)

        with torch.no_grad():
            logits = run_with_hooks(model, corrupted_tokens, [(name, patch)])
        results[index] = metric_value(patching_metric(logits), index)
        if progress is not None:
            progress(done + 1, results.numel())
    return results


def check_same_run_shape(clean: Tensor, corrupted: Tensor, name: str) -> None:
    if not isinstance(clean, Tensor) or clean.shape != corrupted.shape:
        got = tuple(clean.shape) if isinstance(clean, Tensor) else type(clean).__name__
        raise InputError(f"the clean cache's {name} is {got} but the corrupted run's is "
                         f"{tuple(corrupted.shape)}: patching needs a clean prompt of the "
                         "corrupted one's batch and length, run through this model")


def metric_value(value: object, index: tuple[int, ...]) -> float:
    """A metric's result as one finite float32 number, or InputError naming what came back."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise InputError(f"the patching metric must return one real number, got a "
                             f"{value.dtype} tensor of shape {tuple(value.shape)} at {index}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"the patching metric must return one real number, got "
                         f"{type(value).__name__} at {index}")
    if not abs(value) <= torch.finfo(torch.float32).max:  # NaN fails this too
        raise InputError(f"the patching metric returned {value!r:.20} at {index}: not a finite "
                         "number (the map is float32)")
    return float(value)


def _patcher(setter: Setter, activation: str, axes: tuple[str, ...]) -> Callable[..., Tensor]:
    return partial(generic_activation_patch, patch_setter=setter, activation_name=activation,
                   index_axis_names=axes)


get_act_patch_resid_pre = _patcher(layer_pos_setter, "resid_pre", ("layer", "pos"))
get_act_patch_resid_mid = _patcher(layer_pos_setter, "resid_mid", ("layer", "pos"))
get_act_patch_attn_out = _patcher(layer_pos_setter, "attn_out", ("layer", "pos"))
get_act_patch_mlp_out = _patcher(layer_pos_setter, "mlp_out", ("layer", "pos"))
get_act_patch_attn_head_out_all_pos = _patcher(layer_head_vector_setter, "z", ("layer", "head"))
get_act_patch_attn_head_q_all_pos = _patcher(layer_head_vector_setter, "q", ("layer", "head"))
get_act_patch_attn_head_k_all_pos = _patcher(layer_head_vector_setter, "k", ("layer", "head"))
get_act_patch_attn_head_v_all_pos = _patcher(layer_head_vector_setter, "v", ("layer", "head"))
get_act_patch_attn_head_pattern_all_pos = _patcher(layer_head_pattern_setter, "pattern",
                                                   ("layer", "head"))
get_act_patch_attn_head_out_by_pos = _patcher(layer_pos_head_vector_setter, "z",
                                              ("layer", "pos", "head"))
