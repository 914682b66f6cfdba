"""The Graph panel's numbers: attribution graphs of the page's prompt over the transcoders the
view was started with (`glassgpt view RUN --transcoders DIR`: transcoders one a layer, or
circuit-tracer's directory of a transcoder set or a cross-layer transcoder), from
glassgpt.interp.graph. A CLT's layers join the Features panel as transcoders of their own layer
(`layers.as_transcoder`), and a feature's page there lists the layers its decoder writes into.

    available   whether the view has transcoders (the panel says how to start it otherwise)
    graph       the prompt's pruned graph as `export.pruned_json` writes it, plus the name each
                transcoder has in the Features panel (a feature node opens its page there)
                and `why`: where few features were kept, the line saying why
                (`export.few_features_line`), else null
    edge        how one edge splits over the heads that carry it (`heads.edge_heads`)

A graph costs a backward pass per feature; moving a threshold only prunes again, so the last
few prompts' graphs are kept, with the frozen run an edge's heads are read from.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glassgpt.errors import GlassGPTError, InputError
from glassgpt.interp.graph import AttributionGraph, load_transcoders
from glassgpt.interp.graph.build import graph_of
from glassgpt.interp.graph.export import few_features_line, node_id, pruned_json
from glassgpt.interp.graph.heads import edge_heads
from glassgpt.interp.graph.layers import Replacer, as_transcoder
from glassgpt.interp.graph.prune import prune_graph
from glassgpt.interp.graph.replacement import Prompt, Transcoders, by_layer, read_prompt
from glassgpt.interp.graph.select import DEFAULT_MAX_FEATURE_NODES
from glassgpt.interp.sae.circuit_tracer import is_circuit_tracer_dir, load_circuit_tracer
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.view import requests as req
from glassgpt.view.features import Dictionaries
from glassgpt.view.values import View

KEPT_PROMPTS = 4  # graphs kept: the prompt on screen and a few it may go back to
TOP_HEADS = 5  # heads always listed for an edge; others only above HEAD_SHARE of its weight
HEAD_SHARE = 0.01
HEADS_NOTE = ("a path through two heads counts for each, so the shares need not add up to the "
              "weight; direct is the part that passes through no head")
NO_TRANSCODERS = ("this view has no transcoders: start it with glassgpt view RUN "
                  "--transcoders DIR")

GRAPH = {"prompt": req.PROMPT, "node_threshold": req.Field(req.NUMBER, 0.8),
         "edge_threshold": req.Field(req.NUMBER, 0.98)}
NODE = req.Field((str, int))  # a node's id (F1.37@5) or its row in the adjacency
EDGE = {"prompt": req.PROMPT, "source": NODE, "target": NODE}


@dataclass
class Built:
    """One prompt's graph, its nodes' ids, and the frozen run it was read from (an edge's heads
    are read from it too)."""

    prompt: Prompt
    graph: AttributionGraph
    ids: dict[str, int]


class Graphs:
    """The view's transcoders (one a layer, or a cross-layer transcoder) and the graphs of its
    last few prompts. `names`: each layer's hook_name_out -> its name among the Features
    panel's dictionaries."""

    def __init__(self, view: View, transcoders: Transcoders, names: dict[str, str]):
        self.view, self.transcoders, self.names = view, transcoders, names
        self.crosslayer = isinstance(transcoders, CrossLayerTranscoder)
        self.layers: list[Replacer] = [] if not self.crosslayer and not transcoders else [
            layer for layer in by_layer(view.model, transcoders) if layer is not None]
        self.built: OrderedDict[tuple[int, ...], Built] = OrderedDict()

    def available(self) -> dict[str, Any]:
        return {"available": bool(self.layers), "crosslayer": self.crosslayer,
                "transcoders": [{"hook": sae.cfg.hook_name_out, "reads": sae.cfg.hook_name,
                                 "name": self.names.get(sae.cfg.hook_name_out),
                                 "d_sae": sae.cfg.d_sae} for sae in self.layers]}

    def build(self, prompt: str) -> Built:
        """The prompt's graph, built once while it is among the last KEPT_PROMPTS."""
        if not self.layers:
            raise InputError(NO_TRANSCODERS)
        encoded = self.view.encode(prompt)
        ids = tuple(encoded.ids)
        if ids in self.built:
            self.built.move_to_end(ids)
            return self.built[ids]
        prompt_run = read_prompt(self.view.model, self.transcoders, encoded.idx)
        graph = graph_of(prompt_run, max_feature_nodes=DEFAULT_MAX_FEATURE_NODES)
        self.built[ids] = Built(prompt_run, graph, {node_id(graph.node(i)): i
                                                    for i in range(graph.n_nodes)})
        while len(self.built) > KEPT_PROMPTS:
            self.built.popitem(last=False)
        return self.built[ids]

    def graph(self, prompt: str, node_threshold: float = 0.8, edge_threshold: float = 0.98
              ) -> dict[str, Any]:
        """The prompt's graph pruned at the thresholds, as the panel draws it."""
        graph = self.build(prompt).graph
        pruned = prune_graph(graph, node_threshold, edge_threshold)
        answer = pruned_json(graph, pruned, (node_threshold, edge_threshold),
                             self.view.token_text)
        return {**answer, "dictionaries": self.names, "why": few_features_line(graph, pruned)}

    def edge(self, prompt: str, source: str | int, target: str | int) -> dict[str, Any]:
        """The edge source -> target: its weight, its part through no head, and the heads that
        carry it (the TOP_HEADS largest, and any above HEAD_SHARE of the weight)."""
        built = self.build(prompt)
        source_index, target_index = node_index(built, source), node_index(built, target)
        split = edge_heads(built.prompt, built.graph, target_index, source_index)
        n_heads = split.shares.shape[1]
        listed = {(layer, head) for layer, head, _ in split.top(TOP_HEADS)}
        big = (split.shares.abs() > HEAD_SHARE * abs(split.weight)).nonzero().tolist()
        listed |= {(layer, head) for layer, head in big}
        heads = sorted(({"layer": layer, "head": head,
                         "share": float(split.shares[layer, head])} for layer, head in listed),
                       key=lambda h: (-abs(h["share"]), h["layer"] * n_heads + h["head"]))
        return {"source": node_id(built.graph.node(source_index)),
                "target": node_id(built.graph.node(target_index)),
                "weight": split.weight, "direct": split.direct, "heads": heads,
                "note": HEADS_NOTE}


