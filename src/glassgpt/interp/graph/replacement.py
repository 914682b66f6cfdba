"""The replacement model an attribution graph is read from, for one prompt.

Each MLP is replaced by its transcoder plus an error node, e = mlp_out - transcoder(mlp_in), so
that the replacement computes exactly what the model computes on the prompt. Then everything
that is not linear in the residual stream is frozen at the prompt's values: every attention
pattern (`hook_pattern`), every norm's scale (`hook_scale`: a LayerNorm still centres, an
RMSNorm still multiplies by its gain), the features' activations and the error terms. What
is left is linear: the residual stream at each point is a sum of what the token embeddings,
the features (activation a times decoder row) and the errors wrote into it, carried by the
residual connections and by each head's values and output (the V and O paths), plus constants
(biases, LayerNorm shifts, transcoder decoder biases) that belong to no node.

So a node's direct effect on a target is exact: the target's input (a feature's pre-activation,
or a logit minus the mean logit) changes by that much when the node is removed and everything
else stays frozen, which is what `frozen_run` computes and what the tests check against.

A model with a final `logit_softcap` (Gemma 2's 30) gets circuit-tracer's graph of it: the
logit nodes are chosen by the probabilities of the capped logits (what the model predicts),
and a logit node's row is of the logit before the cap, minus the mean such logit (the
unembedding direction minus its mean), so the graph stays linear; the cap enters nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core.hooked import as_glass, check_run_ids, hook_points, run_with_cache
from glassgpt.interp.core.hooked import run_with_hooks as hooked_run
from glassgpt.interp.graph.layers import (
    READS,
    Replacer,
    check_writes_mlp_out,
    clt_layers,
    feature_pre_acts,
    reconstruction,
)
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.interp.sae.model import SAE
from glassgpt.interp.sae.splice import check_saes

# What replaces the MLPs: transcoders, one a layer, or one cross-layer transcoder.
Transcoders = Sequence[SAE] | CrossLayerTranscoder


def load_transcoders(paths: Iterable[str | Path], device: str | torch.device = "cpu"
                     ) -> list[SAE]:
    """The transcoders in `paths`: each path a dictionary's directory (SAELens's format), or a
    directory whose subdirectories are (one a layer, as `glassgpt sae train --transcoder`
    writes them)."""
    found: list[SAE] = []
    for path in paths:
        path = Path(path)
        if (path / "cfg.json").is_file() or not path.is_dir():
            found.append(SAE.load(path, device=device))
            continue
        inner = sorted(p for p in path.iterdir() if (p / "cfg.json").is_file())
        if not inner:
            raise InputError(f"{path} holds no dictionary: give a transcoder's directory "
                             f"(cfg.json, sae_weights.safetensors) or one holding one a layer")
        found.extend(SAE.load(p, device=device) for p in inner)
    return found


def by_layer(model: nn.Module, transcoders: Transcoders) -> list[Replacer | None]:
    """The transcoders in layer order, each refused by name unless it replaces one MLP: it is a
    transcoder, writes blocks.L.hook_mlp_out, reads that block's MLP input, one a layer, every
    MLP has one (an attention-only model needs none), and its widths (d_in, d_out) and device
    are the model's there (`check_saes`, the check every splice passes). A cross-layer
    transcoder (alone, or the one item of the list) gives its layers (layers.clt_layers)."""
    glass = as_glass(model)
    config = glass.config
    if not isinstance(transcoders, CrossLayerTranscoder) and len(transcoders) == 1 \
            and isinstance(transcoders[0], CrossLayerTranscoder):
        transcoders = transcoders[0]
    if isinstance(transcoders, CrossLayerTranscoder):
        return list(clt_layers(glass, transcoders))
    layers: list[Replacer | None] = [None] * config.n_layer
    for sae in transcoders:
        if not isinstance(sae, SAE) or not sae.cfg.is_transcoder:
            kind = sae.cfg.architecture if isinstance(sae, SAE) else type(sae).__name__
            raise InputError(f"an attribution graph replaces each MLP by a transcoder; got a "
                             f"{kind} dictionary")
        layer = check_writes_mlp_out(sae, config.n_layer)
        if sae.cfg.hook_name not in {f"blocks.{layer}.{point}" for point in READS}:
            raise InputError(f"the transcoder of layer {layer} reads {sae.cfg.hook_name}; it "
                             f"must read that block's MLP input: "
                             f"{', '.join(f'blocks.{layer}.{p}' for p in READS)}")
        if layers[layer] is not None:
            raise InputError(f"two transcoders for layer {layer}: give one a layer")
        layers[layer] = sae
    missing = [layer for layer, sae in enumerate(layers) if sae is None]
    if missing and not config.attn_only:
        raise InputError(f"every MLP is replaced in an attribution graph; no transcoder for "
                         f"layer{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(map(str, missing))}")
    if transcoders:
        probe = torch.zeros(1, 1, dtype=torch.long, device=glass.lm_head.weight.device)
        check_saes(glass, probe, list(transcoders), hook_points(glass))
    return layers


@dataclass
class Prompt:
    """One prompt through the replacement model: what the graph freezes and its nodes' values.

    ids (1, T); patterns and scales by hook name, (1, ...) as the model computed them;
    embed (T, C) the token embeddings (hook_embed); acts[l] (T, d_sae) layer l's feature
    activations and errors (L, T, C) mlp_out minus the transcoders' reconstruction (a CLT's
    from every layer at or below), both zero
    at the skipped positions, whose MLP outputs are held in fixed (L, T, C) instead (zero
    elsewhere); logits (T, V), as the model gives them (after a soft-cap)."""

    model: nn.Module
    transcoders: list[Replacer | None]
    ids: Tensor
    patterns: dict[str, Tensor]
    scales: dict[str, Tensor]
    embed: Tensor
    acts: list[Tensor | None]
    errors: Tensor
    fixed: Tensor
    logits: Tensor

    @property
    def n_layers(self) -> int:
        return len(self.transcoders)

    @property
    def n_pos(self) -> int:
        return self.ids.shape[1]


def read_prompt(model: nn.Module, transcoders: Transcoders, ids: Tensor,
                skip_positions: int = 1) -> Prompt:
    """ids (1, T) -> the Prompt: one run of the model keeping what the graph freezes; the first
    `skip_positions` positions get no feature or error nodes (their MLP outputs are fixed)."""
    check_run_ids(ids)
    if ids.shape[0] != 1:
        raise InputError(f"an attribution graph is of one prompt: ids of shape (1, T), got "
                         f"{tuple(ids.shape)}")
    glass = as_glass(model)
    layers = by_layer(glass, transcoders)
    frozen = [n for n in hook_points(glass) if n.endswith(("hook_pattern", "hook_scale"))]
    reads = [sae.cfg.hook_name for sae in layers if sae is not None]
    outs = [f"blocks.{layer}.hook_mlp_out" for layer, sae in enumerate(layers) if sae is not None]
    if isinstance(skip_positions, bool) or not isinstance(skip_positions, int) \
            or skip_positions < 0:
        raise InputError(f"skip_positions is a count of first positions, got "
                         f"{skip_positions!r:.40}")
    logits, cache = run_with_cache(glass, ids, [*frozen, "hook_embed", *reads, *outs])
    T, C = ids.shape[1], glass.config.n_embd
    acts, errors, fixed = features_and_errors(
        layers, cache, skip_positions, logits.new_zeros(len(layers), T, C))
    return Prompt(glass, layers, ids, {n: cache[n] for n in frozen if "pattern" in n},
                  {n: cache[n] for n in frozen if "scale" in n},
                  cache["hook_embed"][0], acts, errors, fixed, logits[0])


def features_and_errors(layers: list[Replacer | None], cache: dict[str, Tensor],
                        skip_positions: int, like: Tensor
                        ) -> tuple[list[Tensor | None], Tensor, Tensor]:
    """Each layer's features (T, d), zero at the skipped positions; the errors (L, T, C) in
    `like`'s dtype and device, each MLP output minus its reconstruction (layers.reconstruction),
    zero there too; and the MLP outputs held fixed at the skipped positions (L, T, C), zero
    elsewhere. A layer without a transcoder has none of them."""
    acts: list[Tensor | None] = []
    mlp_out = like.new_zeros(len(layers), *like.shape[1:])  # (L, T, C)
    with torch.no_grad():
        for layer, sae in enumerate(layers):
            if sae is None:
                acts.append(None)
                continue
            x = cache[sae.cfg.hook_name][0].to(sae.W_enc.dtype)  # (T, d_in)
            acts.append(sae.encode(x))  # (T, d_sae)
            acts[-1][:skip_positions] = 0
            mlp_out[layer] = cache[sae.cfg.hook_name_out][0]
        errors = mlp_out - reconstruction(layers, acts, mlp_out)
        fixed = torch.zeros_like(errors)
        fixed[:, :skip_positions] = errors[:, :skip_positions]
        errors[:, :skip_positions] = 0
    return acts, errors, fixed


@dataclass
class FrozenRun:
    """A run of the frozen replacement model on a batch of copies of the prompt: logits (B, T,
    V) before the soft-cap of a model with `logit_softcap` (the LM head's output). embed (B, T,
    C) (the token embeddings) and mlp_out[l] (B, T, C) are the leaves the nodes write into;
    inputs[l] (B, T, d_in) what layer l's transcoder read; results[l] (B, T, H, C) each head's
    output, when kept."""

    logits: Tensor
    embed: Tensor
    mlp_out: list[Tensor | None]
    inputs: list[Tensor | None]
    results: list[Tensor]


def frozen_run(prompt: Prompt, batch: int = 1, *, acts: Sequence[Tensor | None] | None = None,
               errors: Tensor | None = None, embed: Tensor | None = None,
               keep_results: bool = False, heads_frozen: bool = False) -> FrozenRun:
    """The frozen replacement model on `batch` copies of the prompt, differentiable in its
    leaves. `acts`, `errors` and `embed` replace the nodes' values (default: the prompt's), to
    remove or perturb nodes; `heads_frozen` holds every attention output at the prompt's (so
    only the residual connections carry anything: an edge's direct part)."""
    acts = prompt.acts if acts is None else acts
    errors = prompt.errors if errors is None else errors
    embed = prompt.embed if embed is None else embed
    glass = prompt.model
    leaf_embed = embed.expand(batch, -1, -1).clone().requires_grad_(True)  # (B, T, C)
    leaves: list[Tensor | None] = []
    with torch.no_grad():  # what the features, the errors and the fixed positions write
        written = reconstruction(prompt.transcoders, acts, errors) + errors + prompt.fixed
    for layer, sae in enumerate(prompt.transcoders):
        leaves.append(None if sae is None else
                      written[layer].expand(batch, -1, -1).clone().requires_grad_(True))
    inputs: list[Tensor | None] = [None] * prompt.n_layers
    results: list[Tensor] = []
    hooks = [(name, _constant(value, batch)) for name, value in
             [*prompt.patterns.items(), *prompt.scales.items()]]
    hooks.append(("hook_embed", lambda t, name: leaf_embed))
    for layer, sae in enumerate(prompt.transcoders):
        if sae is None:
            continue
        hooks.append((sae.cfg.hook_name, _keeper(inputs, layer)))
        hooks.append((sae.cfg.hook_name_out, _constant(leaves[layer], None)))
    if keep_results:
        hooks += [(f"blocks.{layer}.attn.hook_result", _appender(results))
                  for layer in range(prompt.n_layers)]
    if heads_frozen:
        hooks += [(f"blocks.{layer}.hook_attn_out", lambda t, name: t.detach())
                  for layer in range(prompt.n_layers)]
    with torch.enable_grad(), _head_output(glass) as pre_cap:
        hooked_run(glass, prompt.ids.expand(batch, -1), hooks)
    return FrozenRun(pre_cap[0], leaf_embed, leaves, inputs, results)


