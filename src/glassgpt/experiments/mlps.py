"""GELU vs SwiGLU vs ReLU²: three MLPs at exactly the same parameter count.

GPT-2's MLP is two matrices, C -> 4C -> C, with GELU between them. ReLU² (max(0, x)^2, the
activation of the speedrun records and nanochat) keeps the same two matrices. SwiGLU
(Llama, Qwen3) has three: proj(silu(gate(x)) * up(x)), so at the same hidden width it holds
half as many parameters again; its hidden width is cut to 2/3 of 4C = 8C/3 to hold exactly as
many (Llama's recipe). Without biases the counts are equal to the parameter: 2 * C * 4C = 3 * C
* 8C/3. Character models on Tiny Shakespeare that differ only in the MLP then train the same
steps on the same batches, over several seeds.
Notation: C = width, H = hidden width of the MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.experiments.charlm import CharLMSettings, model_config, train_char_lm
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.experiments.tasks import single_thread
from glassgpt.figures import LABEL_PT, label_axes, new_figure, save_figure
from glassgpt.model import GPT, count_parameters

VARIANTS = {"gelu": "GELU", "swiglu": "SwiGLU", "relu2": "ReLU²"}


@dataclass(frozen=True)
class MLPSettings:
    # Width 48 = 3 * 16: SwiGLU's hidden width 8C/3 = 128 is then a whole number.
    lm: CharLMSettings = CharLMSettings(n_embd=48)
    n_seeds: int = 2


QUICK = MLPSettings(lm=CharLMSettings(n_embd=48, block_size=32, steps=100, eval_every=50,
                                      eval_windows=32), n_seeds=1)


def equal_parameter_hidden(activation: str, C: int) -> int:
    """The hidden width that gives `activation`'s MLP the parameters of the 4C two-matrix MLP.

    Two matrices of C x H hold 2CH; SwiGLU's three hold 3CH, so its H is 2/3 of 4C.
    """
    if activation != "swiglu":
        return 4 * C
    if (8 * C) % 3:
        raise ConfigError(f"SwiGLU matches the 4C MLP's parameters only when 8C is divisible "
                          f"by 3; width C={C} is not a multiple of 3")
    return 8 * C // 3


@torch.no_grad()
def output_rms_at_init(config: GPTConfig, seed: int) -> float:
    """Root mean square of the first block's MLP output at initialisation, for inputs of unit
    size per feature (what the norm before the MLP hands it)."""
    torch.manual_seed(seed)
    ffn = GPT(config).blocks[0].ffn
    x = torch.randn(1024, config.n_embd, generator=torch.Generator().manual_seed(seed))
    return ffn(x).pow(2).mean().sqrt().item()


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    s = QUICK if quick else MLPSettings()
    seeds = [seed + i for i in range(s.n_seeds)]
    numbers: dict[str, Any] = {"seeds": seeds, "width": s.lm.n_embd}
    with single_thread():
        for activation in VARIANTS:
            hidden = equal_parameter_hidden(activation, s.lm.n_embd)
            # No biases: SwiGLU's third matrix would bring H more and break the equality.
            config = model_config(s.lm, activation=activation, mlp_hidden=hidden, bias=False)
            runs = [train_char_lm(config, s.lm, model_seed) for model_seed in seeds]
            model = runs[0].model
            numbers[activation] = {
                "mlp_hidden": hidden,
                "output_rms_at_init": output_rms_at_init(config, seed),
                "mlp_parameters": count_parameters(model.blocks[0].ffn),
                "parameters": count_parameters(model),
                "val_loss": [r.final_val for r in runs],
                "val_curves": [r.val_losses for r in runs], "val_steps": runs[0].val_steps}
    pictures = [save_figure(mlps_figure(numbers), out_dir / "mlps.png")]
    return ExperimentResult(
        name="mlps",
        summary=f"GELU vs SwiGLU vs ReLU² MLPs at equal parameter count, {s.lm.steps} steps, "
                f"{len(seeds)} seed(s)",
        tables=[results_table(numbers, s)], pictures=pictures, numbers=numbers,
        checks=expected_outcomes(numbers))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def results_table(numbers: dict[str, Any], s: MLPSettings) -> Table:
    seeds = numbers["seeds"]
    C = numbers["width"]
    losses = [f"val seed {seed}" for seed in seeds]
    table = Table(f"{s.lm.n_layer} layers, width C = {C}, no biases, {s.lm.steps} AdamW steps on "
                  f"Tiny Shakespeare (characters), context {s.lm.block_size}",
                  ["MLP", "matrices", "hidden width", "parameters per MLP", "model parameters",
                   *losses, "mean val"], formats={name: ".3f" for name in [*losses, "mean val"]})
    for activation, name in VARIANTS.items():
        n = numbers[activation]
        matrices = "gate, up, proj" if activation == "swiglu" else "fc, proj"
        table.add_row(name, matrices, n["mlp_hidden"], n["mlp_parameters"], n["parameters"],
                      *n["val_loss"], mean(n["val_loss"]))
    return table


def expected_outcomes(numbers: dict[str, Any]) -> list[Check]:
    counts = {numbers[a]["mlp_parameters"] for a in VARIANTS}
    totals = {numbers[a]["parameters"] for a in VARIANTS}
    C = numbers["width"]
    start = {a: numbers[a]["output_rms_at_init"] for a in VARIANTS}
    return [
        Check(f"every MLP holds exactly the same parameters ({min(counts):,} = 8C² for "
              f"C = {C}), and so does every model ({min(totals):,})",
              len(counts) == 1 and len(totals) == 1 and counts == {8 * C * C}),
        Check(f"SwiGLU and ReLU² start small: their MLP outputs at initialisation are under "
              f"half the size of GELU's (RMS {start['swiglu']:.1e} and {start['relu2']:.1e} vs "
              f"{start['gelu']:.1e}), a product of two small numbers",
              max(start["swiglu"], start["relu2"]) < start["gelu"] / 2),
    ]


def mlps_figure(numbers: dict[str, Any]) -> Figure:
    fig = new_figure(9.0, 3.4)
    curves, bars = fig.subplots(1, 2)
    for activation, name in VARIANTS.items():
        n = numbers[activation]
        for i, curve in enumerate(n["val_curves"]):
            curves.plot(n["val_steps"], curve, linewidth=1.1, label=name if i == 0 else None,
                        color=f"C{list(VARIANTS).index(activation)}")
    label_axes(curves, xlabel="training step", ylabel="validation loss",
               title="equal parameters, equal steps")
    curves.legend(fontsize=LABEL_PT)
    names = list(VARIANTS.values())
    counts = [numbers[a]["mlp_parameters"] for a in VARIANTS]
    bars.bar(names, counts, color=["C0", "C1", "C2"])
    for i, activation in enumerate(VARIANTS):
        bars.text(i, counts[i] / 2, f"H = {numbers[activation]['mlp_hidden']}", ha="center",
                  fontsize=LABEL_PT, color="white")
    label_axes(bars, ylabel="parameters per MLP", title="the same count, different shapes")
    return fig
