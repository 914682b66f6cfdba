"""Attribution patching: activation patching's first-order (linear) approximation.

Patching one activation a from the corrupted run's value to the clean run's changes the metric
by about (a_clean - a_corrupted) . d metric / d a, the gradient taken on the corrupted run. One
forward and one backward of the corrupted prompt (and the clean prompt's cache) give that
number for every layer, position and head at once, where activation patching runs the model
once a cell. Where the metric is linear in the activation (a norm-less model's last layer
before the unembedding, with a metric linear in the logits) the two are equal; elsewhere it is
an estimate, good where the model is near-linear between the two runs.

Two faces:
- TransformerLens 4.3's node attribution patching (`transformer_lens.tools.analysis.
  attribution_patching`, its PR #1750), with its names: `attribution_patch(model, clean,
  corrupt, metric_fn)` -> `AttributionResult` (node_scores keyed by `Node(kind, position,
  layer, head)`: the token embedding, each head's output (z summed over d_head) and each MLP
  output, at each position, one prompt pair at a time and averaged), `cache_activation_and_
  gradient`, `enumerate_nodes`, `GradientCache`, `EdgeAttributionConfig` (node granularity;
  edges are not built here yet).
- glassgpt's maps, the counterparts of glassgpt.interp.methods.patching's sweeps with the same
  arguments `(model, corrupted_tokens, clean_cache, patching_metric)` and the same shapes:
  `get_attr_patch_resid_pre` / `_attn_out` / `_mlp_out` (layer, pos),
  `get_attr_patch_attn_head_out_by_pos` (layer, pos, head), `_all_pos` (layer, head). As a
  patch there puts back every prompt of the batch, each cell sums over the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core.cache import cached
from glassgpt.interp.core.hooked import (
    NamesFilter,
    check_run_ids,
    hook_points,
    run_with_cache,
    select_names,
)

MetricFn = Callable[[Tensor], Tensor]
NODE_KINDS = ("embed", "attn_head_out", "mlp_out")


# --- TransformerLens 4.3's node attribution patching ------------------------------------------

@dataclass
class GradientCache:
    """One run's activations (detached), d metric / d activation at each (None when the
    gradient was not asked for), and the metric's value."""

    activations: dict[str, Tensor]
    gradients: dict[str, Tensor | None]
    metric: Tensor


@dataclass(frozen=True)
class Node:
    """A writer into the residual stream at one position: the token embedding ("embed", no
    layer, no head), one head's output ("attn_head_out", layer and head) or one MLP's output
    ("mlp_out", a layer, no head)."""

    kind: str
    position: int
    layer: int | None = None
    head: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in NODE_KINDS:
            raise InputError(f"a node's kind is one of {', '.join(NODE_KINDS)}, got "
                             f"{self.kind!r:.40}")
        needs = {"embed": (False, False), "attn_head_out": (True, True),
                 "mlp_out": (True, False)}[self.kind]
        if (self.layer is not None, self.head is not None) != needs:
            raise InputError(f"a {self.kind} node takes {'a layer' if needs[0] else 'no layer'} "
                             f"and {'a head' if needs[1] else 'no head'}, got layer="
                             f"{self.layer}, head={self.head}")

    @property
    def hook_name(self) -> str:
        """The hook point the node's activation is read at."""
        if self.kind == "embed":
            return "hook_embed"
        if self.kind == "attn_head_out":
            return f"blocks.{self.layer}.attn.hook_z"
        return f"blocks.{self.layer}.hook_mlp_out"


@dataclass(frozen=True)
class EdgeAttributionConfig:
    """What `attribution_patch` scores: granularity "node" (edges are TransformerLens's
    too, not built here yet), with plain attribution (ig_steps=1, as TransformerLens 4.3)."""

    granularity: str = "node"
    ig_steps: int = 1

    def __post_init__(self) -> None:
        if self.granularity != "node":
            raise InputError(f"glassgpt's attribution patching scores nodes (granularity="
                             f"'node'); got granularity={self.granularity!r:.20}")
        if self.ig_steps != 1:
            raise InputError(f"ig_steps must be 1 (plain attribution; integrated gradients are "
                             f"not implemented, as in TransformerLens 4.3), got {self.ig_steps}")


