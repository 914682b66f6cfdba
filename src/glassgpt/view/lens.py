"""Looking inside a GPT for one input: attention maps, next-token top-k and the logit lens.

The logit lens (nostalgebraist, 2020) reads the residual stream after every layer with the
model's own read-out, the final norm (LayerNorm or RMSNorm) and the LM head, as if the stack
ended there. Where the top tokens of those early read-outs start to agree with the model's final
answer is where the layers have formed it.

Two more ways in: `head_steps` walks one query token through one attention head with the
model's own tensors (its residual input, the norm, q, the keys it sees, the scaled scores, the
mask, the softmax, the value mix, the head's slice of W_O and what it adds to the residual
stream), and `Ablation` switches heads, or a layer's attention or MLP, off for a forward pass,
so one can see what each part contributes to the prediction.

Everything here is plain torch on the public parts of `GPT` (`embed`, `blocks`, `ln_f`,
`lm_head`); `glassgpt view` serves these results as JSON, and they work the same from Python.
Notation: B = batch, T = positions, C = width, V = vocabulary, L = layers, H = heads,
d = head width, k = how many top tokens.
"""

from __future__ import annotations

import linecache
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt import hooks
from glassgpt.attention import (
    build_attention_mask,
    masked_softmax,
    repeat_kv,
    soft_cap,
)
from glassgpt.attention import score_scale as attention_score_scale
from glassgpt.block import TransformerBlock
from glassgpt.errors import InputError
from glassgpt.interp.hooked import attached, zero_heads
from glassgpt.model import GPT, count_parameters, eval_mode
from glassgpt.view import checks

PARAMETER_PARTS = ("embeddings", "attention", "ffn", "norm", "lm_head")


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

    def head_hooks(self) -> list[tuple[str, Callable]]:
        """One `hook_z` hook per layer with heads off: each head's output is 0 before W_O."""
        by_layer: dict[int, list[int]] = {}
        for layer, head in sorted(self.heads):
            by_layer.setdefault(layer, []).append(head)
        return [(f"blocks.{layer}.attn.hook_z", zero_heads(*heads))
                for layer, heads in by_layer.items()]


def _layer_and_head(pair: Any) -> tuple[int, int]:
    if isinstance(pair, str | bytes) or not hasattr(pair, "__len__") or len(pair) != 2:
        raise InputError(f"each of heads must be a (layer, head) pair, got {pair!r:.40}")
    return checks.integer("a layer of heads", pair[0]), checks.integer("a head", pair[1])


def _zero_output(module: nn.Module, args: tuple, output: Tensor | tuple) -> Tensor | tuple:
    """A forward hook that replaces a sub-layer's output (or the first of its outputs) by 0."""
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]), *output[1:])
    return torch.zeros_like(output)


@contextmanager
def layers_switched_off(model: GPT, ablation: Ablation | None) -> Iterator[GPT]:
    """`model` with the heads, the whole attention or the MLP of the layers `ablation` names
    returning zeros inside the `with` block (forward hooks), intact again after it, even on an
    error. The weights are never changed."""
    handles = []
    try:
        for layer, block in enumerate(model.blocks):
            if ablation and layer in ablation.attention:
                handles.append(block.attn.register_forward_hook(_zero_output))
            if ablation and layer in ablation.mlp:
                handles.append(block.ffn.register_forward_hook(_zero_output))
        with attached(model, ablation.head_hooks() if ablation else []):
            yield model
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def trace(model: GPT, idx: Tensor, ablation: Ablation | None = None) -> Trace:
    """Run `model` on idx (B, T) in eval mode (no dropout), keeping what each layer made;
    with `ablation`, with those parts switched off."""
    if ablation:
        ablation.check(model)
    residuals, maps = [], []
    with eval_mode(model), layers_switched_off(model, ablation):
        layers = model.layers(idx, return_attn=True)
        for depth, x, weights in layers:  # (B, T, C), (B, H, T, T)
            residuals.append(x)  # depth 0: the embeddings, then after each block
            if depth > 0:
                maps.append(weights)
    return Trace(torch.stack(residuals), torch.stack(maps))


def attention_maps(model: GPT, idx: Tensor) -> Tensor:
    """The attention weights of every layer and head for idx (B, T): (L, B, H, T, T)."""
    return torch.stack(model.attention_maps(idx))


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


# --- the loss on the prompt (what sampling draws from: glassgpt.decoding.sampling) ----------

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


# --- inside one head -----------------------------------------------------------------------

@dataclass(frozen=True)
class SourceLine:
    """Where a step is computed: `file:line` inside `function`, and the line's text."""

    file: str
    line: int
    function: str
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.function}"


