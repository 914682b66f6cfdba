"""A pruned graph as plain data: the nodes and edges that stayed, for `glassgpt graph --json`
and the view's Graph panel.

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
from glassgpt.interp.graph.prune import PrunedGraph, graph_scores
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
    `glassgpt graph --json --force` may replace."""
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