@dataclass
class AttributionResult:
    """Each node's estimated effect (a_clean - a_corrupt) . gradient: positive where patching
    it from corrupt toward clean raises the metric."""

    node_scores: dict[Node, float]
    edge_scores: dict[tuple[Node, Node], float] = field(default_factory=dict)

    def top_nodes(self, k: int = 10) -> list[tuple[Node, float]]:
        """The k nodes of largest |score|, largest first (ties in enumeration order)."""
        return sorted(self.node_scores.items(), key=lambda item: -abs(item[1]))[:k]

    def top_edges(self, k: int = 10) -> list[tuple[Node, Node, float]]:
        ranked = sorted(self.edge_scores.items(), key=lambda item: -abs(item[1]))[:k]
        return [(source, target, score) for (source, target), score in ranked]


def node_hook_names(n_layer: int) -> list[str]:
    """The points a node sweep reads: the embedding, each layer's z and MLP output."""
    return ["hook_embed", *(name for layer in range(n_layer)
                            for name in (f"blocks.{layer}.attn.hook_z",
                                         f"blocks.{layer}.hook_mlp_out"))]


def cache_activation_and_gradient(model: nn.Module, tokens: Tensor, metric_fn: MetricFn,
                                  names_filter: NamesFilter = None,
                                  compute_gradient: bool = True) -> GradientCache:
    """One run of `tokens`: the activations `names_filter` picks (None: the node sweep's
    points) and, with compute_gradient, d metric_fn(logits) / d each of them."""
    points = hook_points(model)
    if names_filter is None:
        names_filter = [n for n in node_hook_names(model.config.n_layer) if n in points]
    names = select_names(points, names_filter)
    if not names:
        raise InputError("names_filter picks no hook point of the model")
    if not compute_gradient:
        logits, cache = run_with_cache(model, tokens, names)
        return GradientCache({n: cache[n] for n in names}, dict.fromkeys(names),
                             scalar_metric(metric_fn(logits)).detach())
    logits, cache = run_with_cache(model, tokens, names, incl_bwd=True, metric=metric_fn)
    return GradientCache({n: cache[n] for n in names}, {n: cache[f"{n}_grad"] for n in names},
                         scalar_metric(metric_fn(logits)))


def scalar_metric(value: object) -> Tensor:
    if not isinstance(value, Tensor) or value.numel() != 1:
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise InputError(f"metric_fn must return a scalar tensor, got {got}")
    return value.reshape(())


def enumerate_nodes(model: nn.Module, cache: GradientCache) -> list[Node]:
    """Every node of the model at every position of the cache's run: the embedding's first,
    then layer by layer, position by position, the heads then the MLP (an attention-only
    model has no MLP nodes)."""
    n_layer = model.config.n_layer
    points = hook_points(model)
    missing = [n for n in node_hook_names(n_layer) if n in points and n not in cache.activations]
    if missing:
        raise InputError(f"the node graph needs {', '.join(missing)} in the cache")
    n_pos = cache.activations["hook_embed"].shape[1]
    nodes = [Node("embed", position) for position in range(n_pos)]
    for layer in range(n_layer):
        n_head = cache.activations[f"blocks.{layer}.attn.hook_z"].shape[2]
        has_mlp = f"blocks.{layer}.hook_mlp_out" in cache.activations
        for position in range(n_pos):
            nodes += [Node("attn_head_out", position, layer, head) for head in range(n_head)]
            nodes += [Node("mlp_out", position, layer)] if has_mlp else []
    return nodes


def node_effects(clean: GradientCache, corrupt: GradientCache,
                 nodes: list[Node]) -> dict[Node, float]:
    """(clean - corrupt activation) . corrupt gradient, over the node's features (d_model, or
    d_head for a head), for each node of a one-prompt run."""
    products = {name: (clean.activations[name] - corrupt.activations[name])
                * corrupt.gradients[name] for name in {node.hook_name for node in nodes}}
    scores = {}
    for node in nodes:
        product = products[node.hook_name][0, node.position]  # (C,) or (H, d)
        scores[node] = float(product[node.head].sum() if node.head is not None
                             else product.sum())
    return scores


def check_pair(clean: object, corrupt: object) -> None:
    check_run_ids(clean)
    check_run_ids(corrupt)
    if clean.shape != corrupt.shape:
        raise InputError(f"clean and corrupt must be paired prompts of one shape (batch, pos), "
                         f"got {tuple(clean.shape)} and {tuple(corrupt.shape)}")


