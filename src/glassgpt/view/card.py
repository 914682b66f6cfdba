"""The model card's counts and layers, as the page describes them: parameters by part, and
each layer's attention (local or global, its rotary base), read from the modules; a LoRA
fine-tune's adapters, and the training (its settings and loss curve), read from what its run
recorded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import nn

from glassgpt.errors import CheckpointError
from glassgpt.model import GPT, count_parameters
from glassgpt.rundir.checkpoint import read_run_config
from glassgpt.training.metrics import read_metrics

PARAMETER_PARTS = ("embeddings", "attention", "ffn", "norm", "lm_head")
CURVE_POINTS = 500  # training-loss points sent for the card's curve (evaluations all kept)


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

    def add(part: str, module: nn.Module | None) -> None:
        if module is None:  # a part this model does without (attn_only: no MLP, no ln2)
            return
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
            add("norm", norm)  # the post norms exist with `post_norms` only (Gemma)
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


def run_lora_card(run_dir: Path | None) -> dict[str, Any] | None:
    """`lora_card` of the run in `run_dir` (the run's weights have the adapters merged); None
    without a run, or where its config.json cannot be read."""
    try:
        return None if run_dir is None else lora_card(read_run_config(run_dir))
    except CheckpointError:
        return None


def training_card(run_dir: Path | None) -> dict[str, Any]:
    """The run's training: its settings from config.json and its loss curve from metrics.jsonl
    (at most CURVE_POINTS steps; every evaluation), and its best val loss."""
    if run_dir is None:
        return {"settings": None, "iterations": None, "best_val_loss": None,
                "best_val_iter": None, "train": [], "eval": []}
    records = read_metrics(run_dir)
    steps = [[r["iter"], r["loss"]] for r in records if _is_finite(r.get("loss"))]
    evals = [[r["iter"], r["train_loss"], r["val_loss"]] for r in records
             if _is_finite(r.get("train_loss")) and _is_finite(r.get("val_loss"))]
    # The run keeps best weights from its first evaluation after step 0 on.
    best = min((e for e in evals if e[0] > 0), key=lambda e: e[2], default=None)
    return {"settings": _train_settings(run_dir),
            "iterations": max((r["iter"] for r in records), default=None),
            "best_val_loss": best[2] if best else None,
            "best_val_iter": best[0] if best else None,
            "train": thin(steps, CURVE_POINTS), "eval": evals}


def _train_settings(run_dir: Path) -> dict[str, Any] | None:
    try:
        return read_run_config(run_dir).get("train")
    except CheckpointError:
        return None


def _is_finite(value: Any) -> bool:
    """A finite int or float (metrics.jsonl is written by the trainer, but read with care)."""
    return _number(value) and math.isfinite(value)


def thin(points: list[list[float]], most: int) -> list[list[float]]:
    """At most `most` of `points`, evenly spread, always keeping the last one."""
    if len(points) <= most:
        return points
    step = len(points) / most
    kept = [points[int(i * step)] for i in range(most - 1)]
    return [*kept, points[-1]]
