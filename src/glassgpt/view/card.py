"""The model card's counts and layers, as the page describes them: parameters by part, and
each layer's attention (local or global, its rotary base), read from the modules; and a LoRA
fine-tune's adapters, read from what its run recorded.
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


def lora_card(run_config: dict[str, Any]) -> dict[str, Any] | None:
    """A LoRA fine-tune's adapters as its config.json records them: rank, alpha, their scale
    alpha / rank, dropout and targets; None for a run tuned without LoRA (or not at all), or
    a record that is not one (the card shows what it can, and never fails on it)."""
    extra = run_config.get("extra")
    lora = extra.get("lora") if isinstance(extra, dict) else None
    if not isinstance(lora, dict):
        return None
    rank, alpha = lora.get("rank"), lora.get("alpha")
    dropout, targets = lora.get("dropout", 0.0), lora.get("targets")
    if not (_number(rank) and rank > 0 and _number(alpha) and isinstance(targets, list)):
        return None
    return {"rank": rank, "alpha": alpha, "scaling": alpha / rank,
            "dropout": dropout if _number(dropout) else None,
            "targets": [str(target) for target in targets]}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
