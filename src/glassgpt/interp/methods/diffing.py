"""Model diffing: what a fine-tune changed against the run it was tuned from.

    token_logprobs        each prompt token's log-probability under a model (tuned and base
                          side by side: what the tune made likelier, token by token)
    weight_changes        how far each layer's weights moved: ||W_tuned - W_base|| / ||W_base||
                          for each head's slices of the attention projections (q, k, v, o) and
                          each MLP
    other_changes         the parameters in neither (embeddings, norms, attention biases), each
                          by name
    head_output_changes   how far each head's output moved on a prompt: ||r_tuned - r_base|| /
                          ||r_base|| over its positions (hook_result, each head's share of
                          attn_out)

The two models must have the same shape (`check_comparable`: a fine-tune keeps it).
Notation: L = layers, H = query heads, C = width, d = head width, T = prompt tokens.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from glassgpt.errors import InputError
from glassgpt.formats.transformer_lens import output_weight, per_head
from glassgpt.interp.core.hooked import run_with_cache
from glassgpt.model import GPT

SHAPE_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "n_kv_head", "head_dim",
                "activation", "norm", "position", "attn_only")
PROJECTIONS = ("q", "k", "v", "o")
# The parameters weight_changes maps: every MLP's, and the attention's qkv and proj weights.
MAPPED = re.compile(r"blocks\.\d+\.(ffn\.|attn\.(qkv|proj)\.weight$)")


def check_comparable(tuned: GPT, base: GPT) -> None:
    """The base must have the tuned model's shape (a fine-tune keeps it)."""
    for field in SHAPE_FIELDS:
        if getattr(tuned.config, field) != getattr(base.config, field):
            raise InputError(f"the runs differ in {field} ({getattr(tuned.config, field)} here, "
                             f"{getattr(base.config, field)} in the base): compare a "
                             f"fine-tune with the run it was tuned from")


def token_logprobs(model: GPT, idx: Tensor) -> Tensor:
    """idx (1, T) -> log p(token t | tokens < t) for t = 1..T-1, (T - 1,)."""
    with torch.no_grad():
        logits, _ = model(idx)  # (1, T, V)
    logprobs = torch.log_softmax(logits[0, :-1].double(), -1)  # (T - 1, V)
    return logprobs.gather(1, idx[0, 1:, None])[:, 0]


def relative_change(after: Tensor, before: Tensor, dims: tuple[int, ...]) -> Tensor:
    """||after - before|| / ||before|| over `dims` (0 where before is all zeros)."""
    change = (after - before).double().square().sum(dims).sqrt()
    size = before.double().square().sum(dims).sqrt()
    return torch.where(size > 0, change / size.clamp(min=1e-30), change)


def weight_changes(tuned: GPT, base: GPT) -> dict[str, Tensor]:
    """Per layer and head, how far q, k, v and o moved ((L, H) each, heads of the query side:
    a K/V head shared by several query heads is counted for each), and per layer the MLP
    ((L, 1): all its matrices together)."""
    n_layer, n_head = tuned.config.n_layer, tuned.config.n_head
    maps = {name: torch.zeros(n_layer, n_head, dtype=torch.float64) for name in PROJECTIONS}
    maps["mlp"] = torch.zeros(n_layer, 1, dtype=torch.float64)
    for layer in range(n_layer):
        after, before = head_weights(tuned, layer), head_weights(base, layer)
        for name in PROJECTIONS:
            maps[name][layer] = relative_change(after[name], before[name], (1, 2))
        mlp_after, mlp_before = mlp_weights(tuned, layer), mlp_weights(base, layer)
        if mlp_before is not None:
            maps["mlp"][layer, 0] = relative_change(mlp_after, mlp_before, (0,))
    return maps


def head_weights(model: GPT, layer: int) -> dict[str, Tensor]:
    """Each query head's slices of its layer's projections: W_Q, W_K, W_V (H, C, d) and W_O
    (H, d, C) in TransformerLens's layout (a K/V head repeated for each query head it serves)."""
    attn = model.blocks[layer].attn
    with torch.no_grad():
        stored = {name: per_head(attn, name)[0] for name in ("q", "k", "v")}  # (heads, C, d)
        return {"q": stored["q"],
                **{name: stored[name].repeat_interleave(attn.groups, dim=0) for name in "kv"},
                "o": output_weight(attn)}


def mlp_weights(model: GPT, layer: int) -> Tensor | None:
    """Every weight of the layer's MLP, flattened into one vector (None: no MLP)."""
    mlp = model.blocks[layer].ffn  # None in an attn_only model
    if mlp is None:
        return None
    return torch.cat([p.detach().flatten() for p in mlp.parameters()])


def other_changes(tuned: GPT, base: GPT) -> list[dict[str, Any]]:
    """The parameters the maps leave out (embeddings, norms, the attention's biases and norms),
    each with its relative change, largest first; those that did not move are left out."""
    before = dict(base.named_parameters())
    moved = [{"name": name, "change": float(relative_change(p.detach(), before[name].detach(),
                                                            tuple(range(p.dim()))))}
             for name, p in tuned.named_parameters() if not MAPPED.match(name)]
    return sorted((m for m in moved if m["change"] > 0), key=lambda m: -m["change"])


def head_output_changes(tuned: GPT, base: GPT, idx: Tensor) -> Tensor:
    """(L, H): how far each head's output (hook_result) moved on the prompt idx (1, T)."""
    names = [f"blocks.{layer}.attn.hook_result" for layer in range(tuned.config.n_layer)]
    _, after = run_with_cache(tuned, idx, names)
    _, before = run_with_cache(base, idx, names)
    return torch.stack([relative_change(after[n][0], before[n][0], (0, 2)) for n in names])
