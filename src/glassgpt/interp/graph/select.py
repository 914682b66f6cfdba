"""circuit-tracer's `max_feature_nodes`: which active features become nodes when not all of them
can, chosen greedily by their influence on the logits as the rows come in.

A graph of every active feature needs a row (a backward pass's share) for each and an (N, N)
matrix: at a real model's size (28 layers, 16k-latent transcoders, a 32-token prompt: some
55,000 active features) that is 12 GB and hours of backward passes on a CPU. circuit-tracer's
`attribute(max_feature_nodes=n)` keeps n of them, found greedily, and glassgpt takes the same
steps, so that the same weights give the same nodes:
  1. the logits' rows first, batch_size at a time;
  2. rank the features not visited yet by their influence on the logits in the partial graph
     of the rows so far (`partial_influence`: the logits' probabilities carried back along
     the normalised rows, as prune.influence carries them, with every active feature a
     column);
  3. compute the rows of the next update_interval * batch_size of them, best first; repeat
     from 2 until n features have rows.
The graph then holds the n visited features as nodes, as targets (their rows) and as sources
(their columns); an unvisited feature's edges are dropped, as circuit-tracer drops them (not
moved to an error node). The rows of one round do not depend on one another, so they are
computed in the order of their layers and positions (a batch's backward pass stops at its
highest layer and its last position) and kept in the order chosen.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from glassgpt.errors import InputError
from glassgpt.interp.graph.result import AttributionGraph

# rows_of(node indices) -> their rows (n, F + L*T + T): every source's edge to each target
RowsOf = Callable[[list[int]], Tensor]
# progress(graph, rows done, rows in all): called before the first backward pass (0 done) and
# after each; the graph holds its nodes then (the adjacency is being filled).
Progress = Callable[[AttributionGraph, int, int], None]
# What `glassgpt graph` and the view's Graph panel cap the feature nodes at: circuit-tracer's
# CLI default. A graph of every active feature of a real model (Qwen3-0.6B's shape, 16k-latent
# transcoders: ~55,000 active on 32 tokens) needs a 13 GB matrix and half an hour of backward
# passes on 2 cores; with 7,500 it took 3.5 min and 6 GiB in all (`glassgpt bench graph
# --real-size`). A small model's graph keeps every active feature.
DEFAULT_MAX_FEATURE_NODES = 7500
CHUNK = 256  # rows a time where a whole matrix's |values| would be a copy of it
SMALLEST_ROW_SUM = 1e-8  # circuit-tracer's clamp of a row's sum in its partial influence


class RowStore:
    """The rows computed so far: rows (K + n, S) (the logits' first), each row's node index
    (a logit's n_nodes - K + k; a feature's its own) and the sum of its |edges|."""

    def __init__(self, n_rows: int, n_sources: int, dtype: torch.dtype):
        self.rows = torch.zeros(n_rows, n_sources, dtype=dtype)
        self.nodes = torch.zeros(n_rows, dtype=torch.long)
        self.sums = torch.zeros(n_rows, dtype=dtype)
        self.filled = 0

    def put(self, slots: Tensor, nodes: Tensor, rows: Tensor) -> None:
        rows = rows.to(self.rows.dtype).cpu()
        self.rows[slots] = rows
        self.nodes[slots] = nodes
        self.sums[slots] = rows.abs().sum(1).clamp(min=SMALLEST_ROW_SUM)
        self.filled += len(slots)  # a round's slots are all filled before it is read


def capped_adjacency(graph: AttributionGraph, rows_of: RowsOf, cap: int, batch_size: int,
                     update_interval: int, dtype: torch.dtype,
                     progress: Progress | None = None) -> tuple[Tensor, Tensor]:
    """graph (its nodes: every active feature) -> (the adjacency of the `cap` features chosen
    greedily (module docstring) and the errors, tokens and logits, (N', N'); the chosen
    features' indices among graph's active features, ascending (cap,))."""
    F, K = graph.n_features, graph.n_logits
    store = RowStore(K + cap, graph.n_nodes - K, dtype)
    total = K + cap
    if progress is not None:
        progress(graph, 0, total)
    logits = torch.arange(graph.n_nodes - K, graph.n_nodes)
    for start in range(0, K, batch_size):
        chunk = logits[start:start + batch_size]
        store.put(torch.arange(start, start + len(chunk)), chunk, rows_of(chunk.tolist()))
        if progress is not None:
            progress(graph, store.filled, total)
    visited = torch.zeros(F, dtype=torch.bool)
    while store.filled < total:
        ranked = partial_influence(store, graph.logit_probabilities, F, K).argsort(
            descending=True, stable=True)
        pending = ranked[~visited[ranked]][:min(update_interval * batch_size,
                                                total - store.filled)]
        compute_round(graph, store, rows_of, pending, batch_size, progress, total)
        visited[pending] = True
    selected = visited.nonzero()[:, 0]
    return capped_matrix(graph, store, selected), selected


def compute_round(graph: AttributionGraph, store: RowStore, rows_of: RowsOf, pending: Tensor,
                  batch_size: int, progress: Progress | None, total: int) -> None:
    """The rows of `pending` (feature indices, best first), stored in that order, computed in
    batches of nearby layers and positions."""
    slots = store.filled + torch.arange(len(pending))
    where = graph.active_features[pending]  # (n, 3)
    order = (where[:, 0] * graph.n_pos + where[:, 1]).argsort(stable=True)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        store.put(slots[batch], pending[batch], rows_of(pending[batch].tolist()))
        if progress is not None:
            progress(graph, store.filled, total)


def partial_influence(store: RowStore, probabilities: Tensor, n_features: int,
                      n_logits: int) -> Tensor:
    """Each active feature's influence on the logits through the rows so far (F,):
    circuit-tracer's compute_partial_influences. With R the rows normalised (|edges| over
    their sum), w_0 the logits' probabilities on their rows and w_{k+1} = w_k R read at the
    rows' own nodes, influence = (sum_k w_k) R. The w_k live on the visited features alone (a
    square product of the rows so far); only the last product reads every column."""
    n = store.filled
    rows, sums = store.rows[:n], store.sums[:n, None]
    visited = store.nodes[n_logits:n]
    among = rows[:, visited].abs() / sums  # (n, n - K): edges from the visited features
    weight = torch.zeros(n, dtype=rows.dtype)
    weight[:n_logits] = probabilities.to(rows.dtype)
    carried = weight.clone()
    for _ in range(n + 1):  # a path visits each row at most once
        step = torch.zeros_like(weight)
        step[n_logits:] = weight @ among
        weight = step
        if not weight.any():
            break
        carried += weight
    else:
        raise InputError("the rows of the graph make a cycle: they are not an attribution "
                         "graph's")
    influence = torch.zeros(n_features, dtype=rows.dtype)
    scaled = carried / sums[:, 0]
    for start in range(0, n, CHUNK):
        influence += scaled[start:start + CHUNK] @ rows[start:start + CHUNK, :n_features].abs()
    return influence


def capped_matrix(graph: AttributionGraph, store: RowStore, selected: Tensor) -> Tensor:
    """The (N', N') adjacency of the selected features (ascending), the errors, tokens and
    logits: the stored rows, their columns of the selected features and every other source."""
    F, K = graph.n_features, graph.n_logits
    sources = store.rows.shape[1]
    columns = torch.cat([selected, torch.arange(F, sources)])
    n = len(columns) + K
    matrix = torch.zeros(n, n, dtype=store.rows.dtype)
    feature_rows = K + store.nodes[K:].argsort()  # the selected features' rows, ascending
    for start in range(0, len(selected), CHUNK):
        rows = feature_rows[start:start + CHUNK]
        matrix[start:start + len(rows), :n - K] = store.rows[rows][:, columns]
    matrix[n - K:, :n - K] = store.rows[:K][:, columns]
    return matrix