def node_index(built: Built, node: str | int) -> int:
    """A node given by its id or its row -> its row; InputError for one the graph lacks."""
    if isinstance(node, int):
        if not 0 <= node < built.graph.n_nodes:
            raise InputError(f"node {node} is not in this prompt's graph of "
                             f"{built.graph.n_nodes} nodes")
        return node
    if node not in built.ids:
        raise InputError(f"no node {node[:40]!r} in this prompt's graph (ids look like "
                         f"F1.37@5, E1@5, T@5, L42)")
    return built.ids[node]


def load_graphs(view: View, paths: list[str | Path], dicts: Dictionaries) -> Graphs:
    """The transcoders at `paths` (each a transcoder's directory, or one holding one a layer;
    or one circuit-tracer directory: a transcoder set or a CLT), each refused in one line
    unless together they replace the model's MLPs; also added to `dicts`, named as --sae
    dictionaries are (by folder; a folder of several: folder/layerL), so that a graph's
    feature opens its page in the Features panel."""
    if not paths:
        return Graphs(view, [], {})
    device = view.model.lm_head.weight.device
    try:
        if len(paths) == 1 and is_circuit_tracer_dir(paths[0]):
            found = load_circuit_tracer(paths[0], view.model, device=device)
            if isinstance(found, CrossLayerTranscoder):
                return clt_graphs(view, Path(paths[0]), found, dicts)
            loaded = [(Path(paths[0]), found)]
        else:
            loaded = [(Path(path), load_transcoders([path], device=device)) for path in paths]
        transcoders = [sae for _, saes in loaded for sae in saes]
        layers = by_layer(view.model, transcoders)  # widths and devices checked there too
    except GlassGPTError as error:
        raise InputError(f"--transcoders: {error}") from None
    layer_of = {id(sae): layer for layer, sae in enumerate(layers) if sae is not None}
    names: dict[str, str] = {}
    for path, saes in loaded:
        for sae in saes:
            name = path.name or "transcoder"
            if len(saes) > 1:
                name = f"{name}/layer{layer_of[id(sae)]}"
            names[sae.cfg.hook_name_out] = dicts.add(name, sae)
    return Graphs(view, [sae for sae in layers if sae is not None], names)


def clt_graphs(view: View, path: Path, clt: CrossLayerTranscoder, dicts: Dictionaries
               ) -> Graphs:
    """The Graph panel over a CLT; each of its layers joins the Features panel as folder/layerL
    (a transcoder of its own layer, its page listing every layer it writes into); a TopK CLT's
    features have no page."""
    try:
        by_layer(view.model, clt)
    except GlassGPTError as error:
        raise InputError(f"--transcoders: {error}") from None
    names: dict[str, str] = {}
    for layer in range(clt.n_layers):
        sae = as_transcoder(clt, layer)
        if sae is not None:
            name = dicts.add(f"{path.name or 'clt'}/layer{layer}", sae, (clt, layer))
            names[clt.output_hook_at(layer)] = name
    return Graphs(view, clt, names)
