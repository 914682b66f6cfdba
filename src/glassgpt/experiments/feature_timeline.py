"""Features over time, on a toy model of superposition whose features are known.

Elhage et al. (2022)'s toy model: n sparse features x (each on with probability `firing`, then
uniform in [0, 1), as `demo features` plants them) written into d < n dimensions by h = W x and
read back by x' = ReLU(W^T h + b), trained by SGD on the importance-weighted error
sum_i I_i (x_i - x'_i)^2 with I_i = decay^i. The gradient reaching feature i's column W_i scales
with I_i, so the important features should be learned first: the order their importance
predicts. The weights are kept at log-spaced steps (snapshots, the first steps dense), and read
two ways (glassgpt.interp.timeline.features_over_time): the toy's own ||W_i|| at each snapshot
(the ground truth), and a dictionary trained at the end on the final model's activations h,
read back through every snapshot where it still explains at least `bar` of their variance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.experiments.features import TOY_HOOK, SparseFeatureSource, train_on
from glassgpt.experiments.results import Check, Table, step_taken
from glassgpt.figures import LABEL_PT, label_axes, new_figure
from glassgpt.interp.sae.training import DictionarySettings
from glassgpt.interp.timeline.features_over_time import (
    READABLE,
    dictionary_over_time,
    known_features_over_time,
    known_features_through_dictionary,
    match_latents,
)


@dataclass(frozen=True)
class TimelineToySettings:
    n_features: int = 8
    width: int = 4  # d < n: the features must share dimensions to be represented beyond d
    firing: float = 0.05
    decay: float = 0.5  # importance I_i = decay^i: each feature half as important as the last
    steps: int = 2500
    lr: float = 0.3  # SGD: the step a feature's column takes is proportional to its importance
    batch: int = 128
    init_norm: float = 0.1  # every column starts at this norm (random directions), no head start
    snapshots: int = 40
    d_sae: int = 16
    sae_tokens: int = 60_000
    sae_batch: int = 256
    k: int = 1  # TopK: one latent per activation (about 0.4 features are on at a time)
    activations: int = 4096  # the fixed inputs every snapshot is read on
    bar: float = READABLE


QUICK_TIMELINE = TimelineToySettings(steps=1500, snapshots=30, activations=2048)
AGREEMENT = 0.9  # the share of (step, feature) readings the dictionary must get right


def snapshot_steps(steps: int, count: int) -> list[int]:
    """`count` log-spaced steps in 0 .. steps, 0 and the last included (the first ones dense,
    so fewer than `count` when small steps round to the same number)."""
    spaced = (round(math.exp(k * math.log(steps) / (count - 2))) for k in range(count - 1))
    return sorted({0, steps, *spaced})


def importance(s: TimelineToySettings) -> Tensor:
    return s.decay ** torch.arange(s.n_features, dtype=torch.float32)  # (n,)


def sparse_inputs(s: TimelineToySettings, rows: int, generator: torch.Generator) -> Tensor:
    on = torch.rand(rows, s.n_features, generator=generator) < s.firing
    return on * torch.rand(rows, s.n_features, generator=generator)  # (rows, n)


def train_toy(s: TimelineToySettings, seed: int) -> tuple[list[int], list[Tensor]]:
    """The toy model trained by SGD, its W (d, n) kept at the snapshot steps."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(s.width, s.n_features, generator=g)
    w = (w / w.norm(dim=0) * s.init_norm).requires_grad_()  # (d, n)
    b = torch.zeros(s.n_features, requires_grad=True)
    optimizer = torch.optim.SGD([w, b], lr=s.lr)
    keep, weights = snapshot_steps(s.steps, s.snapshots), []
    for step in range(s.steps + 1):
        if step in keep:
            weights.append(w.detach().clone())
        if step == s.steps:
            break
        x = sparse_inputs(s, s.batch, g)  # (B, n)
        out = torch.relu(x @ w.T @ w + b)  # (B, n) -> (B, d) -> (B, n)
        loss = (importance(s) * (x - out) ** 2).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step_taken()
    return keep, weights


def end_dictionary(s: TimelineToySettings, w_end: Tensor, seed: int) -> Any:
    """A TopK dictionary trained by glassgpt's trainer on the final model's activations
    h = W x (what `demo features` plants, with the final columns as its directions)."""
    settings = DictionarySettings(hook=TOY_HOOK, d_sae=s.d_sae, architecture="topk", k=s.k,
                                  tokens=s.sae_tokens, batch_tokens=s.sae_batch, lr=3e-3,
                                  normalize_activations="none", dead_tokens=s.sae_tokens // 10,
                                  eval_every=0, checkpoint_every=0, seed=seed)
    directions = w_end.T.contiguous()  # (n, d)
    return train_on(SparseFeatureSource(directions, s.firing, s.sae_batch, seed + 1), settings,
                    s.width)


