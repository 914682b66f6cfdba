"""Features over time: which features the weights at each step represent.

Two readings, each checked against ground truth on a toy model of superposition whose features
are known (experiments/feature_timeline.py, tests/test_features_over_time.py):

- **known features** (`known_features_over_time`): where the features are known, a feature's
  strength at step s is read from the weights themselves, the norm of its column of W (Elhage
  et al. 2022's toy model: feature i is written as W[:, i] and read back by W[:, i]^T; a norm
  near 1 is a feature represented, near 0 one dropped). A feature is recovered at the first
  snapshot from which its strength stays at or above `threshold`.
- **a dictionary trained at the end, read back through the snapshots**
  (`dictionary_over_time`): each snapshot's activations are encoded by the final dictionary;
  its explained variance there says whether the residual basis still allows the reading. A
  step is *readable* when that explained variance is at least `bar` (0.9 by default) times
  the dictionary's explained variance at the last step, the one it was trained on; only at
  readable steps are a latent's density and top contexts reported, and a known feature is
  read there (`known_features_through_dictionary`) as the norm of what its matched latent
  reconstructs of the feature's own activation. At a step below the bar the dictionary's basis
  is not the model's, and the reading says nothing rather than something wrong.

Notation: S snapshots, n known features, d the width they live in, F latents, N activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core.hooked import run_with_cache
from glassgpt.interp.sae.encoding import pre_acts
from glassgpt.interp.sae.model import SAE
from glassgpt.model import eval_mode

REPRESENTED = 0.5  # a feature's strength (its norm of 1 when fully represented) at which it counts
READABLE = 0.9  # the share of its final explained variance at which the dictionary reads a step
MATCHED = 0.9  # |cosine| of a latent's decoder row with a feature's final direction to match it


@dataclass(frozen=True)
class FeaturesOverTime:
    """Per snapshot, each known feature's strength (None at a step the reading cannot see):
    strength[s][i]; `recovered_at` and `recovery_order` read it against `threshold`."""

    steps: list[int]
    strength: list[list[float] | None]  # S x n
    threshold: float = REPRESENTED

    def recovered_at(self) -> list[int | None]:
        """For each feature, the first seen step from which its strength stays >= threshold at
        every later seen step (None: never, or not at the last seen step)."""
        seen = [(step, row) for step, row in zip(self.steps, self.strength, strict=True)
                if row is not None]
        if not seen:
            return []
        result: list[int | None] = []
        for i in range(len(seen[0][1])):
            at = None
            for step, row in seen:  # the start of the last run of steps at or above
                staying = row[i] >= self.threshold
                at = (at if at is not None else step) if staying else None
            result.append(at)
        return result

    def recovery_order(self) -> list[int]:
        """The recovered features, the first recovered first (ties: by index)."""
        at = self.recovered_at()
        return sorted((i for i, s in enumerate(at) if s is not None), key=lambda i: (at[i], i))

    def to_json(self) -> dict:
        return {"steps": self.steps, "strength": self.strength, "threshold": self.threshold,
                "recovered_at": self.recovered_at(), "recovery_order": self.recovery_order()}


def known_features_over_time(steps: Sequence[int], weights: Sequence[Tensor],
                             threshold: float = REPRESENTED) -> FeaturesOverTime:
    """Each known feature's strength at each step from the weights W (d, n) that write it: the
    norm of its column (a toy model of superposition's ||W_i||)."""
    check_steps(steps, weights)
    strength = [w.detach().float().norm(dim=0).tolist() for w in weights]  # S x (n,)
    return FeaturesOverTime(list(steps), strength, threshold)


@dataclass(frozen=True)
class DictionaryOverTime:
    """The final dictionary read on each snapshot's activations: its explained variance, and
    at readable steps each latent's density and its top activations (indices into the N
    activations of that step; a model's windows decode them as (window, position))."""

    steps: list[int]
    explained_variance: list[float]
    bar: float  # a share of the last step's explained variance
    density: list[list[float] | None]  # S x F, None where not readable
    top: list[list[list[int]] | None]  # S x F x top_k, None where not readable

    @property
    def readable(self) -> list[bool]:
        """The steps read: explained variance at least `bar` times the last step's."""
        floor = self.bar * self.explained_variance[-1]
        return [ev >= floor for ev in self.explained_variance]

    def contexts(self, step: int, latent: int, positions: int) -> list[tuple[int, int]] | None:
        """A latent's top activations at `step` as (window, position), for activations read
        from windows of `positions` tokens (activations_through_snapshots' order); None where
        the step is not read."""
        top = self.top[self.steps.index(step)]
        return None if top is None else [divmod(i, positions) for i in top[latent]]

    def to_json(self) -> dict:
        return {"steps": self.steps, "explained_variance": self.explained_variance,
                "bar": self.bar, "readable": self.readable, "density": self.density,
                "top": self.top}


def explained_variance(x: Tensor, reconstruction: Tensor) -> float:
    """1 - ||x - x_hat||^2 / ||x - mean(x)||^2 over the N activations x (N, d)."""
    residual = (x - reconstruction).pow(2).sum()
    spread = (x - x.mean(dim=0)).pow(2).sum().clamp(min=1e-12)
    return float(1 - residual / spread)


@torch.no_grad()
def dictionary_over_time(sae: SAE, steps: Sequence[int], activations: Sequence[Tensor],
                         bar: float = READABLE, top_k: int = 5) -> DictionaryOverTime:
    """The final dictionary `sae` on each step's activations (N, d), the last step being the
    one it was trained at: explained variance always; density and top activations only at the
    steps where it explains at least `bar` times what it explains at the last step."""
    check_steps(steps, activations)
    evs = [explained_variance(x.float(), sae(x.to(sae.W_enc.dtype)).float())
           for x in activations]
    floor = bar * evs[-1]
    density: list[list[float] | None] = []
    top: list[list[list[int]] | None] = []
    for x, ev in zip(activations, evs, strict=True):
        if ev < floor:
            density.append(None)
            top.append(None)
            continue
        latents = sae.encode(x.to(sae.W_enc.dtype))  # (N, F)
        density.append((latents > 0).float().mean(dim=0).tolist())
        k = min(top_k, latents.shape[0])
        top.append(latents.topk(k, dim=0).indices.T.tolist())  # (F, k)
    return DictionaryOverTime(list(steps), evs, bar, density, top)


@torch.no_grad()
def match_latents(sae: SAE, directions: Tensor, at_least: float = MATCHED) -> list[int | None]:
    """For each known feature's final activation (n, d) (its direction at its norm), the latent
    that reads it: among the latents whose decoder row has |cosine| >= `at_least` with it, the
    one whose detector responds most (a decoder row alone can match a latent whose encoder
    has gone elsewhere); None when no such latent responds."""
    rows = sae.W_dec.detach().float()
    cosines = (unit_rows(directions.float()) @ unit_rows(rows).T).abs()  # (n, F)
    response = pre_acts(sae, directions.to(sae.W_enc.dtype)).float().relu()  # (n, F)
    score = torch.where(cosines >= at_least, response, torch.zeros_like(response))
    best = score.max(dim=1)
    return [int(j) if v > 0 else None
            for v, j in zip(best.values.tolist(), best.indices.tolist(), strict=True)]


@torch.no_grad()
def known_features_through_dictionary(sae: SAE, reading: DictionaryOverTime,
                                      probes: Sequence[Tensor], matched: Sequence[int | None],
                                      threshold: float = REPRESENTED) -> FeaturesOverTime:
    """Each known feature read through the final dictionary at the readable steps: the norm of
    what its matched latent's detector (its rectified pre-activation) reconstructs of the
    feature's activation at that step (probes: S
    tensors (n, d), row i the activation of feature i alone at unit magnitude); 0 for a
    feature with no matched latent; None at steps below the bar."""
    check_steps(reading.steps, probes)
    row_norms = sae.W_dec.detach().float().norm(dim=1)  # (F,)
    strength: list[list[float] | None] = []
    for probe, readable in zip(probes, reading.readable, strict=True):
        if not readable:
            strength.append(None)
            continue
        # the latent's detector alone (its pre-activation, rectified): what it would read of
        # the feature, before a TopK or threshold lets another latent take the activation
        latents = pre_acts(sae, probe.to(sae.W_enc.dtype)).float().relu()  # (n, F)
        strength.append([float(latents[i, j] * row_norms[j]) if j is not None else 0.0
                         for i, j in enumerate(matched)])
    return FeaturesOverTime(reading.steps, strength, threshold)


@torch.no_grad()
def activations_through_snapshots(models: Sequence[nn.Module], hook: str,
                                  windows: Tensor) -> list[Tensor]:
    """Each snapshot model's activations at `hook` on the same windows (B, T): S x (B * T, d),
    activation b * T + t being window b's position t."""
    out = []
    for model in models:
        with eval_mode(model):
            _, cache = run_with_cache(model, windows, [hook])
        out.append(cache[hook].flatten(0, 1))  # (B, T, d) -> (B * T, d)
    return out


def check_steps(steps: Sequence[int], per_step: Sequence[Tensor]) -> None:
    if len(steps) != len(per_step) or not steps:
        raise InputError(f"one entry per step is needed: {len(steps)} steps, "
                         f"{len(per_step)} entries")
    if list(steps) != sorted(set(steps)):
        raise InputError(f"steps must increase: {list(steps)[:8]}")


def unit_rows(rows: Tensor) -> Tensor:
    return rows / rows.norm(dim=-1, keepdim=True).clamp(min=1e-12)
