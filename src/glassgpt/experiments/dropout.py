"""Dropout on attention weights: train vs eval vs no_grad, and the fused path's dropout_p.

`model.eval()` is what turns dropout off; `torch.no_grad()` only stops gradient tracking and
changes nothing about dropout. In training mode the dropped weights are rescaled by 1/(1-p), so a
row of attention weights no longer sums to 1 (only its expectation does). The fused kernel takes
dropout as an argument (`dropout_p`), so the module must pass 0 outside training; passing it
unconditionally is a classic bug that keeps dropping at evaluation time.
Notation: B = batch, T = positions, C = width, H = heads, d = C / H.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.attention import MultiHeadSelfAttention
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.figures import (
    MASKED_NOTE,
    TICK_PT,
    label_axes,
    labelled_colorbar,
    new_figure,
    save_figure,
    show_attention,
)
from glassgpt.hooks import recorded

P = 0.5
SAME = 1e-6


def attention_in_mode(attn: MultiHeadSelfAttention, x: Tensor, training: bool, no_grad: bool,
                      seed: int) -> tuple[Tensor, Tensor]:
    """(output, weights) of the explicit path with the module in train or eval mode: the
    weights as multiplied into v, so after the attention dropout (the pattern, watched, makes
    the module take that path)."""
    attn.train(training)
    torch.manual_seed(seed)
    watched = (attn.hook_pattern, attn.attn_dropout)
    with torch.set_grad_enabled(not no_grad), recorded(*watched) as seen:
        y = attn(x)
    return y.detach(), seen[1].detach()  # seen: the pattern, then it after dropout


def modes_table(attn: MultiHeadSelfAttention, x: Tensor, seed: int) -> tuple[Table, dict]:
    """Each mode (train/eval, with/without no_grad): does dropout act, and what do rows sum to?"""
    _, eval_weights = attention_in_mode(attn, x, training=False, no_grad=False, seed=seed)
    table = Table(f"explicit path, attention dropout p={P}",
                  ["mode", "dropout active", "row sum min", "row sum mean", "row sum max",
                   "two calls equal"])
    numbers = {}
    for training in (True, False):
        for no_grad in (False, True):
            name = ("train()" if training else "eval()") + (" + no_grad" if no_grad else "")
            _, w1 = attention_in_mode(attn, x, training, no_grad, seed)
            _, w2 = attention_in_mode(attn, x, training, no_grad, seed + 1)
            sums = w1.sum(dim=-1)  # (B, H, T)
            active = (w1 - eval_weights).abs().max().item() > SAME
            repeatable = (w1 - w2).abs().max().item() <= SAME
            table.add_row(name, active, sums.min().item(), sums.mean().item(),
                          sums.max().item(), repeatable)
            numbers[name] = {"dropout_active": active, "row_sum_min": sums.min().item(),
                             "row_sum_max": sums.max().item(), "repeatable": repeatable}
    return table, numbers


def fused_table(attn: MultiHeadSelfAttention, x: Tensor, seed: int) -> tuple[Table, dict]:
    """The module's SDPA path in each mode, and the bug of always passing dropout_p."""
    attn.eval()
    with torch.no_grad():
        with recorded(attn.hook_pattern):  # watched: the explicit path, eval: no dropout
            reference = attn(x)
        calls = {"fused, eval()": fused_output(attn, x, training=False, seed=seed),
                 "fused, train()": fused_output(attn, x, training=True, seed=seed),
                 "BUG: SDPA with dropout_p=p in eval()": buggy_eval_output(attn, x, seed)}
    table = Table("fused path (scaled_dot_product_attention) against the explicit path in eval()",
                  ["call", "max |Δ|", "dropping"])
    numbers = {}
    for name, y in calls.items():
        diff = (y - reference).abs().max().item()
        table.add_row(name, diff, diff > SAME)
        numbers[name] = diff
    attn.eval()
    return table, numbers


def fused_output(attn: MultiHeadSelfAttention, x: Tensor, training: bool, seed: int) -> Tensor:
    attn.train(training)
    torch.manual_seed(seed)
    return attn(x)  # unwatched: the fused path


def buggy_eval_output(attn: MultiHeadSelfAttention, x: Tensor, seed: int) -> Tensor:
    """What a module that forgets `if self.training` computes in eval mode."""
    B, T, C = x.shape
    q, k, v = (attn.split_heads(t) for t in attn.qkv(x).split(C, dim=2))  # 3 x (B, H, T, d)
    torch.manual_seed(seed)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=True)  # (B, H, T, d)
    return attn.proj(y.transpose(1, 2).reshape(B, T, C))


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    del quick  # already tiny
    torch.manual_seed(seed)
    attn = MultiHeadSelfAttention(16, 2, causal=True, dropout=P)
    x = torch.randn(2, 6, 16)
    modes, mode_numbers = modes_table(attn, x, seed)
    fused, fused_numbers = fused_table(attn, x, seed)
    # Head 0 of sequence 0, eval then train: (2, T, T)
    heatmaps = torch.stack([attention_in_mode(attn, x, training, no_grad=False, seed=seed)[1][0, 0]
                            for training in (False, True)])
    picture = save_figure(weights_figure(heatmaps), out_dir / "dropout_weights.png")
    train_sums = mode_numbers["train()"]
    return ExperimentResult(
        name="dropout", summary=f"attention dropout p={P}: train vs eval vs no_grad",
        tables=[modes, fused], pictures=[picture],
        numbers={"modes": mode_numbers, "fused": fused_numbers},
        checks=[
            Check("train(): rows no longer sum to 1",
                  train_sums["row_sum_min"] < 1 - SAME or train_sums["row_sum_max"] > 1 + SAME),
            Check("eval(): no dropout, rows sum to 1, repeatable",
                  not mode_numbers["eval()"]["dropout_active"]
                  and mode_numbers["eval()"]["repeatable"]),
            Check("no_grad() does not turn dropout off (train() + no_grad still drops)",
                  mode_numbers["train() + no_grad"]["dropout_active"]),
            Check("the fused path drops only when training",
                  fused_numbers["fused, eval()"] <= SAME
                  and fused_numbers["fused, train()"] > SAME),
        ])


def weights_figure(heatmaps: Tensor) -> Figure:
    """Head 0 of sequence 0, eval then train (2, T, T), each row's sum written beside it."""
    fig = new_figure(7.6, 3.4)
    axes = fig.subplots(1, 2)
    vmax = heatmaps.max().item()
    for ax, weights, title in zip(axes, heatmaps, ("eval()", f"train(), p={P}"), strict=True):
        image = show_attention(ax, weights, cmap="magma", vmax=vmax)
        T = weights.shape[0]
        ax.set_xticks(range(T))
        ax.set_yticks(range(T))
        label_axes(ax, xlabel="key", ylabel="query", title=title)
        for t, row_sum in enumerate(weights.sum(dim=-1).tolist()):
            ax.text(T - 0.3, t, f" row sum {row_sum:.2f}", va="center", fontsize=TICK_PT)
    labelled_colorbar(fig, image, list(axes), f"attention weight after dropout\n({MASKED_NOTE})")
    return fig
