"""Why residuals: 8 stacked blocks with and without skip connections, on "copy the token 3 back".

Three stacks of blocks (the library's `TransformerBlock`, Pre-LN and Post-LN, and beside them
`ResidualFreeBlock`, its Pre-LN parts with both skips taken out, which only this experiment
wants) are measured at initialisation and trained. Without the skip path
every block averages positions together (attention is a weighted mean), so by the top of the stack
all positions carry nearly the same vector (representation collapse: cosine similarity ~1) and no
gradient can tell them apart; the loss stays at chance, ln(10) = 2.30.
Notation: B = batch, T = positions, C = width, V = vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor, nn

from glassgpt.block import TransformerBlock
from glassgpt.errors import ConfigError
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.experiments.tasks import (
    accuracy_per_target,
    copy_back_batch,
    single_thread,
    train_copier,
)
from glassgpt.figures import LABEL_PT, label_axes, new_figure, save_figure

OFFSET = 3
VARIANTS = {  # name -> (pre_ln, residual)
    "Pre-LN + residual": (True, True),
    "Post-LN + residual": (False, True),
    "Pre-LN, no residual": (True, False),
}


@dataclass(frozen=True)
class ResidualSettings:
    vocab_size: int = 10
    seq_len: int = 12
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 8
    steps: int = 300
    batch_size: int = 64
    lr: float = 1e-3
    loss_window: int = 50  # steps averaged for the "first" and "last" loss
    eval_sequences: int = 1000


QUICK = ResidualSettings(d_model=32, steps=100, batch_size=32, loss_window=25)


class ResidualFreeBlock(TransformerBlock):
    """A Pre-LN block with both skip connections removed: z = ffn(ln2(attn(ln1(x)))).

    The same parts, parameters and initialisation as `TransformerBlock(C, H)`; only the two
    residual sums are gone, so nothing carries a position's own vector past a block."""

    def forward(self, x: Tensor) -> Tensor:
        a = self.attn(self.ln1(x))  # (B, T, C): every position a weighted mean of the others
        return self.ffn(self.ln2(a))  # (B, T, C)


def make_block(s: ResidualSettings, pre_ln: bool, residual: bool) -> TransformerBlock:
    """One block of a variant: the library's block, or the residual-free Pre-LN one."""
    if residual:
        return TransformerBlock(s.d_model, s.n_heads, pre_ln=pre_ln)
    if not pre_ln:
        raise ConfigError("the residual-free block of this experiment is Pre-LN")
    return ResidualFreeBlock(s.d_model, s.n_heads)


class BlockStack(nn.Module):
    """Embeddings, `n_layers` Transformer blocks, a final LayerNorm and one output layer."""

    def __init__(self, s: ResidualSettings, pre_ln: bool, residual: bool):
        super().__init__()
        self.tok_emb = nn.Embedding(s.vocab_size, s.d_model)
        self.pos_emb = nn.Embedding(s.seq_len, s.d_model)
        self.blocks = nn.ModuleList(make_block(s, pre_ln, residual) for _ in range(s.n_layers))
        self.ln_f = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab_size)

    def hidden(self, idx: Tensor) -> Tensor:
        """The last block's output (B, T, C)."""
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, idx: Tensor) -> Tensor:
        """idx (B, T) -> logits (B, T, 1, V): one target, the token OFFSET back."""
        return self.head(self.ln_f(self.hidden(idx))).unsqueeze(2)


def collapse_score(hidden: Tensor) -> float:
    """Mean cosine similarity between the vectors of different positions of one sequence.

    hidden (B, T, C). 1 means every position carries the same direction (collapse).
    """
    unit = F.normalize(hidden, dim=-1)
    similarity = unit @ unit.transpose(1, 2)  # (B, T, T)
    T = hidden.shape[1]
    off_diagonal = ~torch.eye(T, dtype=torch.bool, device=hidden.device)
    return similarity[:, off_diagonal].mean().item()


@dataclass
class VariantOutcome:
    collapse_at_init: float
    losses: list[float]
    accuracy: float


def run_variant(pre_ln: bool, residual: bool, seed: int, s: ResidualSettings) -> VariantOutcome:
    torch.manual_seed(seed)
    model = BlockStack(s, pre_ln, residual)
    idx, targets = copy_back_batch(s.eval_sequences, s.seq_len, s.vocab_size, (OFFSET,),
                                   torch.Generator().manual_seed(123_456))
    with torch.no_grad():
        collapse = collapse_score(model.hidden(idx[:256]))
    data = torch.Generator().manual_seed(seed + 10_000)
    losses = train_copier(model, (OFFSET,), s.vocab_size, s.seq_len, s.steps, s.batch_size,
                          s.lr, data)
    with torch.no_grad():
        accuracy = accuracy_per_target(model(idx), targets)[0]
    return VariantOutcome(collapse, losses, accuracy)


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    s = QUICK if quick else ResidualSettings()
    with single_thread():
        outcomes = {name: run_variant(pre_ln, residual, seed, s)
                    for name, (pre_ln, residual) in VARIANTS.items()}
    window = s.loss_window
    table = Table(f"{s.n_layers} blocks, width {s.d_model}, {s.n_heads} heads, {s.steps} Adam "
                  f"steps (lr {s.lr:g}); chance loss ln {s.vocab_size} = "
                  f"{math.log(s.vocab_size):.2f}",
                  ["model", "collapse at init", f"loss first {window}", f"loss last {window}",
                   "accuracy"], formats={"accuracy": ".1%"})
    numbers = {}
    for name, o in outcomes.items():
        first, last = mean(o.losses[:window]), mean(o.losses[-window:])
        table.add_row(name, o.collapse_at_init, first, last, o.accuracy)
        numbers[name] = {"collapse_at_init": o.collapse_at_init, "loss_first": first,
                         "loss_last": last, "accuracy": o.accuracy, "losses": o.losses}
    picture = save_figure(loss_curves_figure(outcomes, math.log(s.vocab_size)),
                          out_dir / "residual_loss.png")
    return ExperimentResult(
        name="residual",
        summary=f"8-block stacks on 'output the token {OFFSET} back', seed {seed}",
        tables=[table], pictures=[picture], numbers=numbers,
        checks=expected_outcomes(numbers, math.log(s.vocab_size)))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def expected_outcomes(numbers: dict[str, dict], chance: float) -> list[Check]:
    no_res = numbers["Pre-LN, no residual"]
    checks = [
        Check(f"without residuals the positions collapse at init (cosine > 0.9; got "
              f"{no_res['collapse_at_init']:.3f})", no_res["collapse_at_init"] > 0.9),
        Check(f"without residuals the loss stays near chance (last > 2.0; got "
              f"{no_res['loss_last']:.2f})", no_res["loss_last"] > 2.0),
    ]
    for name in ("Pre-LN + residual", "Post-LN + residual"):
        last = numbers[name]["loss_last"]
        checks.append(Check(f"{name} learns (last loss < half of chance; got {last:.2f})",
                            last < chance / 2))
    return checks


def loss_curves_figure(outcomes: dict[str, VariantOutcome], chance: float) -> Figure:
    fig = new_figure(6.0, 3.2)
    ax = fig.subplots()
    for name, outcome in outcomes.items():
        ax.plot(range(1, len(outcome.losses) + 1), outcome.losses, label=name, linewidth=1.2)
    ax.axhline(chance, color="gray", linestyle="--", linewidth=1, label="chance (ln 10)")
    label_axes(ax, xlabel="training step", ylabel="training loss",
               title=f"8 blocks on 'copy the token {OFFSET} back'")
    ax.legend(fontsize=LABEL_PT)
    return fig