def _calling_line() -> SourceLine:
    """The line of glassgpt's code that called the hook point now running (the first frame
    outside torch's module machinery and the point's own call): the line that computes it."""
    frame = sys._getframe(2)  # past this function and the recording hook
    while frame is not None and frame.f_code.co_filename.startswith(_PLUMBING):
        frame = frame.f_back
    if frame is None:  # cannot happen for a point called from Python code; say so plainly
        return SourceLine("?", 0, "?", "")
    code = frame.f_code
    return SourceLine(Path(code.co_filename).name, frame.f_lineno,
                      getattr(code, "co_qualname", code.co_name),
                      linecache.getline(code.co_filename, frame.f_lineno).strip())


# Frames between a hook and the line that called the point: torch's module machinery and the
# point's own `__call__` (glassgpt/hooks.py).
_PLUMBING = (str(Path(torch.__file__).parent), str(Path(hooks.__file__)))


def step_points(block: TransformerBlock) -> dict[str, str]:
    """Each step of `HeadSteps` -> the hook point (relative to the block) that the step's
    tensor passes through; q and k come last from rotary, or QK-norm, or the projection.
    Before them, `q_proj`/`k_proj` (the projection) and, with QK-norm, `q_normed`/`k_normed`
    (normalised, before the gain): the stages a learner sees q and k go through."""
    attn = block.attn
    last = "attn.hook_rot_{}" if attn.rotary is not None else \
        "attn.{}_norm.hook_normalized" if attn.q_norm is not None else "attn.hook_{}"
    stages = {}
    for part in ("q", "k"):
        stages[f"{part}_proj"] = f"attn.hook_{part}"
        if attn.q_norm is not None:
            stages[f"{part}_normed"] = f"attn.{part}_norm.hook_normalized"
    return {
        "residual": "hook_resid_pre",
        "normed": "ln1.hook_normalized" if block.pre_ln else "hook_resid_pre",
        **stages,
        "q": last.format("q"), "keys": last.format("k"), "values": "attn.hook_v",
        "scores": "attn.hook_attn_scores", "mask": "attn.hook_attn_scores",
        "weights": "attn.hook_pattern", "mixed": "attn.hook_z",
        "w_o": "hook_attn_out", "contribution": "hook_attn_out",
        "residual_after": "hook_resid_mid",
    }


def _step_sources(block: TransformerBlock, x: Tensor) -> dict[str, SourceLine]:
    """The line computing each step of `step_points` (see `point_sources`)."""
    return point_sources(block, x, step_points(block))


def point_sources(block: TransformerBlock, x: Tensor,
                  points: dict[str, str]) -> dict[str, SourceLine]:
    """Run `block` on x (1, T, C) once with a recorder on the hook point of every step
    (`points`: step -> the point's module path in the block): the line that called each point
    is the line of attention.py / block.py / norms.py that computes that step (renaming a
    variable there changes nothing here)."""
    modules = dict(block.named_modules())
    lines: dict[str, SourceLine] = {}
    handles = []
    for point in set(points.values()):
        def record(module, args, output, point=point):
            lines.setdefault(point, _calling_line())
        handles.append(modules[point].register_forward_hook(record))
    try:
        with torch.no_grad(), eval_mode(block):
            block(x)
    finally:
        for handle in handles:
            handle.remove()
    return {step: lines[point] for step, point in points.items()}


@dataclass(frozen=True)
class HeadSteps:
    """One query token through one attention head, with the model's own tensors.

    p = the query's position; keys and values are those it may see (0..p when causal).
    """

    layer: int
    head: int
    position: int
    kv_head: int  # the K/V head this query head reads (itself unless heads share K/V)
    residual: Tensor  # (C,) the residual stream entering the block at position p
    normed: Tensor  # (C,) what the attention reads: ln1(residual) in Pre-LN, residual in Post-LN
    q: Tensor  # (d,)
    keys: Tensor  # (T, d) every position's key (only the visible ones are scored)
    values: Tensor  # (T, d)
    scores: Tensor  # (T,) q . k scaled (and soft-capped) as the model does; where `visible`
    visible: Tensor  # (T,) bool: the keys the causal mask (and a local layer's window) let p see
    weights: Tensor  # (T,) softmax over the visible scores, 0 elsewhere
    mixed: Tensor  # (d,) weights @ values: the head's output at p
    w_o: Tensor  # (d, C) the head's rows of W_O (proj.weight[:, h*d:(h+1)*d] transposed)
    contribution: Tensor  # (C,) mixed @ w_o: what this head adds to the residual stream
    sources: dict[str, SourceLine]


