"""The model card's counts and layers, as the page describes them: parameters by part, and
each layer's attention (local or global, its rotary base). Read from the modules, no run.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from glassgpt.model import GPT, count_parameters

PARAMETER_PARTS = ("embeddings", "attention", "ffn", "norm", "lm_head")


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
