"""One query token through one attention head, step by step, as views of one run's activations.

`head_steps` runs the model once (up to the head's layer) and reads every step at its hook
point: the residual stream entering the block, what attention reads, q, the keys it may see,
the scores the softmax took (`hook_attn_scores`: scaled, soft-capped and masked by the model
itself), the weights (`hook_pattern`), the head's output (`hook_z`), its slice of W_O and what
it adds to the residual stream. Nothing is computed a second way. The same run records, for
every step, the line of the model's code that called its hook point (`run_with_sources`), so a
reader sees where each number is made.
Notation: T = positions, C = width, H = heads, d = head width.
"""

from __future__ import annotations

import linecache
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from glassgpt import hooks
from glassgpt.errors import InputError
from glassgpt.hooks import lens_name, recorded
from glassgpt.interp.core import checks, hooked
from glassgpt.interp.core.cache import ActivationCache
from glassgpt.interp.core.hooked import NamesFilter, run_with_hooks, select_names
from glassgpt.model import GPT


@dataclass(frozen=True)
class SourceLine:
    """Where a step is computed: `file:line` inside `function`, and the line's text."""

    file: str
    line: int
    function: str
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.function}"


# Frames between a hook and the line that called the point: torch's module machinery, the
# point's own `__call__` (glassgpt/hooks.py) and the hook wrapper of glassgpt.interp.
_PLUMBING = (str(Path(torch.__file__).parent), str(Path(hooks.__file__)),
             str(Path(hooked.__file__)))


def _calling_line() -> SourceLine:
    """The line of glassgpt's code that called the hook point now running (the first frame
    outside torch's module machinery and the hook plumbing): the line that computes it."""
    frame = sys._getframe(2)  # past this function and the recording hook
    while frame is not None and frame.f_code.co_filename.startswith(_PLUMBING):
        frame = frame.f_back
    if frame is None:  # cannot happen for a point called from Python code; say so plainly
        return SourceLine("?", 0, "?", "")
    code = frame.f_code
    return SourceLine(Path(code.co_filename).name, frame.f_lineno,
                      getattr(code, "co_qualname", code.co_name),
                      linecache.getline(code.co_filename, frame.f_lineno).strip())


def run_with_sources(model: nn.Module, ids: Tensor, names: NamesFilter,
                     stop_at_layer: int | None = None
                     ) -> tuple[ActivationCache, dict[str, SourceLine]]:
    """`run_with_cache` that also keeps, for every point it reads, the line of attention.py /
    block.py / norms.py that called the point: the line computing that activation (found
    while the model runs, so renaming a variable there changes nothing here)."""
    selected = select_names(hooked.hook_points(model), names)
    store: dict[str, Tensor] = {}
    lines: dict[str, SourceLine] = {}

    def keep(tensor: Tensor, name: str) -> None:
        store[name] = tensor.detach()
        lines.setdefault(name, _calling_line())

    with torch.no_grad():
        run_with_hooks(model, ids, [(name, keep) for name in selected], stop_at_layer)
    return ActivationCache(store, ids=ids, model=model), lines


def step_points(block: nn.Module) -> dict[str, str]:
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
        # attn_only: no MLP follows, and the stream after attention leaves the block
        "residual_after": "hook_resid_mid" if block.ffn is not None else "hook_resid_post",
    }


def block_sources(model: GPT, ids: Tensor, layer: int,
                  points: dict[str, str]) -> tuple[ActivationCache, dict[str, SourceLine]]:
    """One run up to block `layer` reading `points` (step -> the point relative to the block):
    the cache of those points, by their full names, and the line that computes each step."""
    names = {step: lens_name(f"blocks.{layer}.{point}") for step, point in points.items()}
    cache, lines = run_with_sources(model, ids, sorted(set(names.values())),
                                    stop_at_layer=layer + 1)  # the later blocks add nothing
    return cache, {step: lines[name] for step, name in names.items()}


@dataclass(frozen=True)
class HeadSteps:
    """One query token through one attention head, with the model's own tensors.

    p = the query's position; keys and values are those of every position (only the visible
    ones are scored: 0..p when causal, the window's band on a local layer).
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
    scores: Tensor  # (T,) what the softmax took: q . k scaled and soft-capped, -inf if hidden
    visible: Tensor  # (T,) bool: the keys the causal mask (and a local layer's window) let p see
    weights: Tensor  # (T,) softmax over the visible scores, 0 elsewhere
    mixed: Tensor  # (d,) weights @ values: the head's output at p (`hook_z`)
    w_o: Tensor  # (d, C) the head's rows of W_O (proj.weight[:, h*d:(h+1)*d] transposed)
    contribution: Tensor  # (C,) mixed @ w_o: what this head adds to the residual stream
    sources: dict[str, SourceLine]


@torch.no_grad()
def head_steps(model: GPT, idx: Tensor, layer: int, head: int, position: int) -> HeadSteps:
    """Follow the token at `position` of idx (1, T) through `head` of `layer`: one run up to
    that layer, every step read at its hook point. The contributions of all heads plus W_O's
    bias add up to the attention's output."""
    if idx.dim() != 2 or idx.shape[0] != 1:
        raise InputError(f"head_steps follows one sequence: idx must be (1, T), got shape "
                         f"{tuple(idx.shape)}")
    config = model.config
    layer = checks.index("layer", layer, config.n_layer)
    head = checks.index("head", head, config.n_head)
    position = checks.index("position", position, idx.shape[1])
    block = model.blocks[layer]
    attn = block.attn
    points = step_points(block)
    # ln1's output, and QK-norm's after its gain, have no hook point of their own: they are
    # read from the same run, as the modules hand them on.
    normers = [m for m in (block.ln1 if block.pre_ln else None, attn.q_norm, attn.k_norm)
               if m is not None]
    with recorded(*normers) as outputs:
        cache, sources = block_sources(model, idx, layer, points)
    at = f"blocks.{layer}."
    kv_head, d, p = attn.kv_head_of(head), attn.head_dim, position
    x = cache[at + "hook_resid_pre"][0]  # (T, C)
    normed = outputs[0][0] if block.pre_ln else x  # (T, C)
    if attn.rotary is None and attn.q_norm is not None:  # q, k: QK-norm's (B, H, T, d)
        query, keys = outputs[-2][0, head, p], outputs[-1][0, kv_head]
    else:  # hook_q / hook_rot_q: (B, T, H, d)
        query, keys = cache[at + points["q"]][0, p, head], cache[at + points["keys"]][0, :, kv_head]
    scores = cache[at + "attn.hook_attn_scores"][0, head, p]  # (T,)
    mixed = cache[at + "attn.hook_z"][0, p, head]  # (d,)
    w_o = attn.proj.weight[:, head * d:(head + 1) * d].T  # (C, d) -> (d, C)
    return HeadSteps(layer, head, position, kv_head, x[p], normed[p], query, keys,
                     cache[at + "attn.hook_v"][0, :, kv_head], scores, scores != float("-inf"),
                     cache[at + "attn.hook_pattern"][0, head, p], mixed, w_o, mixed @ w_o, sources)
