"""A pruned graph as plain data: the nodes and edges that stayed, for the view's Graph panel
(`glassgpt graph --json` writes circuit-tracer's schema instead: graph_files.py).

    {"tokens": [...], "scores": {"replacement": r, "completeness": c},
     "thresholds": {"node": 0.8, "edge": 0.98}, "n_layers": L,
     "nodes": [{"id": "F1.37@5", "index": i, "kind": "feature", "layer": 1, "position": 5,
                "feature": 37, "activation": a, "influence": x, "dictionary": hook}, ...],
     "edges": [{"source": "F0.12@4", "target": "F1.37@5", "weight": w}, ...]}

A node's id says what it is: F{layer}.{feature}@{position}, E{layer}@{position} (error),
T@{position} (token embedding), L{token} (logit); `index` is its row in the adjacency.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from glassgpt.errors import CheckpointError
from glassgpt.interp.graph.prune import PrunedGraph, graph_scores, source_shares
from glassgpt.interp.graph.result import AttributionGraph
from glassgpt.storage import files

JSON_KEYS = frozenset({"tokens", "n_layers", "scores", "thresholds", "nodes", "edges"})
MAX_JSON_BYTES = 256 * 2**20  # a graph's JSON read back only to recognise it


def node_id(node: dict[str, Any]) -> str:
    """The short id of a node of AttributionGraph.node."""
    kind = node["kind"]
    if kind == "feature":
        return f"F{node['layer']}.{node['feature']}@{node['position']}"
    if kind == "error":
        return f"E{node['layer']}@{node['position']}"
    if kind == "token":
        return f"T@{node['position']}"
    return f"L{node['token']}"


def pruned_json(graph: AttributionGraph, pruned: PrunedGraph, thresholds: tuple[float, float],
                decode: Callable[[int], str] = str) -> dict[str, Any]:
    """The pruned graph as data (the module docstring); `decode` names a token id."""
    kept = pruned.node_mask.nonzero()[:, 0].tolist()
    nonzero = pruned.edge_mask & (graph.adjacency_matrix != 0)  # a kept zero is no edge
    has_edge = nonzero.any(0) | nonzero.any(1)
    nodes, ids = [], {}
    for index in kept:
        node = graph.node(index)
        if node["kind"] in ("error", "token") and not bool(has_edge[index]):
            continue  # tokens are always kept, but drawn only where an edge stayed
        ids[index] = node_id(node)
        node.update(id=ids[index], index=index, influence=float(pruned.influence[index]))
        if node["kind"] in ("token", "logit"):
            node["text"] = decode(node["token"])
        if node["kind"] == "feature":
            node["dictionary"] = graph.transcoders[node["layer"]]
        nodes.append(node)
    targets, sources = nonzero.nonzero(as_tuple=True)
    weights = graph.adjacency_matrix[targets, sources]
    edges = [{"source": ids[s], "target": ids[t], "weight": float(w)}
             for t, s, w in zip(targets.tolist(), sources.tolist(), weights.tolist(),
                                strict=True) if s in ids and t in ids]
    replacement, completeness = graph_scores(graph, pruned.influence)
    return {"tokens": [decode(int(t)) for t in graph.input_ids], "n_layers": graph.n_layers,
            "scores": {"replacement": replacement, "completeness": completeness},
            "thresholds": {"node": thresholds[0], "edge": thresholds[1]},
            "nodes": nodes, "edges": sorted(edges, key=lambda e: -abs(e["weight"]))}


def is_pruned_json(path: str | Path) -> bool:
    """Whether `path` holds what `pruned_json` writes (an object of exactly its keys): what
    `glassgpt graph --json --force` may replace (an earlier glassgpt wrote this schema)."""
    try:
        data = files.read_json(path, CheckpointError, MAX_JSON_BYTES)
    except CheckpointError:
        return False
    return isinstance(data, dict) and set(data) == JSON_KEYS


def top_features(graph: AttributionGraph, pruned: PrunedGraph, k: int = 10
                 ) -> list[dict[str, Any]]:
    """The k features with the most influence on the logits, as AttributionGraph.node gives
    them, with their influence."""
    scores = pruned.influence[:graph.n_features]
    order = torch.argsort(scores, descending=True)[:k].tolist()
    return [{**graph.node(i), "influence": float(scores[i])} for i in order]


FEW_FEATURES = 3  # fewer kept features than this and `few_features_line` says why


def few_features_line(graph: AttributionGraph, pruned: PrunedGraph) -> str | None:
    """One line saying why the pruned graph kept fewer than FEW_FEATURES features: how much of
    the logits' influence the error nodes and the token embeddings carry, and what to do;
    None where it kept more."""
    kept = int(pruned.node_mask[:graph.n_features].sum())
    if kept >= FEW_FEATURES:
        return None
    errors, tokens = source_shares(graph, pruned.influence)
    said = "no feature was kept" if kept == 0 else \
        f"only {kept} feature{'s were' if kept > 1 else ' was'} kept"
    where = ("the transcoders miss most of what the MLPs write" if errors >= tokens
             else "most of it flows from the tokens through attention alone")
    return (f"{said}: the error nodes carry {errors:.0%} of the logits' influence and the token "
            f"embeddings {tokens:.0%} ({where}); train the transcoders longer or wider, or "
            f"lower the node threshold (--node-threshold)")
