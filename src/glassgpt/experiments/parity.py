"""Parity: the parallel multi-head module against three references, in float64.

References: the per-head loop (`PerHeadSelfAttention`, one module per head, then concatenate),
PyTorch's fused kernel (the module's own SDPA path) and `nn.MultiheadAttention` holding the same
weights. Causal and bidirectional, with right padding in part of the batch.
Notation: B = batch, T = positions, C = width, H = heads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.attention import MultiHeadSelfAttention
from glassgpt.experiments.references import PerHeadSelfAttention, to_torch_multihead
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.figures import LABEL_PT, label_axes, new_figure, save_figure
from glassgpt.hooks import recorded

TOLERANCE = 1e-12  # float64; the per-head loop reaches exactly 0


def padding_mask(lengths: list[int], T: int) -> Tensor:
    """(B, T) bool, True on the padding after each sequence's real tokens."""
    return torch.arange(T).view(1, T) >= torch.tensor(lengths).view(-1, 1)


def max_diff_at_real_queries(a: Tensor, b: Tensor, real: Tensor) -> float:
    """Max |a - b| over real query positions; a, b are (B, T, C) outputs or (B, H, T, S) weights.

    A padding query's output is never used, so only the queries where real (B, T) is True count.
    """
    diff = (a - b).abs()
    if diff.dim() == 4:
        diff = diff.transpose(1, 2)  # (B, T, H, S): queries on axis 1, as in the outputs
    return diff[real].max().item()


def compare(causal: bool, x: Tensor, pad: Tensor,
            n_heads: int) -> dict[str, tuple[float, float | None]]:
    """Max |difference| (output, weights) of the module's explicit path against each reference."""
    T, C = x.shape[1], x.shape[2]
    attn = MultiHeadSelfAttention(C, n_heads, causal=causal).to(torch.float64).eval()
    with recorded(attn.hook_pattern) as seen:  # watched: the explicit path, for the weights
        y = attn(x, pad_mask=pad)  # (B, T, C)
    w = seen[0]  # (B, H, T, T)

    def max_diff(a: Tensor, b: Tensor) -> float:
        return max_diff_at_real_queries(a, b, ~pad)

    y_loop, w_loop = PerHeadSelfAttention.from_parallel(attn)(x, pad_mask=pad)
    y_fused = attn(x, pad_mask=pad)  # unwatched: the SDPA path
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1) if causal else None
    mha = to_torch_multihead(attn).eval()
    y_mha, w_mha = mha(x, x, x, key_padding_mask=pad, attn_mask=future, need_weights=True,
                       average_attn_weights=False)
    return {  # SDPA returns no weights, hence None
        "per-head loop (ModuleList + cat)": (max_diff(y, y_loop), max_diff(w, w_loop)),
        "fused path (scaled_dot_product_attention)": (max_diff(y, y_fused), None),
        "nn.MultiheadAttention": (max_diff(y, y_mha), max_diff(w, w_mha)),
    }


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    del quick  # already small
    torch.manual_seed(seed)
    B, T, C, H = 3, 7, 24, 3
    x = torch.randn(B, T, C, dtype=torch.float64)
    pad = padding_mask([T, T - 2, T - 4], T)
    table = Table(f"parallel module vs references, float64, B={B}, T={T}, C={C}, H={H}, "
                  f"sequences of length {T}, {T - 2}, {T - 4} (right padding)",
                  ["reference", "mask", "max |Δ output|", "max |Δ weights|"])
    numbers: dict[str, dict[str, list[float | None]]] = {}
    for causal in (True, False):
        mask_name = "causal" if causal else "bidirectional"
        torch.manual_seed(seed)
        diffs = compare(causal, x, pad, H)
        numbers[mask_name] = {ref: list(pair) for ref, pair in diffs.items()}
        for reference, (d_out, d_weights) in diffs.items():
            table.add_row(reference, mask_name, d_out, d_weights)
    worst = max(v for per_mask in numbers.values() for pair in per_mask.values()
                for v in pair if v is not None)
    picture = save_figure(differences_figure(numbers), out_dir / "parity.png")
    return ExperimentResult(
        name="parity", summary="one parallel module, three references, the same numbers",
        tables=[table], pictures=[picture], numbers=numbers,
        checks=[Check(f"every difference <= {TOLERANCE:g} (largest {worst:.1e})",
                      worst <= TOLERANCE)])


def differences_figure(numbers: dict[str, dict[str, list[float | None]]]) -> Figure:
    """Bars of the output differences on a log scale (an exact 0 drawn at the floor)."""
    floor = 1e-18
    fig = new_figure(6.4, 3.0)
    ax = fig.subplots()
    references = list(next(iter(numbers.values())))
    width = 0.38
    for i, (mask_name, per_ref) in enumerate(numbers.items()):
        values = [max(per_ref[ref][0], floor) for ref in references]
        positions = [j + (i - 0.5) * width for j in range(len(references))]
        ax.bar(positions, values, width=width, label=mask_name)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 1e-6)
    ax.axhline(TOLERANCE, color="gray", linestyle="--", linewidth=1, label="tolerance 1e-12")
    ax.set_xticks(range(len(references)))
    ax.set_xticklabels([ref.split(" (")[0] for ref in references])
    label_axes(ax, xlabel="reference", ylabel="max |Δ output| (0 at the floor)",
               title="float64 parity of the parallel module")
    ax.legend(fontsize=LABEL_PT)
    return fig