def attribution_patch(model: nn.Module, clean: Tensor, corrupt: Tensor, metric_fn: MetricFn,
                      config: EdgeAttributionConfig = EdgeAttributionConfig()
                      ) -> AttributionResult:
    """Each node's estimated patching effect, prompt pair by prompt pair (metric_fn takes one
    prompt's logits (1, T, V)), averaged over the pairs: one clean forward and one corrupt
    forward and backward a pair."""
    if not isinstance(config, EdgeAttributionConfig):
        raise InputError(f"config must be an EdgeAttributionConfig, got "
                         f"{type(config).__name__}")
    check_pair(clean, corrupt)
    totals: dict[Node, float] = {}
    for row in range(clean.shape[0]):
        clean_run = cache_activation_and_gradient(model, clean[row:row + 1], metric_fn,
                                                  compute_gradient=False)
        corrupt_run = cache_activation_and_gradient(model, corrupt[row:row + 1], metric_fn)
        nodes = enumerate_nodes(model, corrupt_run)
        for node, score in node_effects(clean_run, corrupt_run, nodes).items():
            totals[node] = totals.get(node, 0.0) + score
    return AttributionResult({node: total / clean.shape[0] for node, total in totals.items()})


# --- glassgpt's maps: activation patching's sweeps, estimated in one backward -----------------

def attribution_products(model: nn.Module, corrupted_tokens: Tensor,
                         clean_cache: Mapping[str, Tensor], patching_metric: MetricFn,
                         template: str) -> Tensor:
    """(clean - corrupted) * gradient at `template` of each layer, stacked: (L, B, ...)."""
    points = hook_points(model)
    check_run_ids(corrupted_tokens)
    names = [template.format(l=layer) for layer in range(model.config.n_layer)]
    if names[0] not in points:
        raise InputError(f"this model has no hook point {names[0]} (an attention-only model "
                         "has no MLP)")
    _, corrupted = run_with_cache(model, corrupted_tokens, names, incl_bwd=True,
                                  metric=patching_metric)
    products = []
    for name in names:
        clean = cached(clean_cache, name)
        if clean.shape != corrupted[name].shape:
            raise InputError(f"the clean cache's {name} is {tuple(clean.shape)}, the corrupted "
                             f"run's {tuple(corrupted[name].shape)}: the clean prompt must have "
                             "the corrupted one's batch and length")
        delta = clean.to(corrupted[name].device) - corrupted[name]
        products.append(delta * corrupted[f"{name}_grad"])
    return torch.stack(products)  # (L, B, T, ...)


def _layer_pos_map(activation: str) -> Callable[..., Tensor]:
    template = f"blocks.{{l}}.hook_{activation}"

    def attribution_map(model: nn.Module, corrupted_tokens: Tensor,
                        clean_cache: Mapping[str, Tensor], patching_metric: MetricFn) -> Tensor:
        products = attribution_products(model, corrupted_tokens, clean_cache, patching_metric,
                                        template)  # (L, B, T, C)
        return products.sum(dim=(1, 3))  # (L, T)
    attribution_map.__name__ = attribution_map.__qualname__ = f"get_attr_patch_{activation}"
    attribution_map.__doc__ = (f"(layer, pos): patching {activation} at one layer and "
                               "position, estimated from one backward of the corrupted run.")
    return attribution_map


get_attr_patch_resid_pre = _layer_pos_map("resid_pre")
get_attr_patch_attn_out = _layer_pos_map("attn_out")
get_attr_patch_mlp_out = _layer_pos_map("mlp_out")


def get_attr_patch_attn_head_out_by_pos(model: nn.Module, corrupted_tokens: Tensor,
                                        clean_cache: Mapping[str, Tensor],
                                        patching_metric: MetricFn) -> Tensor:
    """(layer, pos, head): patching one head's z at one position, estimated."""
    products = attribution_products(model, corrupted_tokens, clean_cache, patching_metric,
                                    "blocks.{l}.attn.hook_z")  # (L, B, T, H, d)
    return products.sum(dim=(1, 4))  # (L, T, H)


def get_attr_patch_attn_head_out_all_pos(model: nn.Module, corrupted_tokens: Tensor,
                                         clean_cache: Mapping[str, Tensor],
                                         patching_metric: MetricFn) -> Tensor:
    """(layer, head): patching one head's z at every position, estimated."""
    products = attribution_products(model, corrupted_tokens, clean_cache, patching_metric,
                                    "blocks.{l}.attn.hook_z")  # (L, B, T, H, d)
    return products.sum(dim=(1, 2, 4))  # (L, H)

