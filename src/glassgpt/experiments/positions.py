"""Where a token sits: learned position vectors, rotary positions, or none at all (NoPE).

Three character models on Tiny Shakespeare differ only in `position` and train the same steps on
the same batches with a context of T tokens. Learned positions add a vector from a table of T
rows to each input; rotary turns q and k by an angle proportional to the position, so scores
depend only on the offset between query and key; "none" adds nothing, and the causal mask alone
tells a token how far into the window it is. Then each reads windows of 2T tokens: rotary and
none run with the very same weights (they hold no per-position tensor), while learned positions
cannot go there at all, as their table has no row for position T.
Notation: B = batch, T = trained context, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.config import GPTConfig
from glassgpt.errors import InputError
from glassgpt.experiments.charlm import (
    CharLMSettings,
    TrainedLM,
    model_config,
    train_char_lm,
    unigram_loss,
    validation_windows,
)
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.experiments.tasks import single_thread
from glassgpt.figures import LABEL_PT, label_axes, new_figure, save_figure
from glassgpt.model import GPT, count_parameters

VARIANTS = {"learned": "learned table", "rope": "rotary", "none": "none (NoPE)"}
LONG_FACTOR = 2  # the long windows are this many times the trained context


@dataclass(frozen=True)
class PositionSettings:
    lm: CharLMSettings = CharLMSettings()
    long_windows: int = 256  # validation windows of LONG_FACTOR * T tokens


QUICK = PositionSettings(lm=CharLMSettings(block_size=32, steps=100, eval_every=50,
                                           eval_windows=32), long_windows=32)


@dataclass
class LongContext:
    """How one trained variant reads windows of LONG_FACTOR * T tokens."""

    runs: bool  # False: the model refused the longer window
    refusal: str = ""  # its error message when it refused
    loss_per_position: list[float] | None = None  # (LONG_FACTOR * T,) mean over windows

    def mean_loss(self, start: int, end: int) -> float | None:
        if self.loss_per_position is None:
            return None
        part = self.loss_per_position[start:end]
        return sum(part) / len(part)


def widened(trained: GPT, block_size: int) -> GPT:
    """The same weights in a model whose context is `block_size`.

    Works for rotary and no positions, which hold no per-position tensor; a learned table of
    T rows does not fit a model of more rows (`load_state_dict` would refuse it).
    """
    config = GPTConfig.from_dict({**trained.config.to_dict(), "block_size": block_size})
    model = GPT(config)
    model.load_state_dict(trained.state_dict())
    return model


def refusal_of(model: GPT, inputs: Tensor) -> str:
    """The model's error message for `inputs` (B, T'), or "" when it reads them."""
    try:
        model(inputs)
    except InputError as refusal:
        return str(refusal)
    return ""


@torch.no_grad()
def read_long_windows(trained: GPT, s: PositionSettings) -> LongContext:
    """Loss at every position of windows LONG_FACTOR times longer than the trained context.

    The trained model itself is asked first: its block_size is T, so it refuses. A learned
    table ends there; rotary and no positions run the same weights in a wider model.
    """
    T = s.lm.block_size
    inputs, targets = validation_windows(LONG_FACTOR * T, s.long_windows)  # (B, 2T) each
    refusal = refusal_of(trained.eval(), inputs[:1])
    if trained.config.position == "learned":
        return LongContext(runs=not refusal, refusal=refusal)
    model = widened(trained, LONG_FACTOR * T).eval()
    logits, _ = model(inputs)  # (B, 2T, V)
    losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, 2T)
    return LongContext(runs=True, refusal=refusal, loss_per_position=losses.mean(dim=0).tolist())


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    s = QUICK if quick else PositionSettings()
    trained: dict[str, TrainedLM] = {}
    long: dict[str, LongContext] = {}
    with single_thread():
        for position in VARIANTS:
            trained[position] = train_char_lm(model_config(s.lm, position=position), s.lm, seed)
            long[position] = read_long_windows(trained[position].model, s)
    numbers = collect_numbers(trained, long, s)
    pictures = [save_figure(positions_figure(numbers), out_dir / "positions.png")]
    return ExperimentResult(
        name="positions",
        summary=f"learned vs rotary vs no positions, {s.lm.steps} steps at context "
                f"{s.lm.block_size}, then read at {LONG_FACTOR * s.lm.block_size}; seed {seed}",
        tables=[results_table(numbers, s)], pictures=pictures, numbers=numbers,
        checks=expected_outcomes(numbers))


def collect_numbers(trained: dict[str, TrainedLM], long: dict[str, LongContext],
                    s: PositionSettings) -> dict:
    T = s.lm.block_size
    numbers: dict = {"block_size": T, "long_length": LONG_FACTOR * T,
                     "unigram_loss": unigram_loss()}
    for position, run_ in trained.items():
        reading = long[position]
        numbers[position] = {
            "parameters": count_parameters(run_.model),
            "val_loss": run_.final_val,
            "val_curve": run_.val_losses, "val_steps": run_.val_steps,
            "long_runs": reading.runs, "long_refusal": reading.refusal,
            "long_loss_inside": reading.mean_loss(0, T),
            "long_loss_beyond": reading.mean_loss(T, LONG_FACTOR * T),
            "long_loss_per_position": reading.loss_per_position,
        }
    return numbers


def results_table(numbers: dict, s: PositionSettings) -> Table:
    T, T2 = numbers["block_size"], numbers["long_length"]
    table = Table(f"{s.lm.n_layer} layers, width {s.lm.n_embd}, {s.lm.steps} AdamW steps on "
                  f"Tiny Shakespeare (characters), context T = {T}; then windows of {T2}: "
                  f"loss at positions 0..{T - 1} and {T}..{T2 - 1}",
                  ["positions", "parameters", f"val loss (T={T})", f"loss 0..{T - 1}",
                   f"loss {T}..{T2 - 1}", f"reads {T2} tokens?"],
                  formats={f"val loss (T={T})": ".3f"})
    for position, name in VARIANTS.items():
        n = numbers[position]
        reads = "yes, same weights" if n["long_runs"] else f"no: the table has {T} rows"
        table.add_row(name, n["parameters"], n["val_loss"], n["long_loss_inside"],
                      n["long_loss_beyond"], reads)
    return table


def expected_outcomes(numbers: dict) -> list[Check]:
    T, T2 = numbers["block_size"], numbers["long_length"]
    learned, rope, none = numbers["learned"], numbers["rope"], numbers["none"]
    unigram = numbers["unigram_loss"]
    worse_beyond = all(n["long_runs"] and n["long_loss_beyond"] > n["long_loss_inside"]
                       for n in (rope, none))
    return [
        Check(f"rotary learns at least as well as learned positions at equal steps (val "
              f"{rope['val_loss']:.3f} <= {learned['val_loss']:.3f} + 0.02)",
              rope["val_loss"] <= learned["val_loss"] + 0.02),
        Check(f"with no positions at all the model still learns order from the causal mask (val "
              f"{none['val_loss']:.3f}, far below the {unigram:.2f} of a model that "
              f"ignores the context)", none["val_loss"] < unigram - 0.5),
        Check(f"learned positions cannot read {T2} tokens (the model refuses: "
              f"{learned['long_refusal'] or 'it did not'})", not learned["long_runs"]),
        Check(f"rotary and none read {T2} tokens with the weights trained at {T}, but neither "
              f"extrapolates for free: the loss at positions {T}..{T2 - 1} is higher than at "
              f"0..{T - 1} (rotary {fmt(rope['long_loss_beyond'])} vs "
              f"{fmt(rope['long_loss_inside'])}, none {fmt(none['long_loss_beyond'])} vs "
              f"{fmt(none['long_loss_inside'])})", worse_beyond),
    ]


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def positions_figure(numbers: dict) -> Figure:
    T, T2 = numbers["block_size"], numbers["long_length"]
    fig = new_figure(9.0, 3.4)
    curves, per_position = fig.subplots(1, 2)
    for i, (position, name) in enumerate(VARIANTS.items()):
        n, colour = numbers[position], f"C{i}"  # one colour per variant in both panels
        curves.plot(n["val_steps"], n["val_curve"], marker="o", markersize=3, label=name,
                    color=colour)
        if n["long_loss_per_position"] is not None:
            per_position.plot(range(T2), n["long_loss_per_position"], linewidth=1.2, label=name,
                              color=colour)
    label_axes(curves, xlabel="training step", ylabel="validation loss",
               title=f"training at context {T}")
    curves.legend(fontsize=LABEL_PT)
    per_position.axvline(T - 0.5, color="gray", linestyle="--", linewidth=1,
                         label=f"trained context ({T})")
    label_axes(per_position, xlabel="position in the window", ylabel="loss",
               title=f"windows of {T2} (learned cannot read them)")
    per_position.legend(fontsize=LABEL_PT)
    return fig
