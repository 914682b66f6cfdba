"""Walk one forward pass of multi-head attention by hand, recording every step's shape.

The walk uses the weights of a real `MultiHeadSelfAttention` and ends by checking that its output
and weights equal what the module itself returns, so the walk is the module, not a story about it.
Notation: B = batch, T = positions, C = width, H = heads, d = C / H.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.attention import MultiHeadSelfAttention, check_heads_divide_width
from glassgpt.errors import ConfigError
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.figures import (
    MASKED_NOTE,
    SUPTITLE_PT,
    grid_shape,
    label_axes,
    labelled_colorbar,
    new_figure,
    save_figure,
    show_attention,
    text_height,
    wrap_title,
)
from glassgpt.hooks import recorded

EXACT = 1e-6  # float32 walk vs module: the same operations in the same order
PANEL_INCHES = 2.2
MAX_COLUMNS = 4  # heads per row of the picture
MAX_TICKS = 10  # a longer sequence labels every 2nd, 3rd, ... position


def walk_attention(attn: MultiHeadSelfAttention, x: Tensor) -> tuple[list[tuple], Tensor, Tensor]:
    """Recompute attn(x) step by step. Returns ([(step, code, tensor, note)], y, weights)."""
    B, T, C = x.shape
    H, d = attn.n_heads, attn.head_dim
    steps = [("input", "x", x, "B sequences of T positions, C features each")]

    def record(step: str, code: str, tensor: Tensor, note: str) -> Tensor:
        steps.append((step, code, tensor, note))
        return tensor

    qkv = record("project to Q, K, V", "qkv(x)", attn.qkv(x), "one Linear(C, 3C) for all three")
    q, k, v = qkv.split(C, dim=2)
    record("split Q | K | V", "qkv.split(C, dim=2)", q, "three (B, T, C) tensors, in that order")
    record("heads as a dimension", "q.view(B, T, H, d)", q.view(B, T, H, d),
           "each head's d features are a contiguous slice")
    q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in (q, k, v))
    record("heads become batch", ".transpose(1, 2)", q, "(B, H, T, d): heads run in parallel")
    scores = record("scores", "q @ k.transpose(-2, -1) / sqrt(d)",
                    q @ k.transpose(-2, -1) / math.sqrt(d), "query t against every key s")
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    record("causal mask", "ones(T, T).tril()", mask, "broadcast over B and H")
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = record("softmax over keys", "softmax(scores, dim=-1)", scores.softmax(dim=-1),
                     "each row sums to 1; future keys get 0")
    y = record("mix values", "weights @ v", weights @ v, "per head: weighted mean of values")
    y = record("heads back to positions", ".transpose(1, 2)", y.transpose(1, 2),
               "(B, T, H, d); not contiguous any more")
    y = record("merge heads", ".contiguous().view(B, T, C)", y.contiguous().view(B, T, C),
               "concatenate the H head outputs")
    y = record("output projection", "proj(y)", attn.proj(y), "W_O mixes the heads")
    return steps, y, weights


MAX_WALK_ELEMENTS = 2**27  # 512 MiB of float32: far beyond a table anyone reads


def check_walk_fits(B: int, T: int, C: int, H: int) -> None:
    """Refuse sizes whose tensors would not fit (the scores are B*H*T*T numbers) before any is
    allocated: the walk is for reading shapes, not for benchmarking memory."""
    largest = max(B * H * T * T, B * T * 3 * C)
    if largest > MAX_WALK_ELEMENTS:
        raise ConfigError(f"B={B}, T={T}, C={C}, H={H} make tensors of {largest:,} numbers, "
                          f"more than the {MAX_WALK_ELEMENTS:,} this walk allows; try smaller "
                          f"sizes (the shapes are the point)")


def run(out_dir: Path, seed: int = 0, quick: bool = False, batch_size: int = 2,
        seq_len: int = 5, d_model: int = 16, n_heads: int = 4) -> ExperimentResult:
    del quick  # already tiny
    if batch_size <= 0 or seq_len <= 0:
        raise ConfigError(f"batch size and sequence length must be positive, got "
                          f"B={batch_size}, T={seq_len}")
    check_heads_divide_width(d_model, n_heads)
    check_walk_fits(batch_size, seq_len, d_model, n_heads)
    torch.manual_seed(seed)
    attn = MultiHeadSelfAttention(d_model, n_heads, causal=True).eval()
    x = torch.randn(batch_size, seq_len, d_model)
    with torch.no_grad():
        steps, y_walk, w_walk = walk_attention(attn, x)
        with recorded(attn.hook_pattern) as seen:  # watched: the explicit path
            y_explicit = attn(x)
        w_module = seen[0]
        y_fused = attn(x)

    table = Table(f"one forward pass, B={batch_size}, T={seq_len}, C={d_model}, H={n_heads}, "
                  f"d={d_model // n_heads}", ["step", "code", "shape", "note"])
    for step, code, tensor, note in steps:
        table.add_row(step, code, str(tuple(tensor.shape)), note)
    diffs = {"output vs module (explicit path)": (y_walk - y_explicit).abs().max().item(),
             "weights vs module": (w_walk - w_module).abs().max().item(),
             "output vs module (fused path)": (y_walk - y_fused).abs().max().item()}
    check_table = Table("the walk against the module", ["compared", "max |difference|"])
    for compared, diff in diffs.items():
        check_table.add_row(compared, diff)
    picture = save_figure(head_weights_figure(w_walk[0]), out_dir / "shapes_weights.png")
    return ExperimentResult(
        name="shapes", summary="every step of multi-head attention with its tensor shape",
        tables=[table, check_table], pictures=[picture],
        numbers={"shapes": {step: list(t.shape) for step, _, t, _ in steps}, "max_diff": diffs},
        checks=[Check(f"the walk equals the module (max difference <= {EXACT:g})",
                      max(diffs.values()) <= EXACT)])


def head_weights_figure(weights: Tensor) -> Figure:
    """The (H, T, T) causal weights of the first sequence, one panel per head (4 to a row)."""
    H, T, _ = weights.shape
    rows, cols = grid_shape(H, MAX_COLUMNS)
    width = PANEL_INCHES * cols + 1.4
    title = wrap_title("attention weights of sequence 0, one panel per head: lower triangular "
                       "(causal)", width)
    fig = new_figure(width, (PANEL_INCHES + 0.9) * rows + 0.3 + text_height(title))
    axes = fig.subplots(rows, cols, squeeze=False)
    ticks = list(range(0, T, math.ceil(T / MAX_TICKS)))
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        image = show_attention(ax, weights[h])
        first_column = h % cols == 0
        ax.set_xticks(ticks)
        ax.set_yticks(ticks, ticks if first_column else [])  # queries labelled once per row
        label_axes(ax, xlabel="key s", ylabel="query t" if first_column else "",
                   title=f"head {h}")
    labelled_colorbar(fig, image, axes, f"attention weight\n({MASKED_NOTE})",
                      shrink=0.8 if rows > 1 else 1.0)
    fig.suptitle(title, fontsize=SUPTITLE_PT)
    return fig
