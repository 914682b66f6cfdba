"""What one training step of a dictionary minimises, per architecture, as SAELens 6 trains it.

Notation: x (N, d_in) the activations read, y (N, d_out) the target (x itself, or a
transcoder's MLP output), pre (N, d_sae) the pre-activations, f (N, d_sae) the latents,
n (d_sae,) the decoder rows' norms.

    mse        = sum over d_out of (x_hat - y)^2, mean over N      (every architecture)
    standard   + l1 * mean_N sum_i f_i * n_i              decoder-norm-weighted L1
    topk       pre * n ranks the latents (rescale_acts_by_decoder_norm), f / n decodes
               + aux * AuxK (below)
    batchtopk  as topk, but the k * N largest of the whole batch are kept; the threshold is a
               moving average of the smallest kept latent (SAELens's topk_threshold)
    jumprelu   f = pre * [pre > threshold], the threshold trained through SAELens's
               straight-through estimator (a rectangle of width `bandwidth`)
               + l0 * mean_N sum_i [pre_i > threshold_i]   (SAELens's "step" L0 loss)

AuxK (OpenAI's "Scaling and evaluating sparse autoencoders", App. B.1, as SAELens computes
it): the k_aux = d_in / 2 largest pre-activations of the dead latents reconstruct the error
y - x_hat (no bias); scaled by min(dead / k_aux, 1). SAELens 6 keeps no unit-norm constraint on
the decoder: the L1 and the TopK ranking weigh each latent by its decoder norm instead, and a
TopK dictionary's norms are folded into its encoder when it is saved (`inference_tensors`).

TopK and BatchTopK read the batch x rather than pre: they rank pre * n without autograd and
carry the gradient through the kept entries alone (glassgpt.interp.sae.training.sparse).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from glassgpt.interp.sae import SAE
from glassgpt.interp.sae.architectures import REGISTRY
from glassgpt.interp.sae.encoding import pre_acts
from glassgpt.interp.sae.training.settings import DictionarySettings
from glassgpt.interp.sae.training.sparse import (
    Kept,
    decode_kept,
    kept_of_flat,
    kept_of_rows,
    kept_pre,
)


@dataclass
class StepOutput:
    loss: Tensor  # the sum of the terms below, what backward() runs from
    terms: dict[str, Tensor]  # "mse_loss", "l1_loss", "l0_loss", "auxk_loss" (detached)
    firing: Tensor  # (d_sae,): how many of the N rows each latent fired on
    reconstruction: Tensor  # x_hat (N, d_out), detached


class _JumpReLU(torch.autograd.Function):
    """pre * [pre > threshold]; gradient to pre where it passes, and to the threshold through
    a rectangle kernel of width `bandwidth` (SAELens's estimator, ste_to_input False)."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        pre, threshold = ctx.saved_tensors
        near = _rectangle((pre - threshold) / ctx.bandwidth)
        threshold_grad = -(threshold / ctx.bandwidth * near * grad).sum(0)  # (d_sae,)
        return (pre > threshold).to(grad.dtype) * grad, threshold_grad, None


class _Step(torch.autograd.Function):
    """[pre > threshold], its gradient to the threshold only (SAELens's L0 estimator)."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        pre, threshold = ctx.saved_tensors
        near = _rectangle((pre - threshold) / ctx.bandwidth)
        return None, -(near * grad / ctx.bandwidth).sum(0), None


def _rectangle(z: Tensor) -> Tensor:
    return ((z > -0.5) & (z < 0.5)).to(z.dtype)


@dataclass(frozen=True)
class StepInputs:
    """What a step brings beside the batch: the L1 or L0 coefficient of this step (after its
    warm-up), the latents counted dead (d_sae,), and the batch threshold (a float64 scalar,
    batchtopk only, updated in place)."""

    sparsity_weight: float
    dead: Tensor
    batch_threshold: Tensor | None


@dataclass
class Forward:
    """One architecture's training forward: x_hat (N, d_out), its loss terms beside the MSE
    (Architecture.losses), and how many rows each latent fired on (d_sae,)."""

    x_hat: Tensor
    terms: dict[str, Tensor]
    firing: Tensor


def training_step(sae: SAE, settings: DictionarySettings, x: Tensor, y: Tensor,
                  sparsity_weight: float, dead: Tensor, batch_threshold: Tensor | None
                  ) -> StepOutput:
    """The loss of one batch x (N, d_in) -> y (N, d_out): the MSE and the terms of the
    architecture's forward (`FORWARDS`, keyed by its record's activation). `sparsity_weight`,
    `dead` and `batch_threshold` as in StepInputs."""
    forward = FORWARDS[REGISTRY[settings.architecture].activation]
    # the ranking forwards read the batch itself: they rank pre without autograd (sparse.py)
    read = x if forward in RANKING_FORWARDS else pre_acts(sae, x)  # x, or pre (N, d_sae)
    out = forward(sae, settings, read, y, StepInputs(sparsity_weight, dead, batch_threshold))
    terms = {"mse_loss": (out.x_hat - y).pow(2).sum(-1).mean(), **out.terms}
    loss = sum(terms.values())
    return StepOutput(loss, {name: t.detach() for name, t in terms.items()}, out.firing,
                      out.x_hat.detach())


def _firing(f: Tensor) -> Tensor:
    return torch.count_nonzero(f.detach(), dim=0)  # (d_sae,)


def l1_forward(sae: SAE, settings: DictionarySettings, pre: Tensor, y: Tensor,
               step: StepInputs) -> Forward:
    """standard: ReLU, and the L1 of the latents weighted by their decoder rows' norms."""
    norms = sae.W_dec.norm(dim=-1)  # (d_sae,)
    f = F.relu(pre)
    x_hat = f @ sae.W_dec + sae.b_dec
    l1 = (step.sparsity_weight * (f * norms).norm(p=1, dim=-1)).mean()
    return Forward(x_hat, {"l1_loss": l1}, _firing(f))


