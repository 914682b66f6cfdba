"""Muon, written out: momentum, then an orthogonalised update, for a network's hidden matrices.

Plain SGD with momentum moves a weight matrix W along its (averaged) gradient M. That matrix is
usually dominated by a few directions: its singular values spread over orders of magnitude, so a
step that is small enough for the strongest direction barely moves the others. Muon replaces
M = U S V^T by its nearest orthogonal matrix U V^T: every direction the gradient points along
moves by the same amount. Computing U V^T exactly (an SVD) is slow; a few steps of a
Newton-Schulz iteration, only matrix products, get close enough (`orthogonalise`). A step
orthogonalises all of a group's matrices of one shape in one batched iteration
(`orthogonalise_all`), which gives each the result of `orthogonalise` with far fewer calls.

Muon is for 2-D weights inside the network. Embeddings (a lookup, not a linear map of the
stream), the output head, norms and biases are stepped by AdamW in the same optimizer: each
parameter group says which (`use_muon`); `glassgpt.training.optim.muon_parameter_split` decides.

The conventions follow `torch.optim.Muon` (torch >= 2.9), so that a step here equals one of it
(tests/test_muon.py checks that wherever the installed torch has it):
  * momentum as an average, buf = mu * buf + (1 - mu) * g, and Nesterov's look-ahead
    u = (1 - mu) * g + mu * buf;
  * the orthogonalisation in bfloat16 (its error is far below what the iteration leaves anyway);
  * decoupled weight decay w *= 1 - lr * weight_decay, with the unscaled lr;
  * the shape-based lr scale sqrt(max(1, rows / cols)) ("original"), or 0.2 * sqrt(max(rows,
    cols)) ("match_rms_adamw", which makes the update as large as AdamW's, per entry).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from glassgpt.errors import ConfigError

# The quintic Newton-Schulz step maps each singular value s of X to p(s) = a s + b s^3 + c s^5
# (the singular vectors stay). Repeating it from s in (0, 1] should push every s towards 1.
# A large slope at zero (a = 3.4445) lifts tiny singular values fast; b and c then bend p back
# down so that values near 1 stay between about 0.7 and 1.2 instead of converging exactly. Five
# steps land every s from 0.01 to 1 in [0.68, 1.21]: not U V^T, but close enough that training
# does not notice, in far fewer steps than an iteration that converges exactly would need.
# Coefficients from Keller Jordan's Muon (the same as torch.optim.Muon's).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7  # keeps the normalisation of an all-zero gradient finite
LR_SCALES = ("original", "match_rms_adamw")


def orthogonalise(grad: Tensor, steps: int = NS_STEPS,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> Tensor:
    """An approximately orthogonal matrix with the singular vectors of `grad` (2-D), in bf16.

    Dividing by the Frobenius norm first bounds the largest singular value by 1 (the Frobenius
    norm is at least the spectral norm), where the iteration is designed to work. A tall matrix
    is transposed so that the Gram matrix X X^T is the small one of the two.
    """
    if grad.dim() != 2:
        raise ConfigError(f"Muon orthogonalises matrices; got a tensor of shape "
                          f"{tuple(grad.shape)}")
    a, b, c = coefficients
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T  # (rows, cols) -> (cols, rows): now rows <= cols
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T  # (r, r): X X^T, whose eigenvalues are the squared singular values
        # poly = b * gram + c * gram^2, then x = a * x + poly @ x = a X + b (XX^T) X + c (XX^T)^2 X
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def orthogonalise_batched(grads: Tensor, steps: int = NS_STEPS,
                          coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                          eps: float = NS_EPS) -> Tensor:
    """`orthogonalise` of each matrix of grads (n, rows, cols) at once, in bf16.

    The same iteration with batched products (`bmm`, `baddbmm`): for a model's many small
    matrices one call per product instead of one per matrix and product, which is where
    their time went (BENCHMARKS.md, "Muon's Newton-Schulz, batched"). Each matrix is
    normalised by its own Frobenius norm, so the result equals `orthogonalise` of each one.
    """
    if grads.dim() != 3:
        raise ConfigError(f"orthogonalise_batched takes a stack of matrices (n, rows, cols); "
                          f"got a tensor of shape {tuple(grads.shape)}")
    a, b, c = coefficients
    x = grads.bfloat16()
    tall = grads.size(1) > grads.size(2)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)  # (n, r, r)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def orthogonalise_all(grads: Sequence[Tensor], steps: int = NS_STEPS,
                      coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                      eps: float = NS_EPS) -> list[Tensor]:
    """`orthogonalise` of every matrix in `grads`, one batched iteration per shape."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, grad in enumerate(grads):
        by_shape.setdefault(tuple(grad.shape), []).append(i)
    result: list[Tensor] = list(grads)
    for indices in by_shape.values():
        stacked = torch.stack([grads[i] for i in indices])  # (n, rows, cols)
        for i, ortho in zip(indices, orthogonalise_batched(stacked, steps, coefficients, eps),
                            strict=True):
            result[i] = ortho
    return result


