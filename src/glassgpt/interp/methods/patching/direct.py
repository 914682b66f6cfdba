"""Direct path patching (Wang et al. 2022), TransformerLens 4.3's get_act_patch_direct_path.

The edge from a source head A to a later head B alone: A's clean-minus-corrupted write to the
residual stream (z_A @ W_O[A], its bias cancelling) is added to the stream B reads, and to
no other reader; every other head and MLP still sees A's corrupted output. TransformerLens
gives each head its own copy of the stream (its split Q/K/V input). The glass model has one
stream a layer, and B's query depends on nothing but that stream at B's layer, so the same
edge takes two runs: one with the write added to B's layer's stream, stopped after that layer,
whose hook_q (or hook_k, hook_v) holds what every head of the layer would compute from the
shifted stream; then the corrupted run with head B's query alone replaced by it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core import checks
from glassgpt.interp.core.cache import cached
from glassgpt.interp.core.hooked import check_run_ids, hook_points, run_with_hooks
from glassgpt.interp.methods.patching.result import Metric, metric_value
from glassgpt.interp.methods.patching.sweep import Progress, check_same_run_shape

COMPONENTS = ("q", "k", "v")


def check_direct_paths(model: nn.Module, component: object) -> None:
    """A head's write reaches the stream as z @ W_O (a Pre-LN block, no norm on the attention's
    output) and, for k and v, each destination K/V head serves one query head."""
    config = model.config
    if not isinstance(component, str) or component not in COMPONENTS:
        raise InputError(f"component must be 'q', 'k' or 'v', got {component!r:.40}")
    if not config.pre_ln or config.post_norms:
        kind = "Post-LN" if not config.pre_ln else "post_norms (a norm on the attention output)"
        raise InputError(f"direct path patching needs a head's write to be z @ W_O added to the "
                         f"stream; this model's blocks are {kind}, so it is not")
    attn = model.blocks[0].attn
    if component != "q" and attn.n_kv_head != attn.n_heads:
        raise InputError(f"component={component!r} needs a K/V head per query head; this model "
                         f"groups them ({attn.n_kv_head} K/V heads for {attn.n_heads} query "
                         "heads), so a path into one head's K/V is undefined; component='q' is")


def head_write(model: nn.Module, cache: Mapping[str, Tensor], layer: int, head: int) -> Tensor:
    """What head `head` of `layer` adds to the stream in the cached run, z_h @ W_O[h]: (B, T, C)."""
    attn = model.blocks[layer].attn
    z = cached(cache, f"blocks.{layer}.attn.hook_z")  # (B, T, H, d)
    if not isinstance(z, Tensor) or z.dim() != 4 or z.shape[2:] != (attn.n_heads, attn.head_dim):
        got = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
        raise InputError(f"the cache's blocks.{layer}.attn.hook_z is {got}, not (batch, pos, "
                         f"{attn.n_heads}, {attn.head_dim}) of this model")
    d = attn.head_dim
    W_O = attn.proj.weight[:, head * d:(head + 1) * d]  # (C, d): head's columns of proj
    return z[:, :, head].to(W_O.dtype) @ W_O.T  # (B, T, d) @ (d, C) -> (B, T, C)


def shifted_inputs(model: nn.Module, corrupted_tokens: Tensor, delta: Tensor, layer: int,
                   component: str) -> Tensor:
    """Layer `layer`'s q (or k, v) of every head, (B, T, heads, d), computed from the corrupted
    run's stream at that layer plus `delta`: the run stops after that layer."""
    kept: dict[str, Tensor] = {}

    def shift(stream: Tensor, name: str) -> Tensor:  # (B, T, C)
        check_same_run_shape(delta, stream, f"{name} + the source head's write (B, T, C)")
        return stream + delta.to(stream.dtype)

    def keep(tensor: Tensor, name: str) -> None:
        kept["input"] = tensor.detach()

    with torch.no_grad():
        run_with_hooks(model, corrupted_tokens,
                       [(f"blocks.{layer}.hook_resid_pre", shift),
                        (f"blocks.{layer}.attn.hook_{component}", keep)],
                       stop_at_layer=layer + 1)
    return kept["input"]


def run_with_head_input(model: nn.Module, corrupted_tokens: Tensor, layer: int, head: int,
                        component: str, shifted: Tensor) -> Tensor:
    """The corrupted run's logits with one head's q (or k, v) taken from `shifted`."""
    def replace(tensor: Tensor, name: str) -> Tensor:  # (B, T, heads, d)
        tensor = tensor.clone()
        tensor[:, :, head] = shifted[:, :, head]
        return tensor

    with torch.no_grad():
        return run_with_hooks(model, corrupted_tokens,
                              [(f"blocks.{layer}.attn.hook_{component}", replace)])


def get_act_patch_direct_path(model: nn.Module, corrupted_tokens: Tensor,
                              clean_cache: Mapping[str, Tensor],
                              corrupted_cache: Mapping[str, Tensor], patching_metric: Metric,
                              src_layer: int, src_head: int, component: str = "q",
                              verbose: bool = True, *,
                              progress: Progress | None = None) -> Tensor:
    """(L, H): [l, h] is the metric with the path from head (src_layer, src_head) into head
    (l, h)'s `component` input patched. Rows l <= src_layer are 0.0 placeholders, not
    measurements. Both caches must hold the source layer's hook_z. `verbose` is
    TransformerLens's progress bar switch: glassgpt prints nothing (`progress` is its hook)."""
    hook_points(model)
    check_run_ids(corrupted_tokens)
    if not callable(patching_metric):
        raise InputError(f"patching_metric must be a function logits -> number, got "
                         f"{type(patching_metric).__name__}")
    L, H = model.config.n_layer, model.blocks[0].attn.n_heads
    src_layer = checks.index("src_layer", src_layer, L)
    src_head = checks.index("src_head", src_head, H)
    check_direct_paths(model, component)
    delta = (head_write(model, clean_cache, src_layer, src_head)
             - head_write(model, corrupted_cache, src_layer, src_head))  # (B, T, C)
    results = torch.zeros(L, H)
    total, done = (L - 1 - src_layer) * H, 0
    for dst_layer in range(src_layer + 1, L):
        shifted = shifted_inputs(model, corrupted_tokens, delta, dst_layer, component)
        for dst_head in range(H):
            logits = run_with_head_input(model, corrupted_tokens, dst_layer, dst_head,
                                         component, shifted)
            results[dst_layer, dst_head] = metric_value(patching_metric(logits),
                                                        (dst_layer, dst_head))
            done += 1
            if progress is not None:
                progress(done, total)
    return results


def get_act_patch_direct_path_all_sources(model: nn.Module, corrupted_tokens: Tensor,
                                          clean_cache: Mapping[str, Tensor],
                                          corrupted_cache: Mapping[str, Tensor],
                                          patching_metric: Metric, component: str = "q",
                                          verbose: bool = True, *,
                                          progress: Progress | None = None,
                                          ) -> Tensor:
    """(L, H, L, H): [sl, sh, dl, dh] is get_act_patch_direct_path from head (sl, sh) into
    head (dl, dh); 0.0 where dl <= sl. `progress(done, total)` counts the source heads."""
    hook_points(model)
    check_direct_paths(model, component)
    L, H = model.config.n_layer, model.blocks[0].attn.n_heads
    results = torch.zeros(L, H, L, H)
    for layer in range(L):
        for head in range(H):
            results[layer, head] = get_act_patch_direct_path(
                model, corrupted_tokens, clean_cache, corrupted_cache, patching_metric, layer,
                head, component)
            if progress is not None:
                progress(layer * H + head + 1, L * H)
    return results