@dataclass(frozen=True)
class Ranking:
    """What a TopK or BatchTopK step ranks, computed without autograd: ranked = pre * n
    (N, d_sae) (rescale_acts_by_decoder_norm); and what the kept entries' gradient flows to:
    the encoder's input (N, d_in) and the decoder norms n (d_sae,)."""

    sae_in: Tensor
    ranked: Tensor
    norms: Tensor

    def values(self, sae: SAE, kept: Kept) -> tuple[Tensor, Tensor]:
        """pre * n at the kept entries (M,), with their gradient, and n there (M,)."""
        norms = self.norms[kept.cols]  # (M,)
        pre = kept_pre(self.sae_in, sae.W_enc, sae.b_enc, self.ranked, kept, norms.detach())
        return pre * norms, norms


def _ranking(sae: SAE, x: Tensor) -> Ranking:
    """pre * n = sae_in @ (W_enc * n) + b_enc * n, one product (pre_acts's pre, scaled)."""
    norms = sae.W_dec.norm(dim=-1)  # (d_sae,)
    sae_in = x - sae.b_dec if sae.cfg.apply_b_dec_to_input else x  # as pre_acts reads it
    with torch.no_grad():
        n = norms.detach()
        ranked = torch.addmm(sae.b_enc * n, sae_in, sae.W_enc * n)  # (N, d_sae)
    return Ranking(sae_in, ranked, norms)


def top_k_forward(sae: SAE, settings: DictionarySettings, x: Tensor, y: Tensor,
                  step: StepInputs) -> Forward:
    """topk, from the batch x (N, d_in): the k largest of pre * n each row, decoded from those
    k rows only, and AuxK; sparse both ways (glassgpt.interp.sae.training.sparse)."""
    ranking = _ranking(sae, x)
    d_sae = ranking.ranked.shape[1]
    indices = ranking.ranked.topk(int(settings.k), dim=-1, sorted=False).indices  # (N, k)
    kept = kept_of_rows(indices, d_sae)
    values, norms = ranking.values(sae, kept)
    values = values.relu()  # (N * k,)
    x_hat = decode_kept(values / norms, sae.W_dec, kept) + sae.b_dec
    firing = torch.bincount(kept.cols[values > 0], minlength=d_sae)
    return Forward(x_hat, _auxk_terms(sae, settings, ranking, y, x_hat, step), firing)


