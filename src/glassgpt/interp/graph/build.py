"""`attribution_graph`: one prompt's nodes and the direct effects between them.

A row of the adjacency is one backward pass of the frozen replacement model
(glassgpt.interp.graph.replacement) from a target's input: the gradient g reaching each place a
node writes is exact there, because everything between is linear, and a node's edge is what it
wrote there dotted with g:
    feature (l, p, f) with activation a:  a * (W_dec[f] . g_mlp_out[l][p])
    error (l, p):                         e[l, p] . g_mlp_out[l][p]
    token at p:                           W_E[token] . g_embed[p]
Features do not pass gradients on (their activations are frozen), so the gradient measures the
direct effect only: paths through other features are edges of their own. For the models it knows
(Pre-LN blocks) the backward pass is written out (glassgpt.interp.graph.backward), a batch of
`batch_size` targets at a time; for any other, autograd computes it: the forward runs once on
`batch_size` copies of the prompt, each copy a target, and every backward reuses it.

With `max_feature_nodes`, only that many features become nodes, chosen greedily by their
influence on the logits as circuit-tracer chooses them (glassgpt.interp.graph.select).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.graph import layers as replacers
from glassgpt.interp.graph.backward import Writes, WrittenBackward, knows
from glassgpt.interp.graph.replacement import (
    FrozenRun,
    Prompt,
    Transcoders,
    feature_inputs,
    frozen_run,
    logit_inputs,
    read_prompt,
)
from glassgpt.interp.graph.result import AttributionGraph
from glassgpt.interp.graph.select import Progress, RowsOf, capped_adjacency


def attribution_graph(model: nn.Module, transcoders: Transcoders, ids: Tensor | Sequence[int],
                      *, max_n_logits: int = 10, desired_logit_prob: float = 0.95,
                      batch_size: int = 64, skip_positions: int = 1,
                      max_feature_nodes: int | None = None, update_interval: int = 4,
                      progress: Progress | None = None) -> AttributionGraph:
    """The attribution graph of the prompt `ids` ((T,) or (1, T) token ids) through `model`
    with each MLP replaced by its transcoder (one a layer, SAELens's format; see
    glassgpt.interp.graph.replacement), or by a cross-layer transcoder (a CrossLayerTranscoder:
    its layer-l features write into every MLP output from l on; glassgpt.interp.graph.layers).
    Logit nodes: the most probable next tokens at the last position, fewest whose
    probabilities reach `desired_logit_prob`, at most `max_n_logits` (circuit-tracer's
    defaults). `batch_size` targets share one backward pass. The first
    `skip_positions` positions have no feature or error nodes (circuit-tracer skips position
    0, a BOS or attention sink in most models); 0 gives every position its nodes.
    `max_feature_nodes`: at most that many feature nodes, circuit-tracer's greedy choice
    re-ranked every `update_interval` batches (glassgpt.interp.graph.select; the same nodes as
    circuit-tracer's `attribute` given the same batch_size and update_interval); None, its
    default, makes every active feature a node. `progress` follows the backward passes (see
    Progress)."""
    prompt = read_prompt(model, transcoders, _as_prompt(ids), skip_positions)
    return graph_of(prompt, max_n_logits=max_n_logits, desired_logit_prob=desired_logit_prob,
                    batch_size=batch_size, max_feature_nodes=max_feature_nodes,
                    update_interval=update_interval, progress=progress)


def graph_of(prompt: Prompt, *, max_n_logits: int = 10, desired_logit_prob: float = 0.95,
             batch_size: int = 64, max_feature_nodes: int | None = None,
             update_interval: int = 4, progress: Progress | None = None) -> AttributionGraph:
    """attribution_graph of a prompt already read (replacement.read_prompt), for a caller that
    keeps the Prompt to split edges over heads afterwards (heads.edge_heads)."""
    check_settings(batch_size, max_n_logits, desired_logit_prob, max_feature_nodes,
                   update_interval)
    tokens, probs = top_logits(prompt.logits[-1], max_n_logits, desired_logit_prob)
    features, values = active_features(prompt)
    graph = AttributionGraph(
        input_ids=prompt.ids[0].cpu(), active_features=features, activation_values=values,
        logit_tokens=tokens, logit_probabilities=probs,
        adjacency_matrix=torch.zeros(0, 0), n_layers=prompt.n_layers,
        transcoders=[None if sae is None else sae.cfg.hook_name_out
                     for sae in prompt.transcoders])
    if max_feature_nodes is None or max_feature_nodes >= graph.n_features:
        graph.adjacency_matrix = adjacency(prompt, graph, batch_size, progress)
        return graph
    rows_of, dtype = row_source(prompt, graph, batch_size)
    graph.adjacency_matrix, chosen = capped_adjacency(graph, rows_of, max_feature_nodes,
                                                      batch_size, update_interval, dtype,
                                                      progress)
    graph.n_active_features = graph.n_features
    graph.active_features = graph.active_features[chosen]
    graph.activation_values = graph.activation_values[chosen]
    return graph


def check_settings(batch_size: int, max_n_logits: int, desired_logit_prob: float,
                   max_feature_nodes: int | None, update_interval: int) -> None:
    """The counts positive (max_feature_nodes may be None: no cap), the probability a share."""
    counts = {"batch_size": batch_size, "max_n_logits": max_n_logits,
              "update_interval": update_interval}
    if max_feature_nodes is not None:
        counts["max_feature_nodes"] = max_feature_nodes
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive count, got {value!r:.40}")
    if not 0 < desired_logit_prob <= 1:
        raise InputError(f"desired_logit_prob must be in (0, 1], got {desired_logit_prob}")


def _as_prompt(ids: Tensor | Sequence[int]) -> Tensor:
    ids = torch.as_tensor(ids)
    return ids[None] if ids.dim() == 1 else ids


def top_logits(logits: Tensor, max_n_logits: int, desired_logit_prob: float
               ) -> tuple[Tensor, Tensor]:
    """logits (V,) -> (tokens (K,), probabilities (K,)): the most probable tokens, the fewest
    whose probabilities sum to desired_logit_prob, at most max_n_logits."""
    probs = torch.softmax(logits.double(), -1)
    top_p, top_t = probs.topk(min(max_n_logits, probs.shape[0]))
    reached = (top_p.cumsum(0) >= desired_logit_prob).nonzero()
    k = int(reached[0]) + 1 if len(reached) else len(top_p)
    return top_t[:k].cpu(), top_p[:k].to(logits.dtype).cpu()


def active_features(prompt: Prompt) -> tuple[Tensor, Tensor]:
    """(F, 3) long (layer, position, feature) of every feature with a positive activation, by
    layer, position and feature, and their activations (F,)."""
    rows, values = [], []
    for layer, acts in enumerate(prompt.acts):
        if acts is None:
            continue
        where = (acts > 0).nonzero()  # (n, 2): position, feature, in that order
        rows.append(torch.cat([torch.full_like(where[:, :1], layer), where], 1))
        values.append(acts[where[:, 0], where[:, 1]])
    if not rows:
        return torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, dtype=prompt.logits.dtype)
    return torch.cat(rows).cpu(), torch.cat(values).detach().cpu()


def adjacency(prompt: Prompt, graph: AttributionGraph, batch_size: int,
              progress: Progress | None = None) -> Tensor:
    """The (N, N) matrix: a row for each feature and logit, computed batch_size at a time."""
    n = graph.n_nodes
    rows_of, dtype = row_source(prompt, graph, batch_size)
    matrix = torch.zeros(n, n, dtype=dtype)
    targets = list(range(graph.n_features)) + list(range(n - graph.n_logits, n))
    if progress is not None:
        progress(graph, 0, len(targets))
    for start in range(0, len(targets), batch_size):
        chunk = targets[start:start + batch_size]
        matrix[chunk, :n - graph.n_logits] = rows_of(chunk).cpu()  # (B, N - K)
        if progress is not None:
            progress(graph, start + len(chunk), len(targets))
    return matrix


def row_source(prompt: Prompt, graph: AttributionGraph, batch_size: int
               ) -> tuple[RowsOf, torch.dtype]:
    """What computes the rows of targets (node indices), batch_size at most at a time: the
    written-out backward pass where the model is one it knows, autograd elsewhere; and the
    dtype of the rows (the model's, float32 at least: a bf16 model's edges are kept in
    float32, as circuit-tracer keeps them)."""
    dtype = torch.promote_types(prompt.logits.dtype, torch.float32)
    features = graph.active_features.to(prompt.logits.device)
    writes = feature_writes(prompt, graph, features)
    if knows(prompt):
        return WrittenBackward(prompt, graph, writes), dtype
    run = frozen_run(prompt, batch=min(batch_size, graph.n_features + graph.n_logits))

    def rows_of(chunk: list[int]) -> Tensor:
        value = target_inputs(prompt, run, graph, features, chunk)
        leaves = [run.embed, *(leaf for leaf in run.mlp_out if leaf is not None)]
        grads = torch.autograd.grad(value, leaves, retain_graph=True, allow_unused=True)
        g_embed, g_mlp = grads[0], iter(grads[1:])
        g_layers = [None if leaf is None else next(g_mlp) for leaf in run.mlp_out]
        rows = source_effects(prompt, graph, writes, g_embed, g_layers)  # (B, N - K)
        return rows[:len(chunk)].detach().to(dtype)
    return rows_of, dtype


def target_inputs(prompt: Prompt, run: FrozenRun, graph: AttributionGraph, features: Tensor,
                  chunk: list[int]) -> Tensor:
    """The sum over the chunk of each target's input, target i read from copy i of the run."""
    device = features.device
    rows = torch.arange(len(chunk), device=device)
    index = torch.tensor(chunk, device=device)
    is_feature = index < graph.n_features
    total = run.logits.new_zeros(())
    feature_rows, feature_ids = rows[is_feature], index[is_feature]
    for layer in range(prompt.n_layers):
        here = features[feature_ids, 0] == layer
        if here.any():
            picked = features[feature_ids[here]]
            total = total + feature_inputs(prompt, run, layer, feature_rows[here], picked[:, 1],
                                           picked[:, 2]).sum()
    logit_rows = rows[~is_feature]
    if len(logit_rows):
        tokens = graph.logit_tokens.to(device)[index[~is_feature] - graph.logit_index(0)]
        total = total + logit_inputs(run, logit_rows, tokens).sum()
    return total


def feature_writes(prompt: Prompt, graph: AttributionGraph, features: Tensor) -> Writes:
    """What each (layer, position)'s active features write, into each layer's MLP output they
    reach (their own; a CLT's, every later one too), for source_effects: a feature's edge is
    then the sum over those layers of a column of g[:, position] @ written."""
    writes: Writes = []
    values = graph.activation_values.to(features.device)
    cells = torch.unique_consecutive(features[:, :2], dim=0, return_counts=True)
    start = 0
    for (layer, position), count in zip(cells[0].tolist(), cells[1].tolist(), strict=True):
        ids = features[start:start + count, 2]
        for into, written in replacers.feature_writes(prompt.transcoders[layer], layer, ids,
                                                      values[start:start + count]):
            writes.append((into, position, start, written.T.to(prompt.errors.dtype)))  # (C, n)
        start += count
    return writes


def source_effects(prompt: Prompt, graph: AttributionGraph, writes: Writes, g_embed: Tensor,
                   g_layers: list[Tensor | None]) -> Tensor:
    """Gradients at the leaves (B, T, C each) -> each source's edge (B, F + L*T + T)."""
    batch = g_embed.shape[0]
    rows = g_embed.new_zeros(batch, graph.n_features + graph.n_errors + graph.n_pos)
    for layer, position, start, written in writes:
        g = g_layers[layer]
        if g is not None:  # None: no target reads past this layer's MLP
            rows[:, start:start + written.shape[1]] += g[:, position] @ written  # (B, n)
    for layer in range(prompt.n_layers):
        g = g_layers[layer]
        if g is not None:
            at = graph.error_index(layer, 0)
            rows[:, at:at + graph.n_pos] = (g * prompt.errors[layer]).sum(-1)  # (B, T)
    rows[:, graph.token_slice] = (g_embed * prompt.embed).sum(-1)  # (B, T)
    return rows