def feature_timeline(s: TimelineToySettings, seed: int) -> dict[str, Any]:
    """The toy trained with snapshots, read by its own ||W_i|| and through the final
    dictionary; the numbers the check and the picture use."""
    steps, weights = train_toy(s, seed)
    truth = known_features_over_time(steps, weights)
    sae = end_dictionary(s, weights[-1], seed)
    x = sparse_inputs(s, s.activations, torch.Generator().manual_seed(seed + 2))  # (N, n)
    reading = dictionary_over_time(sae, steps, [x @ w.T for w in weights], bar=s.bar)
    final = truth.strength[-1]
    assert final is not None
    represented = [i for i, v in enumerate(final) if v >= truth.threshold]
    matched = match_latents(sae, weights[-1].T)
    matched = [j if i in represented else None for i, j in enumerate(matched)]
    through = known_features_through_dictionary(sae, reading, [w.T for w in weights], matched)
    readable = reading.readable
    agree = agreement(truth.strength, through.strength, represented, truth.threshold)
    return {"steps": steps, "importance": importance(s).tolist(), "truth": truth.to_json(),
            "dictionary": through.to_json(), "explained_variance": reading.explained_variance,
            "bar": s.bar, "represented": represented, "matched": matched,
            "first_readable": next((st for st, ok in zip(steps, readable, strict=True) if ok),
                                   None),
            "agreement": sum(agree) / max(len(agree), 1), "compared": len(agree)}


def agreement(truth: list, read: list, features: list[int], threshold: float) -> list[bool]:
    """At every step the dictionary reads, for each of `features`: whether it calls the
    feature represented exactly when the ground truth (its ||W_i||) does."""
    return [(true_row[i] >= threshold) == (row[i] >= threshold)
            for true_row, row in zip(truth, read, strict=True) if row is not None
            for i in features]


def in_importance_order(recovered_at: list[int | None], strictly: bool) -> bool:
    """The recovered features are the most important ones (a prefix of 0, 1, ...), recovered
    at increasing steps (non-decreasing where not `strictly`: the dictionary reads from its
    first readable step on, so the features there before it share that step)."""
    found = [s for s in recovered_at if s is not None]
    prefix = all(s is not None for s in recovered_at[:len(found)])
    rising = all(a < b if strictly else a <= b for a, b in zip(found, found[1:], strict=False))
    return prefix and rising and len(found) >= 2


def timeline_checks(t: dict[str, Any]) -> list[Check]:
    truth, read = t["truth"]["recovered_at"], t["dictionary"]["recovered_at"]
    return [
        Check(f"the toy model learns its features in the order of their importance: "
              f"||W_i|| reaches {t['truth']['threshold']} at steps {truth}",
              in_importance_order(truth, strictly=True)),
        Check(f"the dictionary trained at the end, read through the snapshots it explains "
              f"(from step {t['first_readable']}), agrees with ||W_i|| on "
              f"{t['agreement']:.0%} of {t['compared']} readings (>= {AGREEMENT:.0%}) and "
              f"recovers the features in the same order: {read[:len(t['represented'])]}",
              t["agreement"] >= AGREEMENT and in_importance_order(read, strictly=False)),
    ]


def timeline_table(t: dict[str, Any], s: TimelineToySettings) -> Table:
    table = Table(f"a toy model of superposition ({s.n_features} features in {s.width} "
                  f"dimensions, importance {s.decay:g}^i, SGD for {s.steps} steps, "
                  f"{len(t['steps'])} snapshots): the step each feature is recovered, by its "
                  f"own ||W_i|| and through a TopK dictionary trained at the end (read only "
                  f"where it explains >= {s.bar:.0%} of its final explained variance)",
                  ["feature", "importance", "recovered (||W_i||)", "recovered (dictionary)",
                   "latent"], formats={"importance": ".3g"})
    for i, weight in enumerate(t["importance"]):
        table.add_row(i, weight, t["truth"]["recovered_at"][i],
                      t["dictionary"]["recovered_at"][i], t["matched"][i])
    return table


def timeline_figure(t: dict[str, Any]) -> Figure:
    fig = new_figure(13.0, 3.8)
    truth_ax, read_ax, ev_ax = fig.subplots(1, 3)
    steps = [max(step, 1) for step in t["steps"]]  # step 0 drawn at 1 on the log axis
    truth = torch.tensor(t["truth"]["strength"])  # (S, n)
    for i in range(truth.shape[1]):
        truth_ax.plot(steps, truth[:, i], color=f"C{i % 10}", label=f"feature {i}")
        rows = [(st, row[i]) for st, row in zip(steps, t["dictionary"]["strength"], strict=True)
                if row is not None]
        if rows and i in t["represented"]:
            read_ax.plot(*zip(*rows, strict=True), color=f"C{i % 10}")
    for ax, title in ((truth_ax, "||W_i||, the toy's own"),
                      (read_ax, "read through the final dictionary")):
        ax.set_xscale("log")
        ax.axhline(t["truth"]["threshold"], color="black", linestyle="--", linewidth=1)
        label_axes(ax, xlabel="training step", ylabel="feature strength", title=title)
    truth_ax.legend(fontsize=LABEL_PT, loc="upper left", ncol=2)
    ev_ax.plot(steps, t["explained_variance"], color="C0")
    ev_ax.axhline(t["bar"] * t["explained_variance"][-1], color="black", linestyle="--",
                  linewidth=1)
    ev_ax.set_xscale("log")
    label_axes(ev_ax, xlabel="training step", ylabel="explained variance",
               title="the final dictionary on each snapshot")
    return fig
