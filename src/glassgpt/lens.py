"""Looking inside a GPT for one input: attention maps, next-token top-k and the logit lens.

The logit lens (nostalgebraist, 2020) reads the residual stream after every layer with the
model's own read-out, the final LayerNorm and the tied LM head, as if the stack ended there.
Where the top tokens of those early read-outs start to agree with the model's final answer is
where the layers have formed it.

Everything here is plain torch on the public parts of `GPT` (`embed`, `blocks`, `ln_f`,
`lm_head`); `glassgpt view` serves these results as JSON, and they work the same from Python.
Notation: B = batch, T = positions, C = width, V = vocabulary, L = layers, H = heads,
k = how many top tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassgpt.attention import MultiHeadSelfAttention
from glassgpt.block import FeedForward
from glassgpt.errors import InputError
from glassgpt.model import GPT, count_parameters

PARAMETER_PARTS = ("embeddings", "attention", "ffn", "layernorm", "lm_head")


@dataclass(frozen=True)
class TopK:
    """The k most likely tokens of each distribution, most likely first: both (..., k)."""

    probs: Tensor
    ids: Tensor

    def __getitem__(self, index: int | slice | tuple) -> TopK:
        return TopK(self.probs[index], self.ids[index])


@dataclass(frozen=True)
class Trace:
    """One forward pass, kept: the residual stream and the attention weights of every layer."""

    residuals: Tensor  # (L + 1, B, T, C): after the embeddings, then after each block
    attention: Tensor  # (L, B, H, T, T): queries down, keys across; rows sum to 1


@torch.no_grad()
def trace(model: GPT, idx: Tensor) -> Trace:
    """Run `model` on idx (B, T) in eval mode (no dropout), keeping what each layer made."""
    model.check_tokens(idx)
    was_training = model.training
    model.eval()
    try:
        positions = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = model.embed(idx, positions)  # (B, T, C)
        residuals, maps = [x], []
        for block in model.blocks:
            x, weights = block(x, return_attn=True)  # (B, T, C), (B, H, T, T)
            residuals.append(x)
            maps.append(weights)
    finally:
        model.train(was_training)
    return Trace(torch.stack(residuals), torch.stack(maps))


def attention_maps(model: GPT, idx: Tensor) -> Tensor:
    """The attention weights of every layer and head for idx (B, T): (L, B, H, T, T)."""
    return torch.stack(model.attention_maps(idx))


@torch.no_grad()
def read_out(model: GPT, x: Tensor) -> Tensor:
    """Residual stream x (..., C) -> logits (..., V) through the model's final LayerNorm and
    LM head: what the model would predict if its stack ended at x."""
    return model.lm_head(model.ln_f(x))


def logit_lens(model: GPT, idx: Tensor) -> Tensor:
    """Logits read out after the embeddings and after each block: (L + 1, B, T, V).

    The last entry is the model's own output (`model(idx)[0]`). It holds L + 1 full
    distributions; for a large vocabulary use `logit_lens_top_k`, which keeps only k tokens.
    """
    return read_out(model, trace(model, idx).residuals)


def top_k_probabilities(logits: Tensor, k: int) -> TopK:
    """The k most likely tokens of softmax(logits) along the last axis: (..., V) -> (..., k)."""
    if k <= 0:
        raise InputError(f"k must be a positive number of tokens, got {k}")
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = torch.topk(probs, min(k, logits.shape[-1]), dim=-1)
    return TopK(values, ids)


@torch.no_grad()
def next_token_top_k(model: GPT, idx: Tensor, k: int) -> TopK:
    """The model's k most likely next tokens at every position of idx (B, T): (B, T, k)."""
    model.check_tokens(idx)
    was_training = model.training
    model.eval()
    try:
        logits, _ = model(idx)  # (B, T, V)
    finally:
        model.train(was_training)
    return top_k_probabilities(logits, k)


def lens_top_k(model: GPT, residuals: Tensor, k: int) -> TopK:
    """The logit lens's k most likely tokens for residuals (L + 1, B, T, C): (L + 1, B, T, k).

    One layer at a time, so only one (B, T, V) block of logits exists at once.
    """
    per_layer = [top_k_probabilities(read_out(model, x), k) for x in residuals]
    return TopK(torch.stack([t.probs for t in per_layer]), torch.stack([t.ids for t in per_layer]))


def logit_lens_top_k(model: GPT, idx: Tensor, k: int) -> TopK:
    """`logit_lens` reduced to its k most likely tokens: (L + 1, B, T, k)."""
    return lens_top_k(model, trace(model, idx).residuals, k)


def parameter_counts(model: GPT) -> dict[str, int]:
    """Trainable parameters by part: embeddings (token and position; a tied LM head is the
    token embedding and counted there), attention, ffn, layernorm, and lm_head when untied.
    The parts add up to `count_parameters(model)`.
    """
    counts = dict.fromkeys(PARAMETER_PARTS, 0)
    seen: set[int] = set()

    def add(part: str, module: nn.Module) -> None:
        for param in module.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                counts[part] += param.numel()

    # Embeddings first, so a tied head's matrix is counted as the token embedding it is.
    add("embeddings", model.tok_emb)
    add("embeddings", model.pos_emb)
    for module in model.modules():
        if isinstance(module, MultiHeadSelfAttention):
            add("attention", module)
        elif isinstance(module, FeedForward):
            add("ffn", module)
        elif isinstance(module, nn.LayerNorm):
            add("layernorm", module)
    add("lm_head", model.lm_head)
    left = count_parameters(model) - sum(counts.values())
    if left:  # a part this function does not know of: say so rather than miscount
        counts["other"] = left
    return counts
