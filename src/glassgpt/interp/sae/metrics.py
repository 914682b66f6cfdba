"""How good a dictionary is, as SAELens's evals define it (sae_lens.evals, 6.x).

Over N activations x (N, d_in) read at the dictionary's hook (a transcoder's target y at its
output point; y = x otherwise), with latents f and reconstruction x_hat:

    l0                  mean over tokens of the latents that are not 0
    mse                 mean over tokens of sum_d (y - x_hat)^2       (training's MSE)
    explained_variance  1 - mse / Var(y), Var(y) = E||y||^2 - ||E y||^2 summed over d
                        (SAELens's ExplainedVarianceCalculator, sums in float64)
    feature_density     (d_sae,) the fraction of tokens on which each latent fires
    dead / dense        latents that fire on no token / on more than `dense_threshold`
                        (0.1) of them (SAELens reports the densities; these counts are ours)
    log_density         log10(feature_density + 1e-10), SAELens's sparsity.safetensors
and, over the next-token predictions of the same windows, with the dictionary spliced in at
its output point (`run_with_saes`), the model untouched, and that point set to zero:

    ce_loss_recovered   (ce_zero_ablated - ce_spliced) / (ce_zero_ablated - ce_clean)
                        (SAELens's ce_loss_score)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.interp.core.hooked import as_glass, run_with_cache, run_with_hooks
from glassgpt.interp.core.names import stop_at_layer
from glassgpt.interp.sae.model import SAE
from glassgpt.interp.sae.splice import run_with_saes

DENSE_THRESHOLD = 0.1
LOG_DENSITY_EPS = 1e-10  # SAELens's: a latent that never fired reads -10


@dataclass(frozen=True)
class DictionaryMetrics:
    l0: float
    mse: float
    explained_variance: float
    feature_density: Tensor  # (d_sae,)
    dead: int
    dense: int
    tokens: int
    ce_loss_clean: float | None = None
    ce_loss_spliced: float | None = None
    ce_loss_zero_ablated: float | None = None

    @property
    def ce_loss_recovered(self) -> float | None:
        if self.ce_loss_clean is None:
            return None
        gap = self.ce_loss_zero_ablated - self.ce_loss_clean
        return math.nan if gap == 0 else (self.ce_loss_zero_ablated - self.ce_loss_spliced) / gap

    @property
    def log_density(self) -> Tensor:
        return log_density(self.feature_density)

    def density_histogram(self, bins: int = 20) -> tuple[Tensor, Tensor]:
        """(counts (bins,), edges (bins + 1,)) of log10 feature density over [-10, 0]."""
        return density_histogram(self.feature_density, bins)

    def summary(self) -> dict[str, float | int | None]:
        """The scalar metrics, for a log line or JSON."""
        return {"l0": self.l0, "mse": self.mse, "explained_variance": self.explained_variance,
                "ce_loss_clean": self.ce_loss_clean, "ce_loss_spliced": self.ce_loss_spliced,
                "ce_loss_zero_ablated": self.ce_loss_zero_ablated,
                "ce_loss_recovered": self.ce_loss_recovered, "dead": self.dead,
                "dense": self.dense, "tokens": self.tokens}


def log_density(density: Tensor) -> Tensor:
    return torch.log10(density + LOG_DENSITY_EPS)


def density_histogram(density: Tensor, bins: int = 20) -> tuple[Tensor, Tensor]:
    values = log_density(density.double()).clamp(-10, 0)
    counts = torch.histc(values, bins=bins, min=-10, max=0)
    return counts.long(), torch.linspace(-10, 0, bins + 1, dtype=torch.float64)


class ReconstructionMeter:
    """Sums over batches for l0, mse, explained variance and density (float64, on the CPU,
    as SAELens sums them: Var(y) is a difference of two large numbers)."""

    def __init__(self, d_sae: int):
        self.tokens = 0
        self.active = 0.0
        self.squared_error = 0.0
        self.squared_norm = 0.0
        self.sum_y: Tensor | None = None
        self.fired = torch.zeros(d_sae, dtype=torch.float64)

    def add(self, y: Tensor, f: Tensor, y_hat: Tensor) -> None:
        """y, y_hat (N, d_out); f: the latents (N, d_sae), or already each latent's count of
        the rows it fired on (d_sae,), as a trainer has them (a pass over f the fewer)."""
        firing = torch.count_nonzero(f, dim=0) if f.dim() == 2 else f  # (d_sae,)
        y, y_hat = y.double(), y_hat.double()
        self.tokens += y.shape[0]
        self.active += float(firing.sum())
        self.squared_error += float((y - y_hat).pow(2).sum())
        self.squared_norm += float(y.pow(2).sum())
        batch_sum = y.sum(0).cpu()
        self.sum_y = batch_sum if self.sum_y is None else self.sum_y + batch_sum
        self.fired += firing.double().cpu()

    def result(self, dense_threshold: float = DENSE_THRESHOLD, **ce: float
               ) -> DictionaryMetrics:
        n = self.tokens
        mse = self.squared_error / n
        variance = self.squared_norm / n - float((self.sum_y / n).pow(2).sum())
        explained = 1.0 - mse / variance if variance >= 1e-10 else float(mse < 1e-10)
        density = self.fired / n
        return DictionaryMetrics(l0=self.active / n, mse=mse, explained_variance=explained,
                                 feature_density=density.float(),
                                 dead=int((density == 0).sum()),
                                 dense=int((density > dense_threshold).sum()), tokens=n, **ce)


def dictionary_activations(model: nn.Module, sae: SAE, ids: Tensor) -> tuple[Tensor, Tensor]:
    """ids (B, T) -> (x (B*T, d_in) at the dictionary's hook, y (B*T, d_out) at its output
    point), read under no_grad from a run that stops after the last block it needs."""
    names = list(dict.fromkeys([sae.cfg.hook_name, sae.cfg.hook_name_out]))
    _, cache = run_with_cache(model, ids, names,
                              stop_at_layer(names, as_glass(model).config.n_layer))
    x = cache[sae.cfg.hook_name].flatten(0, -2)
    return x, cache[sae.cfg.hook_name_out].flatten(0, -2)


def cross_entropies(model: nn.Module, sae: SAE, x: Tensor, y: Tensor) -> dict[str, float]:
    """Mean next-token cross-entropy of windows x -> y (B, T): clean, with the dictionary
    spliced in, and with its output point zero-ablated."""
    def ce(logits: Tensor) -> float:
        return float(F.cross_entropy(logits.flatten(0, 1).double(), y.flatten()))

    def zero(activation: Tensor, name: str) -> Tensor:
        return torch.zeros_like(activation)

    with torch.no_grad():
        clean = ce(run_with_hooks(model, x))
        spliced = ce(run_with_saes(model, x, [sae]))
        ablated = ce(run_with_hooks(model, x, [(sae.cfg.hook_name_out, zero)]))
    return {"ce_loss_clean": clean, "ce_loss_spliced": spliced, "ce_loss_zero_ablated": ablated}


def evaluate_dictionary(model: nn.Module, sae: SAE, batches: Iterable[tuple[Tensor, Tensor]],
                        dense_threshold: float = DENSE_THRESHOLD,
                        cross_entropy: bool = True) -> DictionaryMetrics:
    """The metrics of the module docstring over windows (x, y) (B, T) of token ids, y the next
    tokens of x. Cross-entropies are means over every predicted token of all batches."""
    meter = ReconstructionMeter(sae.cfg.d_sae)
    totals = {"ce_loss_clean": 0.0, "ce_loss_spliced": 0.0, "ce_loss_zero_ablated": 0.0}
    predicted = 0
    with torch.no_grad():
        for x_ids, y_ids in batches:
            x, y = dictionary_activations(model, sae, x_ids)
            f = sae.encode(x)
            meter.add(y, f, sae.decode(f))
            if cross_entropy:
                for name, value in cross_entropies(model, sae, x_ids, y_ids).items():
                    totals[name] += value * y_ids.numel()
                predicted += y_ids.numel()
    if meter.tokens == 0:
        raise InputError("evaluate_dictionary needs at least one batch of windows")
    ce = {name: total / predicted for name, total in totals.items()} if cross_entropy else {}
    return meter.result(dense_threshold, **ce)
