"""What of a graph matters to its logits: influence, pruning, and the two scores circuit-tracer
reports.

All three read the normalised adjacency: absolute values, each row divided by its sum, so that
row t says what share of t's input each source gave. A node's influence is the share of the
logits (weighted by their probabilities) that reaches it along every path:
    influence = w A + w A^2 + w A^3 + ...      (w: the logits' probabilities, 0 elsewhere)
finite because the graph has no cycles (a node writes only to later layers and positions).

Pruning (circuit-tracer's prune_graph, step for step) keeps the fewest nodes whose influence
reaches `node_threshold` of the total (tokens and logits always stay), then, renormalised over
what stayed, the fewest edges that reach `edge_threshold`, an edge scored by its share of its
target's input times the target's influence (plus, for a logit, its probability). A feature or
error left with no edge out goes, and so does a feature with no edge in, until nothing changes.

Scores (circuit-tracer's): the replacement score is the share of the logits' influence that
ends at the tokens rather than at error nodes; the completeness score is the share of every
node's input that comes from non-error nodes, weighted by the node's influence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from glassgpt.errors import InputError
from glassgpt.interp.graph.result import AttributionGraph


def normalize_matrix(matrix: Tensor) -> Tensor:
    """|A| with each row divided by its sum (rows of zeros stay zeros). (N, N) -> (N, N)."""
    absolute = matrix.abs()
    return absolute / absolute.sum(1, keepdim=True).clamp(min=1e-10)


def influence(normalized: Tensor, weights: Tensor) -> Tensor:
    """w A + w A^2 + ... for a normalised, acyclic A (N, N) and weights w (N,) -> (N,)."""
    if not bool(torch.isfinite(normalized).all() & torch.isfinite(weights).all()):
        raise InputError("the adjacency or the logits' probabilities hold NaN or infinite "
                         "values: no influence can be read from them")
    current = weights @ normalized
    total = current.clone()
    for _ in range(normalized.shape[0]):  # a path visits each node at most once
        if not current.any():
            return total
        current = current @ normalized
        total += current
    raise InputError("the adjacency has a cycle: it is not an attribution graph's")


def logit_weights(graph: AttributionGraph) -> Tensor:
    """(N,): each logit node's probability, 0 for every other node."""
    weights = torch.zeros(graph.n_nodes, dtype=graph.adjacency_matrix.dtype)
    weights[graph.logit_slice] = graph.logit_probabilities.to(weights.dtype)
    return weights


def node_influence(graph: AttributionGraph) -> Tensor:
    """(N,): each node's influence on the logits (see the module docstring)."""
    return influence(normalize_matrix(graph.adjacency_matrix), logit_weights(graph))


def threshold_of(scores: Tensor, keep: float) -> float:
    """The smallest score among the fewest largest scores whose sum reaches `keep` of all."""
    ordered = scores.flatten().sort(descending=True).values
    total = ordered.sum()
    if total <= 0:
        return float("inf")
    cumulative = ordered.cumsum(0) / total
    index = int(torch.searchsorted(cumulative, torch.tensor(keep, dtype=cumulative.dtype)))
    return float(ordered[min(index, len(ordered) - 1)])


@dataclass
class PrunedGraph:
    """node_mask (N,) bool, edge_mask (N, N) bool (rows targets), each node's influence on the
    logits in the whole graph (N,), and cumulative_scores (N,): the share of all influence held
    by the nodes at least as influential as this one (what the node threshold cuts)."""

    node_mask: Tensor
    edge_mask: Tensor
    influence: Tensor
    cumulative_scores: Tensor


def prune_graph(graph: AttributionGraph, node_threshold: float = 0.8,
                edge_threshold: float = 0.98) -> PrunedGraph:
    """The nodes and edges that carry `node_threshold` and `edge_threshold` of the logits'
    influence (circuit-tracer's defaults; see the module docstring)."""
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0 < value <= 1:
            raise InputError(f"{name} is a share of the influence, in (0, 1]; got {value}")
    matrix, weights = graph.adjacency_matrix, logit_weights(graph)
    scores = influence(normalize_matrix(matrix), weights)
    node_mask = scores >= threshold_of(scores, node_threshold)
    node_mask[graph.token_slice] = True
    node_mask[graph.logit_slice] = True
    kept = matrix * node_mask[:, None] * node_mask[None, :]
    normalized = normalize_matrix(kept)
    target_weight = influence(normalized, weights) + weights
    edge_scores = normalized * target_weight[:, None]  # (N, N): share x the target's weight
    edge_mask = edge_scores >= threshold_of(edge_scores, edge_threshold)
    features, writers = slice(0, graph.n_features), slice(0, graph.error_slice.stop)
    while True:  # what no kept edge leaves (or, for a feature, reaches) carries nothing
        before = node_mask.clone()
        node_mask[writers] &= edge_mask[:, writers].any(0)
        node_mask[features] &= edge_mask[features].any(1)
        edge_mask &= node_mask[:, None] & node_mask[None, :]
        if torch.equal(before, node_mask):
            return PrunedGraph(node_mask, edge_mask, scores, cumulative_shares(scores))


def cumulative_shares(scores: Tensor) -> Tensor:
    """(N,): for each node, the share of the total held by it and every node above it."""
    ordered, order = scores.sort(descending=True)
    shares = torch.empty_like(scores)
    shares[order] = ordered.cumsum(0) / ordered.sum().clamp(min=1e-30)
    return shares


def graph_scores(graph: AttributionGraph, influence_on_logits: Tensor | None = None
                 ) -> tuple[float, float]:
    """(replacement score, completeness score) of the unpruned graph (module docstring).
    `influence_on_logits` (N,): node_influence(graph) where the caller has it already (a
    PrunedGraph's `influence`), not computed again."""
    normalized = normalize_matrix(graph.adjacency_matrix)
    weights = logit_weights(graph)
    scores = influence(normalized, weights) if influence_on_logits is None \
        else influence_on_logits
    from_tokens = scores[graph.token_slice].sum()
    from_errors = scores[graph.error_slice].sum()
    replacement = from_tokens / (from_tokens + from_errors).clamp(min=1e-30)
    non_error = 1 - normalized[:, graph.error_slice].sum(1)  # (N,)
    weight = scores + weights
    completeness = (non_error * weight).sum() / weight.sum()
    return float(replacement), float(completeness)


def source_shares(graph: AttributionGraph, influence_on_logits: Tensor) -> tuple[float, float]:
    """(errors, tokens): the shares of the logits' influence (a PrunedGraph's `influence`) that
    the error nodes and the token embeddings carry. Every path to a logit starts at one of
    them (a feature passes on what it reads), so the two add up to 1; what the transcoders
    fail to explain starts at an error node."""
    from_errors = influence_on_logits[graph.error_slice].sum()
    from_tokens = influence_on_logits[graph.token_slice].sum()
    total = (from_errors + from_tokens).clamp(min=1e-30)
    return float(from_errors / total), float(from_tokens / total)
