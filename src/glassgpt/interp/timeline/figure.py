"""The timeline's picture (`glassgpt timeline RUN --plot`): the loss curves with the phase change
marked, every head's induction score, and the LLC when it was estimated, on one time axis.
Drawn from timeline.json's content (`Timeline.to_json()`), so anything holding the file can draw
it again."""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from glassgpt.figures import LABEL_PT, label_axes, new_figure

PANEL_WIDTH, PANEL_HEIGHT = 4.4, 3.4


def timeline_figure(timeline: dict[str, Any], title: str = "") -> Figure:
    """The loss panel, the induction panel and (when the snapshots carry one) the LLC panel,
    side by side and on the same steps (symmetric-log, since the snapshots are log-spaced)."""
    records = timeline["snapshots"]
    with_llc = all("llc" in record for record in records)
    fig = new_figure(PANEL_WIDTH * (3 if with_llc else 2), PANEL_HEIGHT)
    axes = fig.subplots(1, 3 if with_llc else 2, sharex=True)
    phase = timeline["phase_change"]["step"]
    draw_losses(axes[0], timeline)
    draw_scores(axes[1], timeline)
    if with_llc:
        draw_llc(axes[2], timeline)
    for ax in axes:
        ax.set_xscale("symlog", linthresh=1)
        if phase is not None:
            ax.axvline(phase, color="gray", linestyle="--", linewidth=1)
    if title:
        fig.suptitle(title)
    return fig


def draw_losses(ax: Axes, timeline: dict[str, Any]) -> None:
    steps, records = timeline["steps"], timeline["snapshots"]
    for i, split in enumerate(timeline["splits"]):
        ax.plot(steps, [r[f"{split}_loss"] for r in records], color=f"C{i}", marker="o",
                markersize=3, label=f"{split} loss")
    ax.plot(steps, [r["icl_score"] for r in records], color="C3", linestyle=":",
            label=f"ICL score (token {timeline['icl']['late_index']} - "
                  f"{timeline['icl']['early_index']})")
    phase = timeline["phase_change"]["step"]
    where = f"phase change at step {phase}" if phase is not None else "no phase change"
    label_axes(ax, xlabel="training step", ylabel="loss (nats)", title=f"loss ({where})")
    ax.legend(fontsize=LABEL_PT)


def draw_scores(ax: Axes, timeline: dict[str, Any]) -> None:
    steps, records = timeline["steps"], timeline["snapshots"]
    first = records[0]["scores"]["induction"]
    for layer, row in enumerate(first):
        for head in range(len(row)):
            ax.plot(steps, [r["scores"]["induction"][layer][head] for r in records],
                    color=f"C{layer}", linewidth=1.0,
                    label=f"layer {layer} heads" if head == 0 else None)
    ax.set_ylim(0.0, 1.0)
    label_axes(ax, xlabel="training step", ylabel="induction score",
               title="every head's induction score")
    ax.legend(fontsize=LABEL_PT)


def draw_llc(ax: Axes, timeline: dict[str, Any]) -> None:
    steps, records = timeline["steps"], timeline["snapshots"]
    means = [r["llc"]["llc_mean"] for r in records]
    stds = [r["llc"]["llc_std"] for r in records]
    chains = records[0]["llc"]["settings"]["num_chains"]
    ax.errorbar(steps, means, yerr=stds, color="C4", marker="o", markersize=3, capsize=2)
    label_axes(ax, xlabel="training step", ylabel="LLC estimate",
               title=f"local learning coefficient (± std over {chains} chains)")
