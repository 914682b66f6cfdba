"""circuit-tracer's graph files: a pruned graph as the JSON its `create_graph_files` writes (the
"Anthropic attribution graph" that circuit-tracer's local server and Neuronpedia's graph viewer
read), for `glassgpt graph --json`.

    {"metadata": {"slug", "scan", "transcoder_list", "prompt_tokens", "prompt",
                  "node_threshold", "schema_version": 1},
     "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "",
                 "sg_pos": ""},
     "nodes": [{"node_id", "feature", "layer", "ctx_idx", "feature_type", "token_prob",
                "is_target_logit", "run_idx", "reverse_ctx_idx", "jsNodeId", "clerp",
                "influence", "activation"}, ...],
     "links": [{"source": node_id, "target": node_id, "weight": w}, ...]}

circuit-tracer 0.5.0's choices, kept so that its file and this one are equal field by field:
  - a feature node's id is "{layer}_{feature}_{position}", its `feature` the Cantor pairing of
    layer and feature (one number a feature, across layers), its type "cross layer transcoder"
    whatever the dictionary; an error node's id "0_{layer}_{position}"; a token's
    "E_{token id}_{position}" with layer "E"; a logit's "{L+1}_{token id}_{last position}"
    with layer L + 1 and a clerp 'Output "text" (p=0.398)', the likeliest one the target;
  - `influence` is the node's cumulative share (PrunedGraph.cumulative_scores: the share of
    all influence held by it and every node above it), none for a logit;
  - the nodes kept by pruning in the adjacency's order, less the features and errors no kept
    edge touches (every token and logit stays); the links are every kept edge, by target then
    source, zero weights included.
The viewer lists a folder's graphs from its graph-metadata.json ({"graphs": [metadata, ...]},
one entry a slug), which `write_graph_files` keeps as `create_graph_files` does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glassgpt.errors import InputError
from glassgpt.interp.graph.prune import PrunedGraph
from glassgpt.interp.graph.result import AttributionGraph
from glassgpt.storage import files

GRAPH_KEYS = frozenset({"metadata", "qParams", "nodes", "links"})
METADATA_FILE = "graph-metadata.json"  # the folder's list of graphs, what the viewer reads first
SCHEMA_VERSION = 1
FEATURE_TYPES = {"feature": "cross layer transcoder", "error": "mlp reconstruction error",
                 "token": "embedding", "logit": "logit"}
MAX_METADATA_BYTES = 64 * 2**20


def cantor_pairing(x: int, y: int) -> int:
    """One non-negative number for the pair (x, y): how circuit-tracer numbers a feature of a
    layer."""
    return (x + y) * (x + y + 1) // 2 + y


def graph_node(node: dict[str, Any], influence: float, n_layers: int,
               decode: Callable[[int], str]) -> dict[str, Any]:
    """A node of AttributionGraph.node as circuit-tracer's Node, its fields in their order."""
    kind, position = node["kind"], node["position"]
    fields: dict[str, Any] = {"feature_type": FEATURE_TYPES[kind], "ctx_idx": position,
                              "influence": influence, "activation": None}
    if kind == "feature":
        layer, feature = node["layer"], node["feature"]
        fields |= {"node_id": f"{layer}_{feature}_{position}", "layer": str(layer),
                   "feature": cantor_pairing(layer, feature), "jsNodeId": f"{layer}_{feature}-0",
                   "activation": node["activation"]}
    elif kind == "error":
        layer = node["layer"]
        fields |= {"node_id": f"0_{layer}_{position}", "layer": str(layer), "feature": -1,
                   "jsNodeId": f"{layer}_{position}-0"}
    elif kind == "token":
        token = node["token"]
        fields |= {"node_id": f"E_{token}_{position}", "layer": "E", "feature": position,
                   "jsNodeId": f"E_{token}-{position}"}
    else:
        layer, token, probability = str(n_layers + 1), node["token"], node["probability"]
        fields |= {"node_id": f"{layer}_{token}_{position}", "layer": layer, "feature": token,
                   "jsNodeId": f"L_{token}-{position}", "token_prob": probability,
                   "is_target_logit": node["rank"] == 0, "influence": None,
                   "clerp": f'Output "{decode(token)}" (p={probability:.3f})'}
    return {"node_id": fields["node_id"], "feature": fields["feature"], "layer": fields["layer"],
            "ctx_idx": position, "feature_type": fields["feature_type"],
            "token_prob": fields.get("token_prob", 0.0),
            "is_target_logit": fields.get("is_target_logit", False), "run_idx": 0,
            "reverse_ctx_idx": 0, "jsNodeId": fields["jsNodeId"],
            "clerp": fields.get("clerp", ""), "influence": fields["influence"],
            "activation": fields["activation"]}