def batch_top_k_forward(sae: SAE, settings: DictionarySettings, x: Tensor, y: Tensor,
                        step: StepInputs) -> Forward:
    """batchtopk, from the batch x (N, d_in): the k * N largest of pre * n in the whole batch
    (after a ReLU), AuxK, and the batch threshold's moving average (what is saved as every
    latent's threshold)."""
    ranking = _ranking(sae, x)
    n, d_sae = ranking.ranked.shape
    flat = ranking.ranked.relu().flatten().topk(int(settings.k * n), sorted=False).indices
    kept = kept_of_flat(flat, n, d_sae)
    values, norms = ranking.values(sae, kept)
    values = values.relu()  # (M,)
    x_hat = decode_kept(values / norms, sae.W_dec, kept) + sae.b_dec
    _update_batch_threshold(step.batch_threshold, values.detach(), settings.topk_threshold_lr)
    firing = torch.bincount(kept.cols[values > 0], minlength=d_sae)
    return Forward(x_hat, _auxk_terms(sae, settings, ranking, y, x_hat, step), firing)


def jump_relu_forward(sae: SAE, settings: DictionarySettings, pre: Tensor, y: Tensor,
                      step: StepInputs) -> Forward:
    """jumprelu: the threshold projected to >= 0 (as SAELens keeps it), then the
    straight-through JumpReLU and its "step" L0 loss."""
    with torch.no_grad():
        sae.threshold.clamp_(min=0.0)
    threshold = sae.threshold
    f = _JumpReLU.apply(pre, threshold, settings.jumprelu_bandwidth)
    x_hat = f @ sae.W_dec + sae.b_dec
    l0 = _Step.apply(pre, threshold, settings.jumprelu_bandwidth).sum(-1)  # (N,)
    return Forward(x_hat, {"l0_loss": (step.sparsity_weight * l0).mean()}, _firing(f))


def _auxk_terms(sae: SAE, settings: DictionarySettings, ranking: Ranking, y: Tensor,
                x_hat: Tensor, step: StepInputs) -> dict[str, Tensor]:
    return {"auxk_loss": settings.aux_loss_coefficient * auxk_loss(
        sae, ranking, step.dead, (y - x_hat).detach())}


# Architecture.activation -> its training forward, for every architecture glassgpt trains
FORWARDS: dict[str, Callable[..., Forward]] = {
    "relu": l1_forward, "topk": top_k_forward, "batchtopk": batch_top_k_forward,
    "jumprelu": jump_relu_forward}
# the forwards that read the batch x (N, d_in) rather than pre (N, d_sae)
RANKING_FORWARDS = (top_k_forward, batch_top_k_forward)


@torch.no_grad()
def _update_batch_threshold(threshold: Tensor, f: Tensor, lr: float) -> None:
    positive = f[f > 0]
    if positive.numel():
        threshold.mul_(1 - lr).add_(lr * positive.min().to(threshold.dtype))


def auxk_loss(sae: SAE, ranking: Ranking, dead: Tensor, error: Tensor) -> Tensor:
    """OpenAI's AuxK as SAELens computes it (see the module docstring); 0 with no dead latent.
    Ranked among the dead latents' columns only, sparse both ways as the TopK itself."""
    dead_latents = dead.nonzero()[:, 0]  # (n_dead,)
    n_dead = dead_latents.numel()
    if n_dead == 0:
        return ranking.ranked.new_zeros(())
    k_aux = sae.cfg.d_in // 2
    scale = min(n_dead / k_aux, 1.0)
    k_aux = min(k_aux, n_dead)
    top = ranking.ranked[:, dead_latents].topk(k_aux, dim=-1, sorted=False)  # (N, k_aux)
    kept = kept_of_rows(dead_latents[top.indices], ranking.ranked.shape[1])
    values, norms = ranking.values(sae, kept)
    recons = decode_kept(values / norms, sae.W_dec, kept)  # no b_dec: the error lacks it
    return scale * (recons - error).pow(2).sum(-1).mean()


