"""Attribution graphs over your own transcoders: the circuit of features from a prompt's tokens
to its most likely next tokens, read from the replacement model in which each MLP is its
transcoder plus an error, with attention patterns and norm scales frozen (circuit-tracer's
method, on a glassgpt model).

    graph = attribution_graph(model, load_transcoders(["tc/"]), ids)
    pruned = prune_graph(graph, node_threshold=0.8, edge_threshold=0.98)
    replacement, completeness = graph_scores(graph)
"""

from glassgpt.interp.graph.build import attribution_graph
from glassgpt.interp.graph.replacement import load_transcoders
from glassgpt.interp.graph.result import AttributionGraph

__all__ = ["AttributionGraph", "attribution_graph", "load_transcoders"]