def graph_file(graph: AttributionGraph, pruned: PrunedGraph, *, slug: str, scan: str,
               prompt: str, node_threshold: float,
               decode: Callable[[int], str] = str) -> dict[str, Any]:
    """The pruned graph as circuit-tracer's graph file (the module docstring): `slug` names it
    (the file is SLUG.json), `scan` the dictionaries it was built over, `prompt` its text,
    `decode` a token id's text."""
    nodes: dict[int, dict[str, Any]] = {}
    for index in pruned.node_mask.nonzero()[:, 0].tolist():
        node = graph.node(index)
        if node["kind"] == "logit":
            node["rank"] = index - graph.logit_index(0)
        nodes[index] = graph_node(node, float(pruned.cumulative_scores[index]), graph.n_layers,
                                  decode)
    targets, sources = pruned.edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency_matrix[targets, sources].float().tolist()
    links = [{"source": nodes[s]["node_id"], "target": nodes[t]["node_id"], "weight": w}
             for t, s, w in zip(targets.tolist(), sources.tolist(), weights, strict=True)
             if s in nodes and t in nodes]
    linked = {link["source"] for link in links} | {link["target"] for link in links}
    used = [node for node in nodes.values()
            if node["node_id"] in linked or node["feature_type"] in ("embedding", "logit")]
    metadata = {"slug": slug, "scan": scan, "transcoder_list": [],
                "prompt_tokens": [decode(int(t)) for t in graph.input_ids], "prompt": prompt,
                "node_threshold": node_threshold, "schema_version": SCHEMA_VERSION}
    return {"metadata": metadata,
            "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both",
                        "clickedId": "", "sg_pos": ""},
            "nodes": used, "links": links}


def is_graph_file(path: str | Path) -> bool:
    """Whether `path` holds a graph file of this schema (glassgpt's or circuit-tracer's): what
    `glassgpt graph --json --force` may replace."""
    try:
        data = files.read_json(path, InputError, MAX_METADATA_BYTES * 4)
    except InputError:
        return False
    return isinstance(data, dict) and set(data) == GRAPH_KEYS


def read_graph_list(folder: Path) -> list[dict[str, Any]]:
    """The graphs FOLDER/graph-metadata.json lists ([] where there is none); a file of another
    shape is refused, never overwritten."""
    path = folder / METADATA_FILE
    if not path.exists():
        return []
    data = files.read_json(path, InputError, MAX_METADATA_BYTES)
    graphs = data.get("graphs") if isinstance(data, dict) else None
    if not isinstance(graphs, list) or not all(isinstance(g, dict) and "slug" in g
                                               for g in graphs):
        raise InputError(f"{path} is not the list of graphs circuit-tracer's viewer reads "
                         f"({{\"graphs\": [{{\"slug\": ...}}, ...]}}); it is not replaced")
    return graphs


def write_graph_files(data: dict[str, Any], path: str | Path) -> Path:
    """PATH (the graph file, named SLUG.json) and its entry in graph-metadata.json beside it
    (an entry of the same slug replaced), each written atomically: the folder circuit-tracer's
    server serves (`python -m circuit_tracer start-server --graph_file_dir FOLDER`)."""
    path = Path(path)
    slug = data["metadata"]["slug"]
    if path.name != f"{slug}.json":
        raise InputError(f"a graph file is named after its slug: {slug}.json, not {path.name}")
    graphs = read_graph_list(path.parent)  # refused before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False))
    graphs = [g for g in graphs if g["slug"] != slug] + [data["metadata"]]
    files.write_text_atomic(path.parent / METADATA_FILE,
                            json.dumps({"graphs": graphs}, indent=2, ensure_ascii=False))
    return path
