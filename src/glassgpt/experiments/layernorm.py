"""LayerNorm by hand: a worked example, scale invariance, and why it must be per position.

Notation: B = batch, T = positions, C = features.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor, nn

from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.figures import LABEL_PT, TICK_PT, label_axes, new_figure, save_figure
from glassgpt.norms import ManualLayerNorm

EPS = 1e-5
EXAMPLE = [2.0, 4.0, 6.0, 8.0]
GAMMA = [1.0, 2.0, 0.5, 1.0]
BETA = [0.0, 0.0, 1.0, -1.0]


def fmt(values: Tensor) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values.flatten().tolist()) + "]"


def worked_example() -> tuple[Table, dict[str, float]]:
    """One position of C=4 features through every step, manual vs nn.LayerNorm."""
    x = torch.tensor([EXAMPLE], dtype=torch.float64)  # (1, C)
    manual = ManualLayerNorm(len(EXAMPLE), eps=EPS).to(torch.float64)
    reference = nn.LayerNorm(len(EXAMPLE), eps=EPS, dtype=torch.float64)
    with torch.no_grad():
        for norm in (manual, reference):
            norm.weight.copy_(torch.tensor(GAMMA))
            norm.bias.copy_(torch.tensor(BETA))
        y_manual, y_reference = manual(x), reference(x)
    mean = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True, unbiased=False)
    x_hat = (x - mean) / torch.sqrt(var + EPS)
    table = Table(f"worked example, C={len(EXAMPLE)}, eps={EPS:g}", ["step", "value"])
    table.add_row("x", fmt(x))
    table.add_row("mean over the C features", fmt(mean))
    table.add_row("variance, population (divide by C)", fmt(var))
    table.add_row("variance, sample (divide by C-1): NOT used", fmt(x.var(dim=-1)))
    table.add_row("x_hat = (x - mean) / sqrt(var + eps)", fmt(x_hat))
    table.add_row("gamma (weight)", fmt(torch.tensor(GAMMA)))
    table.add_row("beta (bias)", fmt(torch.tensor(BETA)))
    table.add_row("y = gamma * x_hat + beta (ManualLayerNorm)", fmt(y_manual))
    table.add_row("nn.LayerNorm", fmt(y_reference))
    diff = (y_manual - y_reference).abs().max().item()
    table.add_row("max |manual - nn.LayerNorm|", f"{diff:.1e}")
    return table, {"manual_vs_torch": diff, "mean": mean.item(), "variance": var.item()}


def scale_invariance() -> tuple[Table, float]:
    """Two rows of very different scale and offset normalise to the same values."""
    small = torch.tensor([1.0, 2.0, 3.0, 4.0])
    large = 1000.0 * small + 500.0
    rows = torch.stack([small, large]).view(1, 2, 4)  # (B, T, C): two positions
    normalised = F.layer_norm(rows, (4,), eps=EPS)
    diff = (normalised[0, 0] - normalised[0, 1]).abs().max().item()
    table = Table("two positions of very different scale", ["position", "x", "LayerNorm(x)"])
    for t in range(2):
        table.add_row(t, fmt(rows[0, t]), fmt(normalised[0, t]))
    table.add_row("max |difference|", "", f"{diff:.1e}")
    return table, diff


def earlier_changes(normalise, seed: int, T: int = 6, C: int = 8) -> list[float]:
    """Change only the last position's input; return max |change| of every earlier output."""
    torch.manual_seed(seed)
    x = torch.randn(1, T, C)
    changed = x.clone()
    changed[:, -1] += 3.0 * torch.randn(C)
    delta = (normalise(changed) - normalise(x)).abs()  # (1, T, C)
    return delta[0, :-1].amax(dim=-1).tolist()  # T - 1 earlier positions


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    del quick  # already tiny
    example, example_numbers = worked_example()
    scale_table, scale_diff = scale_invariance()
    per_position = earlier_changes(lambda x: F.layer_norm(x, x.shape[-1:], eps=EPS), seed)
    over_sequence = earlier_changes(lambda x: F.layer_norm(x, x.shape[-2:], eps=EPS), seed)
    causality = Table("causality: change only the LAST token; how much do EARLIER outputs move?",
                      ["normalise over", "max |change| at earlier positions"])
    causality.add_row("C (per position, what LayerNorm does)", max(per_position))
    causality.add_row("(T, C) (the whole sequence)", max(over_sequence))
    picture = save_figure(leak_figure(per_position, over_sequence),
                          out_dir / "layernorm_leak.png")
    return ExperimentResult(
        name="layernorm", summary="manual LayerNorm, scale invariance, the (T, C) causality leak",
        tables=[example, scale_table, causality], pictures=[picture],
        numbers={**example_numbers, "scale_rows_diff": scale_diff,
                 "leak_per_position": per_position, "leak_over_sequence": over_sequence},
        checks=[
            Check("ManualLayerNorm equals nn.LayerNorm (<= 1e-12 in float64)",
                  example_numbers["manual_vs_torch"] <= 1e-12),
            Check("rows of different scale normalise to the same values (<= 1e-4)",
                  scale_diff <= 1e-4),
            Check("per-position LayerNorm is causal: earlier outputs do not move",
                  max(per_position) == 0.0),
            Check("normalising over (T, C) leaks: a later token moves earlier outputs",
                  max(over_sequence) > 1e-3),
        ])


def leak_figure(per_position: list[float], over_sequence: list[float]) -> Figure:
    """Side-by-side bars per earlier position; a bar of exactly 0 is written as such, since a
    zero-height bar cannot be seen."""
    fig = new_figure(6.4, 3.2)
    ax = fig.subplots()
    positions = range(len(per_position))
    ax.bar([p - 0.2 for p in positions], over_sequence, width=0.4, label="normalise over (T, C)",
           color="tab:red")
    ax.bar([p + 0.2 for p in positions], per_position, width=0.4,
           label="normalise over C (LayerNorm)", color="tab:blue")
    top = max([*over_sequence, *per_position, 1e-12])
    for p, change in zip(positions, per_position, strict=True):
        if change == 0.0:
            ax.text(p + 0.2, 0.02 * top, "0 (exactly)", rotation=90, ha="center", va="bottom",
                    color="tab:blue", fontsize=TICK_PT)
    ax.set_ylim(0, 1.3 * top)  # headroom for the legend above the bars
    ax.set_xticks(list(positions))
    label_axes(ax, xlabel="earlier position t (only the last token was changed)",
               ylabel="max |change of output|",
               title="only per-position normalisation keeps the past independent of the future")
    ax.legend(fontsize=LABEL_PT, loc="upper right")
    return fig