def inference_tensors(sae: SAE, settings: DictionarySettings,
                      batch_threshold: Tensor | None,
                      scaling: Tensor | None = None) -> dict[str, Tensor]:
    """The tensors SAELens saves for inference: the activations' scaling (2,) (s_in, s_out)
    folded in first (SAELens's fold_activation_norm_scaling_factor: the saved dictionary reads
    and writes raw activations), then a TopK's (and BatchTopK's) decoder norms folded into the
    encoder (W_dec rows of norm 1), a BatchTopK's batch threshold as every latent's JumpReLU
    threshold."""
    arch = REGISTRY[settings.architecture]
    tensors = {name: t.detach().clone() for name, t in sae.state_dict().items()}
    threshold_scale = 1.0
    if scaling is not None:  # x * s_in in, y * s_out out: pre is unchanged, x_hat / s_out
        s_in, s_out = (float(s) for s in scaling)
        tensors["W_enc"] = tensors["W_enc"] * s_in
        tensors["W_dec"] = tensors["W_dec"] / s_out
        tensors["b_dec"] = tensors["b_dec"] / s_out
        threshold_scale = 1 / s_out  # a batch threshold ranks pre * ||W_dec||, now / s_out
    if arch.rescales_by_decoder_norm:
        norms = tensors["W_dec"].norm(dim=-1).clamp(min=1e-8)  # (d_sae,)
        tensors["b_enc"] = tensors["b_enc"] * norms
        tensors["W_dec"] = tensors["W_dec"] / norms[:, None]
        tensors["W_enc"] = tensors["W_enc"] * norms[None, :]
    if arch.batch_threshold:
        tensors["threshold"] = torch.full_like(tensors["b_enc"],
                                               float(batch_threshold) * threshold_scale)
    return tensors


@torch.no_grad()
def resample_dead(sae: SAE, settings: DictionarySettings, x: Tensor, y: Tensor,
                  x_hat: Tensor, dead: Tensor, generator: torch.Generator) -> Tensor:
    """Bricken et al. 2023's neuron resampling ("Towards Monosemanticity", Neuron
    Resampling), on one batch x (N, d_in) -> y (N, d_out) with its reconstruction x_hat:
    each dead latent (dead (d_sae,) bool) takes an input drawn with probability proportional
    to the square of its loss, its decoder row the target's direction and its encoder column
    the input's (x - b_dec where the encoder reads that), at 0.2 x the mean norm of the living
    latents' encoder columns, its bias 0 (a JumpReLU threshold back at its start). The decoder
    row has the living rows' mean norm (their unit norm, in the paper). Returns the indices of
    the latents resampled (R,), whose Adam moments the trainer zeroes."""
    latents = dead.nonzero()[:, 0]  # (R,)
    loss = (y - x_hat).pow(2).sum(-1).double()  # (N,)
    if latents.numel() == 0 or not bool(loss.sum() > 0):
        return latents[:0]
    picked = torch.multinomial(loss.pow(2).cpu(), latents.numel(), replacement=True,
                               generator=generator).to(x.device)  # (R,)
    alive = ~dead
    encoder_norm = sae.W_enc[:, alive].norm(dim=0).mean() if alive.any() else 1.0
    decoder_norm = sae.W_dec[alive].norm(dim=-1).mean() if alive.any() \
        else settings.decoder_init_norm
    inputs = x[picked] - sae.b_dec if sae.cfg.apply_b_dec_to_input else x[picked]
    sae.W_dec[latents] = F.normalize(y[picked], dim=-1) * decoder_norm  # (R, d_out)
    sae.W_enc[:, latents] = (F.normalize(inputs, dim=-1) * 0.2 * encoder_norm).T  # (d_in, R)
    sae.b_enc[latents] = 0.0
    if sae.threshold is not None and not REGISTRY[settings.architecture].batch_threshold:
        sae.threshold[latents] = settings.jumprelu_init_threshold
    return latents