@torch.no_grad()
def head_steps(model: GPT, idx: Tensor, layer: int, head: int, position: int,
               residuals: Tensor | None = None) -> HeadSteps:
    """Follow the token at `position` of idx (1, T) through `head` of `layer`.

    `residuals` (L + 1, 1, T, C) from an earlier `trace` of idx saves running the model again.
    The numbers are recomputed from the block's own modules and functions, step by step; the
    contributions of all heads plus W_O's bias add up to the attention's output.
    """
    if idx.dim() != 2 or idx.shape[0] != 1:
        raise InputError(f"head_steps follows one sequence: idx must be (1, T), got shape "
                         f"{tuple(idx.shape)}")
    config, T = model.config, idx.shape[1]
    layer = checks.index("layer", layer, config.n_layer)
    head = checks.index("head", head, config.n_head)
    position = checks.index("position", position, T)
    if residuals is None:
        residuals = trace(model, idx).residuals
    checks.residuals_of(config, residuals, idx)
    block: TransformerBlock = model.blocks[layer]
    attn = block.attn
    with eval_mode(model):
        x = residuals[layer]  # (1, T, C)
        normed = block.ln1(x) if block.pre_ln else x  # (1, T, C)
        q, k, v = attn.project(normed)  # (1, H, T, d), (1, KV, T, d) x 2
        sources = _step_sources(block, x)
    kv_head = attn.kv_head_of(head)
    d = attn.head_dim
    query, keys, values = q[0, head, position], k[0, kv_head], v[0, kv_head]  # (d,), (T, d) x 2
    scores = capped(attn, (keys @ query) * score_scale(attn))  # (T,)
    mask = visible_keys(attn, T, idx.device)  # (1, 1, T, T) or None
    visible = torch.ones(T, dtype=torch.bool, device=idx.device) if mask is None \
        else mask[0, 0, position]  # (T,)
    weights = masked_softmax(scores, visible)  # (T,)
    mixed = weights @ values  # (d,)
    w_o = attn.proj.weight[:, head * d:(head + 1) * d].T  # (C, d) -> (d, C)
    return HeadSteps(layer, head, position, kv_head, x[0, position], normed[0, position], query,
                     keys, values, scores, visible, weights, mixed, w_o, mixed @ w_o, sources)


@torch.no_grad()
def attention_scores(model: GPT, residuals: Tensor, layer: int) -> Tensor:
    """The scaled scores q . k / sqrt(d) of every head of `layer` before the softmax (scaled by
    query_pre_attn_scalar and soft-capped where the config says so): (B, H, T, T), from
    residuals (L + 1, B, T, C) of a `trace`. Masked entries, the future and on a local layer
    the keys W or more positions back, are -inf (what the softmax gets)."""
    layer = checks.index("layer", layer, model.config.n_layer)
    checks.residuals_of(model.config, residuals)
    block: TransformerBlock = model.blocks[layer]
    attn = block.attn
    x = residuals[layer]  # (B, T, C)
    with eval_mode(model):
        q, k, _ = attn.project(block.ln1(x) if block.pre_ln else x)
    k = repeat_kv(k, attn.groups)  # (B, KV, T, d) -> (B, H, T, d)
    scores = capped(attn, (q @ k.transpose(-2, -1)) * score_scale(attn))  # (B, H, T, T)
    mask = visible_keys(attn, x.shape[1], x.device)
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def score_scale(attn: nn.Module) -> float:
    """What q . k is multiplied by in this attention: 1/sqrt(d), or query_pre_attn_scalar
    ** -0.5 where the config sets it (Gemma; `attn.scale`)."""
    return attention_score_scale(attn.head_dim, attn.scale)


def capped(attn: nn.Module, scores: Tensor) -> Tensor:
    """Scaled scores through the attention's soft-cap, where the config sets one
    (`attn_softcap`); before the mask, as the model does."""
    return soft_cap(scores, attn.softcap)


def visible_keys(attn: nn.Module, T: int, device: torch.device) -> Tensor | None:
    """(1, 1, T, T) True where a query of `attn` may see a key: the causal mask, cut to the
    band of the sliding window on a local layer (`attn.window`); None when every key is seen."""
    return build_attention_mask(T, T, attn.causal, None, device, attn.window)


def layer_kinds(model: GPT) -> list[dict[str, Any]]:
    """Each layer's attention as the page describes it: local (a sliding window of W keys)
    or global, and the rotary base its q and k turn by (None: no rotation in that layer)."""
    kinds = []
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        rotary = attn.rotary.theta if attn.rotary is not None else None
        kinds.append({"layer": layer, "attention": "global" if attn.window is None else "local",
                      "window": attn.window, "rope_theta": rotary})
    return kinds


def parameter_counts(model: GPT) -> dict[str, int]:
    """Trainable parameters by part: embeddings (token and position; a tied LM head is the
    token embedding and counted there), attention (QK-norm gains included), ffn, norm (the
    blocks' LayerNorm or RMSNorm and the final one), and lm_head when untied.
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
    if model.pos_emb is not None:  # None with rotary or no positions
        add("embeddings", model.pos_emb)
    for block in model.blocks:
        add("attention", block.attn)
        add("ffn", block.ffn)
        for norm in (block.ln1, block.ln2, block.ln1_post, block.ln2_post):
            if norm is not None:  # the post norms exist with `post_norms` only (Gemma)
                add("norm", norm)
    add("norm", model.ln_f)
    add("lm_head", model.lm_head)
    left = count_parameters(model) - sum(counts.values())
    if left:  # a part this function does not know of: say so rather than miscount
        counts["other"] = left
    return counts