def lr_scale(shape: torch.Size | tuple[int, ...], rule: str | None = None) -> float:
    """How much larger the step of a (rows, cols) matrix is than `lr`.

    An orthogonal (rows, cols) matrix has entries of size about 1/sqrt(max(rows, cols)); the
    "original" rule gives tall matrices (more outputs than inputs) sqrt(rows / cols) more, so
    that each output moves as much as in a square one. "match_rms_adamw" scales every update
    to an RMS of 0.2, about AdamW's, so AdamW's lr and weight decay carry over.
    """
    rows, cols = shape[:2]
    if rule is None or rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ConfigError(f"unknown Muon lr scale {rule!r}; choose one of {list(LR_SCALES)}")


class Muon(torch.optim.Optimizer):
    """Muon for parameter groups with `use_muon=True` (the default), AdamW for the others.

    Muon groups take lr, momentum, nesterov, weight_decay, ns_steps, ns_coefficients, eps and
    adjust_lr_fn (the names of torch.optim.Muon); AdamW groups take lr, betas, adam_eps and
    weight_decay. Their state is torch's: `momentum_buffer` per matrix, and `step`, `exp_avg`,
    `exp_avg_sq` per AdamW parameter, so a checkpoint holds the same names either way.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 0.02,
                 weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = NS_EPS, ns_steps: int = NS_STEPS,
                 adjust_lr_fn: str | None = None, betas: tuple[float, float] = (0.9, 0.95),
                 adam_eps: float = 1e-8):
        if not lr >= 0 or not weight_decay >= 0 or not 0 <= momentum < 1:
            raise ConfigError(f"Muon needs lr >= 0, weight_decay >= 0 and momentum in [0, 1); "
                              f"got {lr}, {weight_decay}, {momentum}")
        lr_scale((1, 1), adjust_lr_fn)  # an unknown rule fails here, not at the first step
        defaults = {"lr": lr, "weight_decay": weight_decay, "use_muon": True,
                    "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": tuple(ns_coefficients), "eps": eps,
                    "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn, "betas": tuple(betas),
                    "adam_eps": adam_eps}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if group["use_muon"] and p.dim() != 2:
                    raise ConfigError(f"Muon steps 2-D matrices; a parameter of shape "
                                      f"{tuple(p.shape)} belongs in a group with "
                                      f"use_muon=False (AdamW)")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon_steps(params, group)
            else:
                for param in params:
                    self._adamw_step(param, group)
        return loss

    def _muon_steps(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """Momentum per matrix, then every update orthogonalised in one batched iteration per
        shape (`orthogonalise_all`: the same result as one matrix at a time), then applied."""
        updates = [self._momentum_update(param, group) for param in params]
        updates = self.orthogonalise_updates(updates, group)
        lr = group["lr"]
        for param, update in zip(params, updates, strict=True):
            param.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay
            param.add_(update, alpha=-lr * lr_scale(param.shape, group["adjust_lr_fn"]))

    def orthogonalise_updates(self, updates: list[Tensor], group: dict[str, Any]
                              ) -> list[Tensor]:
        """The orthogonalised updates, batched by shape (a subclass may do it otherwise: the
        tests step one with `orthogonalise` per matrix to check this one against it)."""
        return orthogonalise_all(updates, group["ns_steps"], group["ns_coefficients"],
                                 group["eps"])

    def _momentum_update(self, param: Tensor, group: dict[str, Any]) -> Tensor:
        grad, state, mu = param.grad, self.state[param], group["momentum"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - mu)  # buf = mu * buf + (1 - mu) * grad: an average of gradients
        # Nesterov: step from where the momentum is about to carry the weights, not from here.
        return grad.lerp(buf, mu) if group["nesterov"] else buf

    def _adamw_step(self, param: Tensor, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's update, one tensor at a time."""
        grad, state = param.grad, self.state[param]
        beta1, beta2 = group["betas"]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step = state["step"].item()
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)  # first moment: the mean gradient
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # second moment
        # Both moments start at zero; dividing by 1 - beta^step undoes that early bias.
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(group["adam_eps"])
        param.addcdiv_(state["exp_avg"], denom, value=-lr / bias_correction1)
