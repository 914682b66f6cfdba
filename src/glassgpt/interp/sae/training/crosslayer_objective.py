"""What one training step of a cross-layer transcoder minimises: Anthropic's "Circuit Tracing"
(2025) objective, computed as llamascopium's CLT computes it (`compute_loss` with
sparsity_loss_type "tanh"; tests/test_crosslayer_training.py holds the loss and every gradient
to it on one batch).

Notation: x (L, N, d) every layer's MLP input, y (L, N, d) every layer's MLP output (the
targets), pre (L, N, F) the pre-activations, f (L, N, F) the features, y_hat = clt.decode(f),
n (L, F) each feature's decoder norm: the norm of all it writes, its rows into layers l..L-1
taken together (||W_dec[l][i]|| over (L - l, d)).

    mse       = sum over layers of mean over N of sum_d (y_hat - y)^2
    jumprelu  f = pre * [pre > theta], theta = exp(log_theta) (the threshold trained in log
              space), through the straight-through estimator: the gradient reaches pre where
              it passes, and theta through -theta / w on the window |pre - theta| < w / 2
              (where pre > 0), w = jumprelu_threshold_window
              + l1 * sum over layers of mean over N of sum_i tanh(c * n_i * f_i)
              with n held constant in the step (llamascopium computes it without gradient)
    topk      f = the k largest pre of each layer (after a ReLU); the MSE alone

llamascopium averages both terms over the layers where the paper sums them: its loss and its
gradients are this one's divided by L.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder, top_k


@dataclass
class CLTStepOutput:
    loss: Tensor  # what backward() runs from
    terms: dict[str, Tensor]  # "mse_loss", "sparsity_loss" (detached)
    firing: Tensor  # (L, F): how many of the N positions each feature fired on
    reconstruction: Tensor  # y_hat (L, N, d), detached


class _JumpReLU(torch.autograd.Function):
    """pre * [pre > threshold] (pre (L, N, F), threshold (L, F)); the gradient of the module
    docstring (llamascopium's STEFunction)."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, threshold: Tensor, window: float) -> Tensor:
        mask = pre > threshold[:, None, :]
        ctx.save_for_backward(pre, threshold, mask)
        ctx.window = window
        return pre * mask.to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        pre, threshold, mask = ctx.saved_tensors
        theta = threshold[:, None, :]  # (L, 1, F)
        near = ((pre - theta).abs() < ctx.window / 2) & (pre > 0)
        threshold_grad = (near.to(grad.dtype) * (-theta / ctx.window) * grad).sum(1)  # (L, F)
        return grad * mask.to(grad.dtype), threshold_grad, None


def decoder_norms(clt: CrossLayerTranscoder) -> Tensor:
    """(L, F): each feature's decoder norm over every layer it writes to."""
    return torch.stack([w.pow(2).sum(dim=(1, 2)).sqrt() for w in clt.W_dec])


def pre_activations(clt: CrossLayerTranscoder, x: Tensor) -> Tensor:
    """x (L, N, d) -> pre (L, N, F): each layer's encoder on its own input."""
    return torch.baddbmm(clt.b_enc[:, None, :], x, clt.W_enc)


def crosslayer_step(clt: CrossLayerTranscoder, log_threshold: Tensor | None, x: Tensor,
                    y: Tensor, l1: float, tanh_stretch: float, window: float) -> CLTStepOutput:
    """The loss of one batch x -> y (L, N, d) and what the trainer counts (see the module
    docstring): a JumpReLU CLT with its trained `log_threshold` (L, F), or a TopK one (None)."""
    pre = pre_activations(clt, x)  # (L, N, F)
    if log_threshold is not None:
        f = _JumpReLU.apply(pre, log_threshold.exp(), window)
    else:
        f = torch.stack([top_k(clt, pre[layer], layer) for layer in range(clt.n_layers)])
    y_hat = clt.decode(f)  # (L, N, d)
    mse = (y_hat - y).pow(2).sum(-1).mean(1).sum(0)
    terms = {"mse_loss": mse}
    loss = mse
    if log_threshold is not None:
        with torch.no_grad():
            norms = decoder_norms(clt)  # (L, F), a constant of the step
        sparsity = l1 * torch.tanh(tanh_stretch * norms[:, None, :] * f).sum(-1).mean(1).sum(0)
        terms["sparsity_loss"] = sparsity
        loss = loss + sparsity
    firing = (f.detach() != 0).sum(1)  # (L, F)
    return CLTStepOutput(loss, {k: v.detach() for k, v in terms.items()}, firing,
                         y_hat.detach())
