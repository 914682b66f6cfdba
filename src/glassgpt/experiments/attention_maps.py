"""Attention maps of a trained model for a prompt: every layer and head on one grid.

Notation: L = layers, H = heads, T = prompt tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from glassgpt.errors import InputError
from glassgpt.experiments.figures import new_figure, save_figure
from glassgpt.model import GPT
from glassgpt.tokenizers import Tokenizer

PANEL_INCHES = 2.4
VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥"}


def token_labels(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """One printable axis label per token: whitespace made visible, long tokens shortened."""
    labels = []
    for token_id in ids:
        text = tokenizer.decode([token_id])
        text = "".join(VISIBLE.get(ch, ch) for ch in text)
        labels.append(text if len(text) <= 8 else text[:7] + "…")
    return labels


def prompt_attention(model: GPT, tokenizer: Tokenizer, prompt: str) -> tuple[Tensor, list[str]]:
    """The attention weights (L, H, T, T) of `model` on `prompt`, and one label per token."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise InputError("the prompt is empty: give at least one token of text")
    idx = torch.tensor([ids], dtype=torch.long, device=model.lm_head.weight.device)  # (1, T)
    maps = model.attention_maps(idx)  # L x (1, H, T, T)
    return torch.stack([m[0] for m in maps]).float().cpu(), token_labels(tokenizer, ids)


def select_panels(weights: Tensor, layer: int | None, head: int | None) -> list[tuple[int, int]]:
    """(layer, head) pairs to draw: all of them, or one layer / one head / one panel."""
    L, H = weights.shape[:2]
    if layer is not None and not 0 <= layer < L:
        raise InputError(f"layer {layer} does not exist: the model has layers 0..{L - 1}")
    if head is not None and not 0 <= head < H:
        raise InputError(f"head {head} does not exist: the model has heads 0..{H - 1}")
    layers = range(L) if layer is None else [layer]
    heads = range(H) if head is None else [head]
    return [(lay, h) for lay in layers for h in heads]


def draw_attention_grid(weights: Tensor, labels: list[str], path: Path, layer: int | None = None,
                        head: int | None = None, title: str = "") -> Path:
    """Draw weights (L, H, T, T) as a grid, one row per layer, one column per head.

    Queries run down each panel and keys across, so row t shows where token t looked; the
    upper triangle is empty because the model is causal.
    """
    panels = select_panels(weights, layer, head)
    rows = sorted({lay for lay, _ in panels})
    cols = sorted({h for _, h in panels})
    T = len(labels)
    fontsize = max(4.0, min(8.0, 160.0 / max(T, 1)))
    rotation = 0 if all(len(label) == 1 for label in labels) else 90  # characters stand upright
    fig = new_figure(PANEL_INCHES * len(cols) + 1.0, PANEL_INCHES * len(rows) + 0.6)
    axes = fig.subplots(len(rows), len(cols), squeeze=False)
    for i, lay in enumerate(rows):
        for j, h in enumerate(cols):
            ax = axes[i][j]
            image = ax.imshow(weights[lay, h].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {lay}, head {h}", fontsize=8)
            ax.set_xticks(range(T))
            ax.set_yticks(range(T))
            ax.tick_params(length=0, labelsize=fontsize)
            # Token labels on the outer edge of the grid only: queries left, keys below.
            ax.set_yticklabels(labels if j == 0 else [])
            ax.set_xticklabels(labels if i == len(rows) - 1 else [], rotation=rotation)
    fig.colorbar(image, ax=axes, shrink=0.5, label="attention weight")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
