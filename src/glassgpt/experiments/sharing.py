"""`[block] * L` versus L independent blocks: the same Python list, very different models.

`[block] * L` repeats one module object L times, so every "layer" is the same weights: the model
counts one block's parameters and an update to any layer is an update to all of them. `GPT`
builds a fresh block per layer for this reason.
Notation: C = width, L = layers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from glassgpt.block import TransformerBlock
from glassgpt.experiments.figures import new_figure, save_figure
from glassgpt.experiments.results import Check, ExperimentResult, Table
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


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    del quick  # already tiny
    per_block = count_parameters(TransformerBlock(WIDTH, HEADS))
    table = Table(f"{LAYERS} layers of TransformerBlock(C={WIDTH}, H={HEADS}); one block has "
                  f"{per_block:,} parameters",
                  ["stack", "parameters", "distinct blocks", "state_dict tensors",
                   "layers changed by updating layer 0"])
    numbers = {}
    for name, stack in build_stacks(seed).items():
        params = count_parameters(stack)
        distinct = len({id(layer) for layer in stack})
        tensors = len(stack.state_dict())
        changed = layers_changed_by_updating_first(stack)
        table.add_row(name, params, distinct, tensors, sum(changed))
        numbers[name] = {"parameters": params, "distinct_blocks": distinct,
                         "state_dict_tensors": tensors, "layers_changed": changed}
    shared, independent = numbers.values()
    picture = draw_counts(numbers, out_dir / "sharing.png")
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
        ])


def draw_counts(numbers: dict[str, dict], path: Path) -> Path:
    fig = new_figure(6.4, 2.6)
    left, right = fig.subplots(1, 2)
    names = list(numbers)
    left.bar(range(len(names)), [numbers[n]["parameters"] / 1e3 for n in names],
             color=["tab:red", "tab:blue"])
    left.set_ylabel("thousands of parameters", fontsize=8)
    left.set_title("parameters", fontsize=9)
    for ax in (left, right):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.split(" (")[0] for n in names], fontsize=7)
    for i, name in enumerate(names):
        changed = numbers[name]["layers_changed"]
        right.scatter([i] * len(changed), range(len(changed)), s=160, marker="s",
                      c=["tab:orange" if c else "lightgray" for c in changed])
    right.set_ylabel("layer", fontsize=8)
    right.set_yticks(range(LAYERS))
    right.set_xlim(-0.6, len(names) - 0.4)
    right.set_title("layers moved by updating layer 0", fontsize=9)
    return save_figure(fig, path)
