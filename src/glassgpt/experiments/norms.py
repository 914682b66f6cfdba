"""LayerNorm vs RMSNorm: the same loss, with fewer operations.

RMSNorm keeps LayerNorm's scale and drops its centring: no mean to subtract, no shift beta, one
statistic (the mean square) instead of two (mean and variance). The operations are counted, not
asserted: both written-out modules (`ManualLayerNorm`, `RMSNorm` of `glassgpt.norms`) run once
under a recorder of every torch call they make. Then character models on Tiny Shakespeare that
differ only in `norm` train the same steps on the same batches, over several seeds, so the gap
between the two norms can be set beside the spread between seeds.
Notation: B = batch, T = positions, C = width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from glassgpt.experiments.charlm import CharLMSettings, model_config, train_char_lm
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.experiments.tasks import single_thread
from glassgpt.figures import LABEL_PT, label_axes, new_figure, save_figure
from glassgpt.model import count_parameters
from glassgpt.norms import ManualLayerNorm, RMSNorm

VARIANTS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


@dataclass(frozen=True)
class NormSettings:
    lm: CharLMSettings = CharLMSettings()
    n_seeds: int = 3


QUICK = NormSettings(lm=CharLMSettings(block_size=32, steps=100, eval_every=50,
                                       eval_windows=32), n_seeds=2)


class CallRecorder(TorchFunctionMode):
    """Records every torch function or tensor method called inside the `with` block.

    A call that hands back one of its own inputs unchanged (a dtype cast to the dtype the tensor
    already has) does no work and is not recorded.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []  # name, in, out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, Tensor)]
        if isinstance(out, Tensor) and not any(out is t for t in tensors):
            widest = max((tuple(t.shape) for t in tensors), key=len, default=())
            self.calls.append((func.__name__, widest, tuple(out.shape)))
        return out


def count_operations(norm: nn.Module, C: int) -> dict[str, Any]:
    """The torch operations one call of `norm` makes on x (B, T, C), written out (RMSNorm's
    `steps`: the model may run them as one fused kernel), sorted by what they touch.

    Over all C features: reads or writes the whole feature vector of a position (a reduction
    such as the mean reads C numbers and writes one). Per position: works on one number per
    position only (the statistic plus eps, its square root).
    """
    x = torch.randn(2, 3, C)  # (B, T, C)
    written_out = getattr(norm, "steps", norm)  # RMSNorm's steps, not its one fused kernel
    with torch.no_grad(), CallRecorder() as recorder:
        written_out(x)
    calls = recorder.calls
    return {
        "operations": [name for name, _, _ in calls],
        "reductions": [name for name, inp, out in calls if inp[-1:] == (C,) and out[-1:] == (1,)],
        "over all C": [name for name, inp, out in calls if (C,) in (inp[-1:], out[-1:])],
        "per position": [name for name, inp, out in calls if (C,) not in (inp[-1:], out[-1:])],
        "parameters": count_parameters(norm),
    }


def train_every_norm(s: NormSettings, seeds: list[int]) -> dict[str, dict[str, Any]]:
    """Each norm trained from each seed: its final val losses and every seed's val curve."""
    outcomes: dict[str, dict[str, Any]] = {}
    for norm in VARIANTS:
        runs = [train_char_lm(model_config(s.lm, norm=norm), s.lm, seed) for seed in seeds]
        outcomes[norm] = {"val_loss": [r.final_val for r in runs],
                          "val_curves": [r.val_losses for r in runs],
                          "val_steps": runs[0].val_steps,
                          "parameters": count_parameters(runs[0].model)}
    return outcomes


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    s = QUICK if quick else NormSettings()
    seeds = [seed + i for i in range(s.n_seeds)]
    C = s.lm.n_embd
    counts = {"layernorm": count_operations(ManualLayerNorm(C), C),
              "rmsnorm": count_operations(RMSNorm(C), C)}
    with single_thread():
        outcomes = train_every_norm(s, seeds)
    numbers = {"seeds": seeds, "width": C, "counts": counts, **outcomes,
               **noise_and_gap(outcomes)}
    pictures = [save_figure(norms_figure(numbers), out_dir / "norms.png")]
    return ExperimentResult(
        name="norms",
        summary=f"LayerNorm vs RMSNorm: operations per call, and val loss over {len(seeds)} "
                f"seeds ({s.lm.steps} steps each)",
        tables=[operations_table(counts, C, s.lm.n_layer), loss_table(numbers, s)],
        pictures=pictures, numbers=numbers, checks=expected_outcomes(numbers))


