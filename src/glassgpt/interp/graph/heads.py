"""Which heads carry an edge: `edge_heads`.

An edge between two positions travels through attention (a head moves what the source wrote
from the source's position to another); one within a position may also take the residual
connection alone. In the frozen replacement model everything is linear, so the part of the edge
that passes through head (l, h) is exact:
    share(l, h) = sum over positions q of  g[l, q, h] . d[l, q, h]
g the gradient of the target's input at the head's output (hook_result), d the change in that
output the source makes (its output minus its output with the source removed). A path through
two heads counts for both, so shares sum to the edge only where each path crosses one head;
`direct` is the part that takes no head at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glassgpt.errors import InputError
from glassgpt.interp.graph.replacement import (
    FrozenRun,
    Prompt,
    feature_inputs,
    frozen_run,
    logit_inputs,
)
from glassgpt.interp.graph.result import AttributionGraph


@dataclass
class EdgeHeads:
    """An edge's weight, its part through no head, and each head's share (n_layers, n_heads)."""

    weight: float
    direct: float
    shares: torch.Tensor

    def top(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The k heads with the largest shares by magnitude, as (layer, head, share)."""
        flat = self.shares.flatten()
        order = flat.abs().argsort(descending=True)[:k]
        n_heads = self.shares.shape[1]
        return [(int(i) // n_heads, int(i) % n_heads, float(flat[i])) for i in order]


def edge_heads(prompt: Prompt, graph: AttributionGraph, target: int, source: int) -> EdgeHeads:
    """How the edge source -> target (node indices of `graph`, read from `prompt`) splits over
    the heads (see the module docstring)."""
    target_kind = graph.node(target)["kind"]
    if target_kind not in ("feature", "logit"):
        raise InputError(f"node {target} is a{'n' if target_kind == 'error' else ''} "
                         f"{target_kind}: only features and logits have edges in")
    if graph.node(source)["kind"] == "logit":
        raise InputError(f"node {source} is a logit: logits have no edges out")
    clean = frozen_run(prompt, keep_results=True)
    value = target_input(prompt, graph, clean, target)
    gradients = zeros_for_unused(torch.autograd.grad(value, clean.results, retain_graph=True,
                                                     allow_unused=True), clean.results)
    without = frozen_run(prompt, keep_results=True, **removed(prompt, graph, source))
    shares = torch.stack([((g * (with_ - without_)).sum((0, 1, 3))).detach()  # (H,) a layer
                          for g, with_, without_ in zip(gradients, clean.results,
                                                        without.results, strict=True)])
    still = frozen_run(prompt, heads_frozen=True)  # only the residual connections carry
    leaves = [still.embed, *(leaf for leaf in still.mlp_out if leaf is not None)]
    grads = zeros_for_unused(torch.autograd.grad(target_input(prompt, graph, still, target),
                                                 leaves, allow_unused=True), leaves)
    wrote = [clean.embed - without.embed,
             *(a - b for a, b in zip(clean.mlp_out, without.mlp_out, strict=True)
               if a is not None)]  # what the source wrote where it writes, (1, T, C) each
    direct = sum(float((g * w.detach()).sum()) for g, w in zip(grads, wrote, strict=True))
    weight = graph.adjacency_matrix[target, source]
    return EdgeHeads(float(weight), direct, shares.cpu())


def zeros_for_unused(grads: tuple, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """autograd's gradients with None (the target does not depend on it: a later layer) as 0."""
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True)]


def target_input(prompt: Prompt, graph: AttributionGraph, run: FrozenRun, target: int
                 ) -> torch.Tensor:
    """The target node's input in copy 0 of the run: a pre-activation or a demeaned logit."""
    node, row = graph.node(target), torch.zeros(1, dtype=torch.long)
    if node["kind"] == "logit":
        return logit_inputs(run, row, torch.tensor([node["token"]]))[0]
    return feature_inputs(prompt, run, node["layer"], row, torch.tensor([node["position"]]),
                          torch.tensor([node["feature"]]))[0]


def removed(prompt: Prompt, graph: AttributionGraph, source: int) -> dict[str, object]:
    """frozen_run's arguments for the prompt with node `source` written as zero."""
    node = graph.node(source)
    position = node["position"]
    if node["kind"] == "feature":
        acts = [None if a is None else a.clone() for a in prompt.acts]
        acts[node["layer"]][position, node["feature"]] = 0
        return {"acts": acts}
    if node["kind"] == "error":
        errors = prompt.errors.clone()
        errors[node["layer"], position] = 0
        return {"errors": errors}
    embed = prompt.embed.clone()
    embed[position] = 0
    return {"embed": embed}
