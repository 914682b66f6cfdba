"""QK-norm: at a learning rate high enough to make attention logits grow, keep them in check.

An attention logit is q . k / sqrt(d). Nothing in a plain block bounds it: the query and key
projections can grow with every step, and at a high learning rate they do, until the softmax
saturates (one key takes all the weight, and its gradient vanishes). QK-norm (Qwen3, OLMo 2,
the speedrun records) passes each head's q and k through an RMSNorm before the dot product, so
their length is set by a learned gain alone. Two character models on Tiny Shakespeare, with and
without `qk_norm`, train the same steps on the same batches at that learning rate; the largest
logit (over every layer, head and causal query-key pair of a fixed batch) is read as they train.
Notation: B = batch, H = heads, T = positions, d = head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.attention import repeat_kv
from glassgpt.experiments.charlm import (
    CharLMSettings,
    model_config,
    train_char_lm,
    validation_windows,
)
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.experiments.tasks import single_thread
from glassgpt.figures import LABEL_PT, label_axes, new_figure, save_figure
from glassgpt.model import GPT, eval_mode

VARIANTS = {False: "without QK-norm", True: "with QK-norm"}


@dataclass(frozen=True)
class QKNormSettings:
    lm: CharLMSettings = CharLMSettings(lr=3e-2)
    watch_every: int = 25  # steps between readings of the largest logit
    watch_windows: int = 8  # the fixed batch the logits are read on


QUICK = QKNormSettings(lm=CharLMSettings(block_size=32, steps=100, eval_every=50,
                                         eval_windows=32, lr=3e-2), watch_every=25)


@torch.no_grad()
def largest_logit(model: GPT, idx: Tensor) -> float:
    """The largest |q . k| / sqrt(d) of any layer, head and causal (query, key) pair for idx
    (B, T), with the q and k each block's attention really uses (`project`)."""
    with eval_mode(model):
        streams = [x for _, x in model.layers(idx)]  # L + 1 of (B, T, C)
        largest = 0.0
        for block, x in zip(model.blocks, streams[:-1], strict=True):  # x: the block's input
            attn = block.attn
            q, k, _ = attn.project(block.ln1(x) if block.pre_ln else x)  # (B, H, T, d), ...
            k = repeat_kv(k, attn.groups)  # (B, H, T, d)
            logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
            T = logits.shape[-1]
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            largest = max(largest, logits.abs().masked_fill(~causal, 0.0).max().item())
    return largest


def train_watching_logits(qk_norm: bool, s: QKNormSettings, seed: int) -> dict[str, Any]:
    watch, _ = validation_windows(s.lm.block_size, s.watch_windows)  # (B, T)
    steps, logits = [], []

    def read_logits(step: int, model: GPT) -> None:
        if step % s.watch_every == 0 or step == 1:
            steps.append(step)
            logits.append(largest_logit(model, watch))

    config = model_config(s.lm, qk_norm=qk_norm)
    torch.manual_seed(seed)
    steps.append(0)
    logits.append(largest_logit(GPT(config), watch))  # the same initial weights as training's
    trained = train_char_lm(config, s.lm, seed, after_step=read_logits)
    return {"logit_steps": steps, "largest_logits": logits, "largest_logit": max(logits),
            "final_logit": logits[-1], "val_loss": trained.final_val,
            "val_steps": trained.val_steps, "val_curve": trained.val_losses,
            "train_losses": trained.train_losses}


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    s = QUICK if quick else QKNormSettings()
    with single_thread():
        numbers = {name: train_watching_logits(qk_norm, s, seed)
                   for qk_norm, name in VARIANTS.items()}
    numbers["lr"] = s.lm.lr
    pictures = [save_figure(qknorm_figure(numbers), out_dir / "qknorm.png")]
    return ExperimentResult(
        name="qknorm",
        summary=f"attention logits at learning rate {s.lm.lr:g}, with and without QK-norm "
                f"({s.lm.steps} steps, seed {seed})",
        tables=[results_table(numbers, s)], pictures=pictures, numbers=numbers,
        checks=expected_outcomes(numbers))


def results_table(numbers: dict[str, Any], s: QKNormSettings) -> Table:
    table = Table(f"{s.lm.n_layer} layers, {s.lm.n_head} heads, width {s.lm.n_embd}, "
                  f"{s.lm.steps} AdamW steps at lr {s.lm.lr:g} on Tiny Shakespeare (characters), "
                  f"context {s.lm.block_size}; logit = q . k / sqrt(d), the largest over every "
                  f"layer, head and causal pair of {s.watch_windows} fixed windows",
                  ["model", "largest logit at init", "largest logit in training",
                   "largest logit at the end", "val loss"],
                  formats={"largest logit at init": ".2f", "largest logit in training": ".1f",
                           "largest logit at the end": ".1f", "val loss": ".3f"})
    for name in VARIANTS.values():
        n = numbers[name]
        table.add_row(name, n["largest_logits"][0], n["largest_logit"], n["final_logit"],
                      n["val_loss"])
    return table


def expected_outcomes(numbers: dict[str, Any]) -> list[Check]:
    plain, normed = numbers[VARIANTS[False]], numbers[VARIANTS[True]]
    return [
        Check(f"without QK-norm the largest logit grows to over 3x the one with it "
              f"({plain['largest_logit']:.1f} vs {normed['largest_logit']:.1f})",
              plain["largest_logit"] > 3 * normed["largest_logit"]),
        Check(f"with QK-norm the loss is lower (val {normed['val_loss']:.3f} vs "
              f"{plain['val_loss']:.3f})", normed["val_loss"] < plain["val_loss"]),
    ]


def qknorm_figure(numbers: dict[str, Any]) -> Figure:
    fig = new_figure(9.0, 3.4)
    logits, losses = fig.subplots(1, 2)
    for name in VARIANTS.values():
        n = numbers[name]
        logits.plot(n["logit_steps"], n["largest_logits"], marker="o", markersize=3, label=name)
        losses.plot(n["val_steps"], n["val_curve"], marker="o", markersize=3, label=name)
    logits.set_yscale("log")
    label_axes(logits, xlabel="training step", ylabel="largest |q . k| / sqrt(d)",
               title=f"attention logits at lr {numbers['lr']:g}")
    logits.legend(fontsize=LABEL_PT)
    label_axes(losses, xlabel="training step", ylabel="validation loss", title="loss")
    losses.legend(fontsize=LABEL_PT)
    return fig
