"""Attention maps as the page draws them: a map's lower triangle (a key a local layer's window
hides is None, never a weight of 0), the keys the window hides, the range a map's colours span,
and thumbnails of a long prompt's maps. Notation: T = prompt tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from glassgpt.interp.methods.lens import hidden_keys
from glassgpt.view.values import DECIMALS, rounded


def lower_triangle(weights: Tensor, hidden: Tensor | None = None) -> list[list[float | None]]:
    """Causal attention (T, T) as its rows up to the diagonal: row i has i + 1 entries. Where
    `hidden` (T, T) is True (a local layer's keys outside its window) the entry is None: a key
    the query cannot see, never a weight of 0 (the page hatches it)."""
    rows = [row[:i + 1] for i, row in enumerate(rounded(weights))]
    if hidden is None:
        return rows
    for row, out in zip(rows, hidden.tolist(), strict=True):
        row[:] = [None if gone else value for value, gone in zip(row, out[:len(row)],
                                                                  strict=True)]
    return rows


def out_of_window(scores: Tensor, cells: int | None = None) -> Tensor | None:
    """(T, T) True where a layer's query could not see an earlier key (a local layer's keys W or
    more positions back), read from the layer's scores (T, T), -inf where the model's mask hid
    a key. Shrunk to (cells, cells) as `pooled` shrinks the maps, a cell is hidden only when its
    whole block is. None where no earlier key is hidden (a global layer, a window that holds
    the whole prompt)."""
    hidden = hidden_keys(scores).tril()  # (T, T): the future aside
    if not hidden.any():
        return None
    seen = (~hidden).float()  # (T, T): the band (and the future)
    if cells is not None and seen.shape[-1] > cells:
        seen = F.adaptive_avg_pool2d(seen[None, None], cells)[0, 0]  # (cells, cells)
    return seen == 0


def scale_of(values: Tensor) -> dict[str, float]:
    """The range a map's colours span (finite values only), for the page's legend."""
    finite = values[torch.isfinite(values)]
    if finite.numel() == 0:
        return {"min": 0.0, "max": 0.0}
    return {"min": round(float(finite.min()), DECIMALS), "max": round(float(finite.max()),
                                                                      DECIMALS)}


def pooled(maps: Tensor, cells: int) -> Tensor:
    """Attention maps (..., T, T) shrunk to at most (..., cells, cells) by averaging blocks of
    queries and summing blocks of keys, so each row of a thumbnail still sums to 1."""
    tokens = maps.shape[-1]  # T
    if tokens <= cells:
        return maps
    flat = maps.reshape(-1, 1, tokens, tokens)  # (N, 1, T, T)
    shrunk = F.adaptive_avg_pool2d(flat, cells)  # (N, 1, cells, cells): block means
    shrunk = shrunk / shrunk.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    return shrunk.reshape(*maps.shape[:-2], cells, cells)