def noise_and_gap(outcomes: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The gap between the norms' mean val losses, and the noise to hold it against: two
    standard errors of a difference of two means, from the seed-to-seed standard deviation
    (pooled over both norms). A gap inside it is one a change of seeds alone could make."""
    layer, rms = outcomes["layernorm"]["val_loss"], outcomes["rmsnorm"]["val_loss"]
    n = len(layer)
    pooled_variance = (sample_variance(layer) + sample_variance(rms)) / 2
    return {"gap": abs(mean(layer) - mean(rms)),
            "seed_std": math.sqrt(pooled_variance),
            "noise": 2 * math.sqrt(pooled_variance * 2 / n)}


def sample_variance(values: list[float]) -> float:
    centre = mean(values)
    return sum((v - centre) ** 2 for v in values) / (len(values) - 1)


def operations_table(counts: dict[str, dict[str, Any]], C: int, n_layer: int) -> Table:
    table = Table(f"one call on x (B, T, C={C}): every torch operation the written-out module "
                  f"makes (recorded, not typed in); a model has 2L + 1 = {2 * n_layer + 1} norms",
                  ["norm", "operations", "of them reductions over C", "over all C features",
                   "per position", "parameters", "the calls"])
    for norm, name in VARIANTS.items():
        c = counts[norm]
        table.add_row(name, len(c["operations"]), len(c["reductions"]), len(c["over all C"]),
                      len(c["per position"]), c["parameters"], ", ".join(c["operations"]))
    return table


def loss_table(numbers: dict[str, Any], s: NormSettings) -> Table:
    seeds = numbers["seeds"]
    table = Table(f"{s.lm.n_layer} layers, width {s.lm.n_embd}, {s.lm.steps} AdamW steps on Tiny "
                  f"Shakespeare (characters), context {s.lm.block_size}: val loss of each seed",
                  ["norm", "parameters", *(f"seed {seed}" for seed in seeds), "mean"],
                  formats={name: ".3f" for name in [*(f"seed {seed}" for seed in seeds), "mean"]})
    for norm, name in VARIANTS.items():
        losses = numbers[norm]["val_loss"]
        table.add_row(name, numbers[norm]["parameters"], *losses, mean(losses))
    return table


def expected_outcomes(numbers: dict[str, Any]) -> list[Check]:
    layer, rms = numbers["counts"]["layernorm"], numbers["counts"]["rmsnorm"]
    gap, noise = numbers["gap"], numbers["noise"]
    return [
        Check(f"RMSNorm makes fewer operations ({len(rms['operations'])} vs "
              f"{len(layer['operations'])}), fewer reductions ({len(rms['reductions'])} vs "
              f"{len(layer['reductions'])}) and holds half the parameters "
              f"({rms['parameters']} vs {layer['parameters']})",
              len(rms["operations"]) < len(layer["operations"])
              and len(rms["reductions"]) < len(layer["reductions"])
              and 2 * rms["parameters"] == layer["parameters"]),
        Check(f"the same loss within noise: the gap between the means ({gap:.3f}) is inside two "
              f"standard errors of a difference ({noise:.3f}, from the seeds' standard deviation "
              f"{numbers['seed_std']:.3f})", gap <= noise),
    ]


def norms_figure(numbers: dict[str, Any]) -> Figure:
    fig = new_figure(9.0, 3.4)
    curves, bars = fig.subplots(1, 2)
    steps = numbers["layernorm"]["val_steps"]
    for (norm, name), colour in zip(VARIANTS.items(), ("tab:blue", "tab:orange"), strict=True):
        for i, curve in enumerate(numbers[norm]["val_curves"]):
            curves.plot(steps, curve, color=colour, linewidth=1.0, alpha=0.8,
                        label=name if i == 0 else None)
    label_axes(curves, xlabel="training step", ylabel="validation loss",
               title=f"every seed ({len(numbers['seeds'])} per norm)")
    curves.legend(fontsize=LABEL_PT)
    kinds = ["reductions", "over all C", "per position"]
    width = 0.38
    for k, (norm, name) in enumerate(VARIANTS.items()):
        counts = [len(numbers["counts"][norm][kind]) for kind in kinds]
        xs = [i + (k - 0.5) * width for i in range(len(kinds))]
        bars.bar(xs, counts, width=width, label=name)
    bars.set_xticks(range(len(kinds)), ["reductions\nover C", "over all C\nfeatures",
                                        "per\nposition"])
    label_axes(bars, ylabel="torch operations per call",
               title="what one call computes")
    bars.legend(fontsize=LABEL_PT)
    return fig
