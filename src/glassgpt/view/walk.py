"""The page's "Inside one head" panel as JSON-ready values: one query token through one head,
step by step, with the model's numbers (`glassgpt.interp.methods.heads.head_steps`, read from one
run's hook points) and the lines that compute them.

The titles say what this layer really does: the scale the scores are multiplied by (1/sqrt(d),
or query_pre_attn_scalar's), the soft-cap when the config sets one, and on a local layer the
window of keys the query can see. Only the keys it sees are sent (a band on a local layer:
`first_key` says where it starts).
Notation: T = prompt tokens, C = width, d = head width, W = a local layer's window.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from glassgpt.attention import score_scale
from glassgpt.interp.core import checks
from glassgpt.interp.methods.heads import HeadSteps, head_steps
from glassgpt.view import causal
from glassgpt.view.values import Prompt, View, step_answer


def seen_keys(steps: HeadSteps) -> slice:
    """The keys the query can see, as a slice: 0..p when causal, the band p - W + 1..p on a
    local layer, every key otherwise (the visible keys are always one run)."""
    at = steps.visible.nonzero().flatten()
    return slice(int(at[0]), int(at[-1]) + 1)


def scores_title(attn: nn.Module) -> str:
    """q . k with the scale this attention uses, and the soft-cap after it when there is one."""
    d = attn.head_dim
    scalar = None if attn.scale is None else attn.scale ** -2  # query_pre_attn_scalar
    scaled = f"q . k / sqrt({d})" if scalar is None else \
        f"q . k / sqrt({scalar:g}) (query_pre_attn_scalar = d)" if round(scalar, 6) == d else \
        f"q . k / sqrt({scalar:g}) (query_pre_attn_scalar, in place of sqrt({d}))"
    if attn.softcap is None:
        return f"{scaled}: scaled scores"
    cap = f"{attn.softcap:g}"
    return f"{cap} * tanh(s / {cap}) of s = {scaled}: scaled, then soft-capped scores"


def mask_title(attn: nn.Module) -> str:
    if attn.window is None:
        return "causal mask: which keys it may see" if attn.causal else \
            "no mask: it sees every key"
    W = attn.window
    return (f"causal mask and sliding window (local layer, W = {W}): it sees itself and the "
            f"{W - 1} keys before it")


def contribution_title(block: nn.Module) -> str:
    if block.ln1_post is None:
        return "mixed @ W_O: what this head adds to the residual stream"
    return ("mixed @ W_O: this head's part of the attention output, before ln1_post "
            "normalises the heads' sum (post_norms)")


def table(view: View, prompt: Prompt, steps: HeadSteps, seen: slice
          ) -> list[tuple[str, str, Tensor]]:
    """(step, title, values) of every step, in the order the page shows them."""
    layer, head, d = steps.layer, steps.head, steps.q.shape[0]
    block = view.model.blocks[layer]
    attn = block.attn
    norm = type(block.ln1).__name__  # LayerNorm or RMSNorm
    after = [name for name, module in (("QK-norm", attn.q_norm), ("rotary", attn.rotary))
             if module is not None]
    turned = f", after {' and '.join(after)}" if after else ""
    stages = causal.qk_stages(view, prompt, layer, head, steps.position, seen)
    softmax = "softmax over the visible scores" + ("" if attn.window is None else
                                                   " (the window's keys only)")
    return [
        ("residual", "residual stream entering the block", steps.residual),
        ("normed", f"ln1(x) ({norm}): what attention reads" if block.pre_ln
         else "x itself (Post-LN: attention reads the residual stream)", steps.normed),
        *stages["q"],
        ("q", f"q: the query of head {head}{turned}", steps.q),
        *stages["k"],
        ("keys", f"k: the keys it can see (K/V head {steps.kv_head}){turned}", steps.keys[seen]),
        ("scores", scores_title(attn), steps.scores[seen]),
        ("mask", mask_title(attn), steps.visible),
        ("weights", softmax, steps.weights[seen]),
        ("values", f"v: the values it mixes (K/V head {steps.kv_head})", steps.values[seen]),
        ("mixed", "weights @ v: the head's output", steps.mixed),
        ("w_o", f"W_O rows {head * d}..{(head + 1) * d - 1}: this head's slice", steps.w_o),
        ("contribution", contribution_title(block), steps.contribution),
    ]


def head_answer(view: Any, prompt: str, layer: int, head: int, position: int
                ) -> dict[str, Any]:
    """One query token through one head, step by step (`inspector.RunView.head`): each step
    has its name, shape, values and the line of attention.py / block.py computing it."""
    config = view.model.config
    checks.index("layer", layer, config.n_layer)
    checks.index("head", head, config.n_head)
    encoded = view.encode(prompt)
    checks.index("position", position, len(encoded.ids))
    steps = head_steps(view.model, encoded.idx, layer, head, position)
    seen = seen_keys(steps)
    attn = view.model.blocks[layer].attn
    return {"layer": layer, "head": head, "position": position, "kv_head": steps.kv_head,
            "n_kv_head": attn.n_kv_head, "head_dim": steps.q.shape[0],
            "attention": "global" if attn.window is None else "local", "window": attn.window,
            "scale": score_scale(attn.head_dim, attn.scale), "softcap": attn.softcap,
            "first_key": seen.start,
            "steps": [step_answer(name, title, values, steps.sources[name])
                      for name, title, values in table(view, encoded, steps, seen)]}
