"""`[block] * L` versus L independent blocks: the same Python list, very different models.

`[block] * L` repeats one module object L times, so every "layer" is the same weights: the model
counts one block's parameters and an update to any layer is an update to all of them. `GPT`
builds a fresh block per layer for this reason. The state_dict hides the difference: it names
each tensor by its path, so both stacks list L blocks' worth of entries; only counting the
distinct tensors behind those names shows the sharing.
Notation: C = width, L = layers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from torch import nn

from glassgpt.block import TransformerBlock
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.figures import (
    LABEL_PT,
    TICK_PT,
    label_axes,
    new_figure,
    save_figure,
)
from glassgpt.model import count_parameters

WIDTH, HEADS, LAYERS = 32, 4, 4


def build_stacks(seed: int) -> dict[str, nn.ModuleList]:
    torch.manual_seed(seed)
    block = TransformerBlock(WIDTH, HEADS)
    return {
        "[block] * L (shared)": nn.ModuleList([block] * LAYERS),
        "L independent blocks": nn.ModuleList(TransformerBlock(WIDTH, HEADS)
                                              for _ in range(LAYERS)),
    }


def layers_changed_by_updating_first(stack: nn.ModuleList) -> list[bool]:
    """Nudge layer 0's MLP weights; report, per layer, whether that layer's weights moved."""
    before = [layer.ffn.fc.weight.detach().clone() for layer in stack]
    with torch.no_grad():
        stack[0].ffn.fc.weight.add_(0.1)  # what an optimizer step on layer 0 would do
    return [not torch.equal(layer.ffn.fc.weight, old)
            for layer, old in zip(stack, before, strict=True)]


def state_dict_counts(stack: nn.ModuleList) -> tuple[int, int]:
    """(entries, distinct tensors) of the stack's state_dict.

    A state_dict names every tensor by its path ("0.ln1.weight", "1.ln1.weight", ...), so the
    shared stack lists its one block's tensors once per layer: L times the entries, one block's
    worth of distinct tensors (entries that share memory).
    """
    state = stack.state_dict()
    return len(state), len({tensor.data_ptr() for tensor in state.values()})


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    del quick  # already tiny
    per_block = count_parameters(TransformerBlock(WIDTH, HEADS))
    table = Table(f"{LAYERS} layers of TransformerBlock(C={WIDTH}, H={HEADS}); one block has "
                  f"{per_block:,} parameters",
                  ["stack", "parameters", "distinct blocks", "state_dict entries",
                   "distinct tensors", "layers moved by updating layer 0"])
    numbers = {}
    for name, stack in build_stacks(seed).items():
        params = count_parameters(stack)
        distinct = len({id(layer) for layer in stack})
        entries, distinct_tensors = state_dict_counts(stack)
        changed = layers_changed_by_updating_first(stack)
        table.add_row(name, params, distinct, entries, distinct_tensors, sum(changed))
        numbers[name] = {"parameters": params, "distinct_blocks": distinct,
                         "state_dict_entries": entries, "distinct_tensors": distinct_tensors,
                         "layers_changed": changed}
    shared, independent = numbers.values()
    picture = save_figure(counts_figure(numbers), out_dir / "sharing.png")
    return ExperimentResult(
        name="sharing", summary="[block] * L shares one block; a model needs L fresh ones",
        tables=[table], pictures=[picture], numbers={"per_block": per_block, **numbers},
        checks=[
            Check("the shared stack counts one block's parameters",
                  shared["parameters"] == per_block),
            Check("independent blocks count L times as many",
                  independent["parameters"] == LAYERS * per_block),
            Check("updating layer 0 changes every layer of the shared stack",
                  all(shared["layers_changed"])),
            Check("updating layer 0 changes only layer 0 of the independent stack",
                  independent["layers_changed"] == [True] + [False] * (LAYERS - 1)),
            Check(f"both state_dicts name {independent['state_dict_entries']} tensors, but the "
                  f"shared one holds only {shared['distinct_tensors']} distinct ones: one "
                  f"block's tensors under {LAYERS} names each",
                  shared["state_dict_entries"] == independent["state_dict_entries"]
                  == LAYERS * shared["distinct_tensors"]
                  and independent["distinct_tensors"] == independent["state_dict_entries"]),
        ])


MOVED, UNCHANGED = "tab:orange", "lightgray"


def counts_figure(numbers: dict[str, dict]) -> Figure:
    """Left: parameters of each stack. Right: one square per layer, coloured if it moved."""
    fig = new_figure(7.6, 3.2)
    left, right = fig.subplots(1, 2)
    names = list(numbers)
    counts = [numbers[n]["parameters"] for n in names]
    bars = left.bar(range(len(names)), [c / 1e3 for c in counts], color=["tab:red", "tab:blue"])
    for bar, count in zip(bars, counts, strict=True):
        left.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{count:,}",
                  ha="center", va="bottom", fontsize=TICK_PT)
    left.set_ylim(0, max(counts) / 1e3 * 1.15)
    label_axes(left, ylabel="thousands of parameters", title="parameters")
    for i, name in enumerate(names):
        changed = numbers[name]["layers_changed"]
        right.scatter([i] * len(changed), range(len(changed)), s=160, marker="s",
                      c=[MOVED if c else UNCHANGED for c in changed])
    right.set_yticks(range(LAYERS))
    right.set_xlim(-0.6, len(names) - 0.4)
    right.set_ylim(-0.6, LAYERS - 0.4)
    label_axes(right, ylabel="layer", title="layers moved by updating layer 0")
    for ax in (left, right):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.split(" (")[0] for n in names])
    squares = [Line2D([], [], marker="s", markersize=9, linestyle="", color=colour, label=label)
               for colour, label in ((MOVED, "weights moved"), (UNCHANGED, "unchanged"))]
    fig.legend(handles=squares, loc="outside right center", fontsize=LABEL_PT)
    return fig
