"""The logit lens, the next-token top-k and the attention of every layer, read from one run.

The logit lens (nostalgebraist, 2020) reads the residual stream after every layer with the
model's own read-out, the final norm (LayerNorm or RMSNorm) and the LM head, as if the stack
ended there. Where the top tokens of those early read-outs start to agree with the model's final
answer is where the layers have formed it.

Every activation here is the model's own, taken at its hook point from one run
(`run_with_hooks`): the residual stream (`hook_resid_pre`, `hook_resid_post`), the attention
weights (`hook_pattern`) and the scores before the softmax (`hook_attn_scores`). An `Ablation`
switches heads, or a layer's attention or MLP, off for that run, by hooks as well.
Notation: B = batch, T = positions, C = width, V = vocabulary, L = layers, H = heads,
k = how many top tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from glassgpt.errors import InputError
from glassgpt.interp.core import checks
from glassgpt.interp.core.hooked import HookFn, run_with_hooks, zero_heads
from glassgpt.model import GPT, eval_mode


@dataclass(frozen=True)
class TopK:
    """The k most likely tokens of each distribution, most likely first: both (..., k)."""

    probs: Tensor
    ids: Tensor

    def __getitem__(self, index: int | slice | tuple) -> TopK:
        return TopK(self.probs[index], self.ids[index])


@dataclass(frozen=True)
class Trace:
    """One forward pass, kept: the residual stream and the attention of every layer."""

    residuals: Tensor  # (L + 1, B, T, C): after the embeddings, then after each block
    attention: Tensor  # (L, B, H, T, T): queries down, keys across; rows sum to 1
    scores: Tensor  # (L, B, H, T, T): what each softmax took; -inf where a key is hidden


@dataclass(frozen=True)
class Ablation:
    """Parts of the model switched off for a forward pass.

    `heads`: (layer, head) pairs whose output is zeroed before W_O mixes the heads (what the
    head would add to the residual stream is gone; W_O's bias, shared by all heads, stays).
    `attention`, `mlp`: layers whose whole attention or MLP output is zeroed, so the residual
    stream passes that sub-layer unchanged (Pre-LN; a Post-LN block still normalises it).
    """

    heads: frozenset[tuple[int, int]] = frozenset()
    attention: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        # Any iterables in, sets kept: the same switches given in any order are one ablation.
        # Integers only: int() would take layer 1.7 or True for layer 1 without a word.
        object.__setattr__(self, "heads", frozenset(_layer_and_head(pair) for pair in self.heads))
        for part in ("attention", "mlp"):
            layers = frozenset(checks.integer(f"a layer of {part}", l) for l in getattr(self, part))
            object.__setattr__(self, part, layers)

    def __bool__(self) -> bool:
        return bool(self.heads or self.attention or self.mlp)

    def check(self, model: GPT) -> None:
        """InputError naming the first layer or head that `model` does not have."""
        L, H = model.config.n_layer, model.config.n_head
        for layer in sorted({l for l, _ in self.heads} | self.attention | self.mlp):
            if not 0 <= layer < L:
                raise InputError(f"layer {layer} does not exist: the model has layers 0..{L - 1}")
        for layer, head in sorted(self.heads):
            if not 0 <= head < H:
                raise InputError(f"head {head} of layer {layer} does not exist: the model has "
                                 f"heads 0..{H - 1}")

    def hooks(self) -> list[tuple[str, HookFn]]:
        """The hooks that switch the parts off: one `hook_z` hook per layer with heads off
        (each head's output 0 before W_O), and the whole sub-layer's output, `hook_attn_out` or
        `hook_mlp_out`, replaced by zeros."""
        by_layer: dict[int, list[int]] = {}
        for layer, head in sorted(self.heads):
            by_layer.setdefault(layer, []).append(head)
        return [*((f"blocks.{layer}.attn.hook_z", zero_heads(*heads))
                  for layer, heads in by_layer.items()),
                *((f"blocks.{layer}.hook_attn_out", _zeros) for layer in sorted(self.attention)),
                *((f"blocks.{layer}.hook_mlp_out", _zeros) for layer in sorted(self.mlp))]


def _layer_and_head(pair: Any) -> tuple[int, int]:
    if isinstance(pair, str | bytes) or not hasattr(pair, "__len__") or len(pair) != 2:
        raise InputError(f"each of heads must be a (layer, head) pair, got {pair!r:.40}")
    return checks.integer("a layer of heads", pair[0]), checks.integer("a head", pair[1])


def _zeros(output: Tensor, name: str) -> Tensor:
    return torch.zeros_like(output)


def _keeping(store: dict[str, Tensor]) -> Callable[[Tensor, str], None]:
    def keep(tensor: Tensor, name: str) -> None:
        store[name] = tensor.detach()
    return keep


@torch.no_grad()
def trace(model: GPT, idx: Tensor, ablation: Ablation | None = None) -> Trace:
    """Run `model` on idx (B, T) once in eval mode (no dropout), keeping the residual stream,
    the weights and the scores of every layer from their hook points; with `ablation`, with
    those parts switched off. The stack only: the LM head does not run."""
    if ablation:
        ablation.check(model)
    model.check_tokens(idx)
    L = model.config.n_layer
    streams = ["blocks.0.hook_resid_pre", *(f"blocks.{l}.hook_resid_post" for l in range(L))]
    patterns = [f"blocks.{l}.attn.hook_pattern" for l in range(L)]
    scores = [f"blocks.{l}.attn.hook_attn_scores" for l in range(L)]
    store: dict[str, Tensor] = {}
    keep = _keeping(store)
    hooks = [*(ablation.hooks() if ablation else []),  # first: what is kept is the ablated run
             *((name, keep) for name in (*streams, *patterns, *scores))]
    run_with_hooks(model, idx, hooks, stop_at_layer=L)
    return Trace(torch.stack([store[n] for n in streams]),
                 torch.stack([store[n] for n in patterns]),
                 torch.stack([store[n] for n in scores]))


def attention_maps(model: GPT, idx: Tensor) -> Tensor:
    """The attention weights of every layer and head for idx (B, T): (L, B, H, T, T)."""
    return trace(model, idx).attention


def hidden_keys(scores: Tensor) -> Tensor:
    """Scores (..., T, S) from a trace -> (..., T, S) True where the model's mask hid the key
    from the query (its score is -inf): the future, and on a local layer the keys outside its
    window. Read from the model's own scores, so no reader restates the window rule."""
    return scores == float("-inf")


@torch.no_grad()
def read_out(model: GPT, x: Tensor) -> Tensor:
    """Residual stream x (..., C) -> logits (..., V) through the model's final norm and
    LM head: what the model would predict if its stack ended at x."""
    if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[-1] != model.config.n_embd:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise InputError(f"read_out takes a residual stream (..., C) with C = "
                         f"{model.config.n_embd}, this model's width; got {shape}")
    return model.read_out(x)  # ln_f, lm_head and the logit soft-cap, as the model's forward


def logit_lens(model: GPT, idx: Tensor) -> Tensor:
    """Logits read out after the embeddings and after each block: (L + 1, B, T, V).

    The last entry is the model's own output (`model(idx)[0]`). It holds L + 1 full
    distributions; for a large vocabulary use `logit_lens_top_k`, which keeps only k tokens.
    """
    return read_out(model, trace(model, idx).residuals)


def top_k_probabilities(logits: Tensor, k: int) -> TopK:
    """The k most likely tokens of softmax(logits) along the last axis: (..., V) -> (..., k).

    The top k of the logits, each minus the row's logsumexp: the same numbers as the softmax's
    top k without writing a second (..., V) tensor of probabilities."""
    k = checks.count("k", k)
    wide = logits.float()
    values, ids = torch.topk(wide, min(k, logits.shape[-1]), dim=-1)  # (..., k)
    return TopK((values - torch.logsumexp(wide, dim=-1, keepdim=True)).exp(), ids)


@torch.no_grad()
def next_token_top_k(model: GPT, idx: Tensor, k: int) -> TopK:
    """The model's k most likely next tokens at every position of idx (B, T): (B, T, k)."""
    k = checks.count("k", k)
    model.check_tokens(idx)
    with eval_mode(model):
        logits, _ = model(idx)  # (B, T, V)
    return top_k_probabilities(logits, k)


LENS_ROWS = 256  # residual rows read out at once: (256, V) logits, 155 MB for Qwen3's vocabulary


def lens_top_k(model: GPT, residuals: Tensor, k: int) -> TopK:
    """The logit lens's k most likely tokens for residuals (L + 1, B, T, C): (L + 1, B, T, k).

    Every layer's rows go through the LM head together, LENS_ROWS at a time: one large
    product reads the head's V x C weights once per chunk, where a product per layer read them
    L + 1 times (a 0.6B model's lens of 32 positions: 7.1 s layer by layer, 3.6 s so).
    """
    k = checks.count("k", k)
    residuals = checks.residuals_of(model.config, residuals)
    rows = residuals.reshape(-1, residuals.shape[-1])  # ((L + 1) * B * T, C)
    parts = [top_k_probabilities(read_out(model, rows[i:i + LENS_ROWS]), k)
             for i in range(0, rows.shape[0], LENS_ROWS)]
    shape = (*residuals.shape[:-1], -1)  # (L + 1, B, T, k)
    return TopK(torch.cat([t.probs for t in parts]).view(shape),
                torch.cat([t.ids for t in parts]).view(shape))


def logit_lens_top_k(model: GPT, idx: Tensor, k: int) -> TopK:
    """`logit_lens` reduced to its k most likely tokens: (L + 1, B, T, k)."""
    return lens_top_k(model, trace(model, idx).residuals, k)


@torch.no_grad()
def prompt_loss(model: GPT, seen: Trace, idx: Tensor) -> float | None:
    """Mean cross-entropy of predicting each next token of idx (B, T) from the trace's last
    residual stream (the model's own logits); None for a one-token prompt (nothing to predict)."""
    model.check_tokens(idx)
    if not isinstance(seen, Trace):
        raise InputError(f"prompt_loss takes the Trace of `trace(model, idx)`, got "
                         f"{type(seen).__name__}")
    checks.residuals_of(model.config, seen.residuals, idx)
    if idx.shape[1] < 2:
        return None
    logits = read_out(model, seen.residuals[-1][:, :-1])  # (B, T - 1, V)
    return float(F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten()))