@contextmanager
def _head_output(glass: nn.Module) -> Iterator[list[Tensor]]:
    """Keeps what the LM head computes (B, T, V): the logits before any `logit_softcap`, which
    is what a logit node's row is of (circuit-tracer's demeaned unembedding direction); the
    cap only weighs the logits, through their probabilities."""
    kept: list[Tensor] = []
    handle = glass.lm_head.register_forward_hook(lambda module, args, out: kept.append(out))
    try:
        yield kept
    finally:
        handle.remove()


def _constant(value: Tensor, batch: int | None):
    """A hook that puts `value` (expanded to the batch when given) in the activation's place."""
    held = value if batch is None else value.expand(batch, *value.shape[1:])

    def put(tensor: Tensor, name: str) -> Tensor:
        return held
    return put


def _keeper(store: list, index: int):
    def keep(tensor: Tensor, name: str) -> None:
        store[index] = tensor
    return keep


def _appender(store: list):
    def keep(tensor: Tensor, name: str) -> None:
        store.append(tensor)
    return keep


def feature_inputs(prompt: Prompt, run: FrozenRun, layer: int, rows: Tensor, positions: Tensor,
                   features: Tensor) -> Tensor:
    """Each target feature's pre-activation in the frozen run: x[row, pos] @ W_enc[:, f] +
    b_enc[f] (rows, positions, features: (N,) each) -> (N,), from f's column alone."""
    sae = prompt.transcoders[layer]
    x = run.inputs[layer][rows, positions].to(sae.W_enc.dtype)  # (N, d_in)
    return feature_pre_acts(sae, x, features)


def logit_inputs(run: FrozenRun, rows: Tensor, tokens: Tensor) -> Tensor:
    """Each target logit at the last position minus the mean logit there (softmax sees only
    differences), both before a soft-cap: (N,) rows, (N,) tokens -> (N,)."""
    last = run.logits[rows, -1]  # (N, V)
    return last.gather(1, tokens[:, None])[:, 0] - last.mean(-1)

