"""The local learning coefficient (LLC) of a model at its weights, estimated by SGLD.

Lau et al. (2023) and Hoogland et al. (2024): chains of stochastic-gradient Langevin dynamics
start at the weights w* and wander the posterior tempered by nbeta and pulled back to w* by a
Gaussian of precision gamma (the localization); the estimate is

    llc = nbeta * (E_chain[L(w)] - L(w*))

with L the model's next-token cross-entropy on the batches given. Each step moves every
parameter by

    w <- w - (lr / 2) * (nbeta * grad L(w) + lambda * w + gamma * (w - w*)) + sqrt(lr) * N(0, 1)

This is devinterp 2.0.1's estimator (`devinterp.slt.llc.llc`, its default "sgmcmc_sgld" sampler
with no observables, no masks, one micro-batch a step) written again, and held to it by
tests/test_llc.py on the same model, data order and seed (tests/data/devinterp/). What has to be
the same for the same numbers, and is:

- the data order: one shuffled epoch of the sequences, drawn by torch's DataLoader with its own
  generator seeded `seed`, the last short batch dropped, then replayed (devinterp cycles the
  first epoch); every chain and the initial loss read the same batches in the same order;
- the noise: torch's global generator seeded `seed + chain` before each chain, then one
  `torch.normal(0, 1, size)` per parameter per step, in `named_parameters()` order, drawn after
  that parameter's drift is applied (a parameter with no gradient draws nothing); the caller's
  generator is saved and restored around the estimate;
- the loss trace: the loss of every step, evaluated before the step moves the weights, burn-in
  included; the llc of a chain averages all of them, as devinterp 2.0.1's `compute_llc` does.
  A draw is the step at `burn-in + k * steps between draws`;
- the mode: the model runs in train mode, as devinterp runs it (it matters only with dropout);
- the spread over chains is the population standard deviation (xarray's `std`, ddof 0).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.config import setting
from glassgpt.errors import ConfigError, InputError
from glassgpt.model import eval_mode

Progress = Callable[[int, int], None]  # (draws done, draws in all)


@dataclass(frozen=True)
class LLCSettings:
    """SGLD's settings. Defaults are devinterp's `sample()` defaults where it has them (chains,
    draws, batch size, burn-in, steps between draws, initial-loss batches, seed); lr and nbeta,
    which devinterp requires, default to a small step and to devinterp's `default_nbeta`."""

    lr: float = setting(1e-4, "SGLD step size epsilon")
    nbeta: float | None = setting(None, "inverse temperature n*beta (default: m / log m for a "
                                  "batch of m, devinterp's default_nbeta)")
    localization: float = setting(100.0, "gamma, the pull back to the weights estimated at")
    weight_decay: float = setting(0.0, "lambda, a Gaussian prior centred at zero")
    num_chains: int = setting(4, "SGLD chains, each its own noise")
    num_draws: int = setting(200, "draws per chain")
    num_burnin_steps: int = setting(0, "steps before the first draw (still in the llc's mean, "
                                    "as devinterp 2.0.1)")
    num_steps_bw_draws: int = setting(1, "SGLD steps from one draw to the next")
    num_init_loss_batches: int = setting(32, "batches the loss at the weights is averaged over")
    batch_size: int = setting(32, "sequences per SGLD step")
    seed: int = setting(100, "seed of the batch order (seed) and of chain c's noise (seed + c)")

    def __post_init__(self) -> None:
        for name in ("num_chains", "num_draws", "num_steps_bw_draws", "num_init_loss_batches",
                     "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"LLC setting {name} must be at least 1, "
                                  f"got {getattr(self, name)}")
        for name in ("lr", "localization", "weight_decay", "num_burnin_steps"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"LLC setting {name} must be >= 0, got {getattr(self, name)}")
        if self.nbeta is not None and not self.nbeta > 0:
            raise ConfigError(f"LLC setting nbeta must be > 0, got {self.nbeta}")

    @property
    def num_steps(self) -> int:
        """SGLD steps a chain takes: the burn-in, then a draw every `num_steps_bw_draws`."""
        return self.num_burnin_steps + self.num_draws * self.num_steps_bw_draws

    def resolved(self) -> LLCSettings:
        """The settings with nbeta filled in (devinterp's default_nbeta: m / log m, and 1 for
        a batch of one, where the formula is undefined)."""
        if self.nbeta is not None:
            return self
        m = self.batch_size
        return replace(self, nbeta=m / math.log(m) if m > 1 else 1.0)


@dataclass(frozen=True)
class LLCEstimate:
    """An LLC estimate with everything it was made from: never a bare number.
    step_losses: chains x steps, the loss at each SGLD step (burn-in included)."""

    llc_mean: float
    llc_std: float  # over chains, population (ddof 0), as devinterp
    llc_per_chain: list[float]
    init_loss: float  # L(w*), averaged over num_init_loss_batches batches
    step_losses: list[list[float]]
    settings: LLCSettings  # nbeta resolved
    sequences: int  # how many sequences the batches were drawn from
    tokens: int  # predicted tokens per sequence

    @property
    def draw_losses(self) -> list[list[float]]:
        """chains x draws: the loss at each draw (the steps after burn-in, one every
        num_steps_bw_draws)."""
        s = self.settings
        return [row[s.num_burnin_steps::s.num_steps_bw_draws] for row in self.step_losses]

    def describe(self) -> str:
        s = self.settings
        return (f"LLC {self.llc_mean:.4g} ± {self.llc_std:.2g} (std over {s.num_chains} chains: "
                f"{', '.join(f'{v:.4g}' for v in self.llc_per_chain)}); SGLD lr {s.lr:g}, "
                f"nbeta {s.nbeta:.4g}, localization {s.localization:g}, weight decay "
                f"{s.weight_decay:g}, {s.num_draws} draws every {s.num_steps_bw_draws} step(s) "
                f"after {s.num_burnin_steps} burn-in, batch {s.batch_size} of {self.sequences} "
                f"sequences x {self.tokens} tokens, seed {s.seed}; loss at the weights "
                f"{self.init_loss:.4f}")

    def to_json(self) -> dict[str, Any]:
        return {"llc_mean": self.llc_mean, "llc_std": self.llc_std,
                "llc_per_chain": self.llc_per_chain, "init_loss": self.init_loss,
                "step_losses": self.step_losses, "draw_losses": self.draw_losses,
                "settings": asdict(self.settings), "sequences": self.sequences,
                "tokens": self.tokens, "describe": self.describe()}


def estimate_llc(model: nn.Module, batches: Tensor | Sequence[Tensor], settings: LLCSettings,
                 progress: Progress | None = None) -> LLCEstimate:
    """The LLC of `model` at its current weights (left unchanged) by SGLD, as devinterp
    estimates it. `batches`: token sequences, one tensor (N, T + 1) or several (B_i, T + 1),
    each row a window whose T next tokens are predicted; they are re-batched in
    `settings.batch_size` in devinterp's order. `progress(done, total)` after every draw."""
    sequences = token_sequences(batches)
    settings = settings.resolved()
    order = batch_order(len(sequences), settings.batch_size, settings.seed)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        init_loss = loss_at_weights(model, sequences, order, settings)
        step_losses = [run_chain(model, sequences, order, settings, chain, progress)
                       for chain in range(settings.num_chains)]
    nbeta = settings.nbeta
    assert nbeta is not None  # resolved
    per_chain = [nbeta * (sum(row) / len(row) - init_loss) for row in step_losses]
    mean = sum(per_chain) / len(per_chain)
    std = math.sqrt(sum((v - mean) ** 2 for v in per_chain) / len(per_chain))
    return LLCEstimate(llc_mean=mean, llc_std=std, llc_per_chain=per_chain,
                       init_loss=init_loss, step_losses=step_losses, settings=settings,
                       sequences=len(sequences), tokens=sequences.shape[1] - 1)


def token_sequences(batches: Tensor | Sequence[Tensor]) -> Tensor:
    """The sequences as one int64 tensor (N, T + 1), checked."""
    parts = [batches] if isinstance(batches, Tensor) else list(batches)
    if not parts or any(p.dim() != 2 for p in parts):
        raise InputError("the LLC needs token sequences, one tensor (N, T + 1) or several "
                         f"(B, T + 1); got shapes {[tuple(p.shape) for p in parts]}")
    lengths = {p.shape[1] for p in parts}
    if len(lengths) != 1 or min(lengths) < 2:
        raise InputError(f"the LLC's sequences must share one length of at least 2 tokens, "
                         f"got lengths {sorted(lengths)}")
    if any(p.dtype.is_floating_point or p.dtype == torch.bool for p in parts):
        raise InputError("the LLC's sequences must be integer token ids")
    return torch.cat(parts).long()


def batch_order(n: int, batch_size: int, seed: int) -> list[Tensor]:
    """One epoch of batch indices, the order devinterp draws: its DataLoader with a generator
    of its own seeded `seed` (the loader's iterator takes one number from that generator before
    the permutation; using the DataLoader itself keeps that so across torch versions)."""
    if n < batch_size:
        raise InputError(f"the LLC needs at least one full batch: {n} sequences, batch size "
                         f"{batch_size}")
    loader = torch.utils.data.DataLoader(range(n), batch_size=batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed),
                                         drop_last=True)
    return list(loader)  # each (batch_size,) indices; replayed when the steps outrun it


def next_token_loss(model: nn.Module, window: Tensor) -> Tensor:
    """The model's mean cross-entropy predicting window[:, 1:] from what comes before
    (window (B, T + 1)); the last token is only a target, so the model reads T."""
    logits = model(window[:, :-1])[0]  # (B, T, V)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -log_probs.gather(-1, window[:, 1:, None]).mean()  # per-token loss averaged


def loss_at_weights(model: nn.Module, sequences: Tensor, order: list[Tensor],
                    settings: LLCSettings) -> float:
    """L(w*): the mean loss over the first num_init_loss_batches batches of the order."""
    device = next(model.parameters()).device
    torch.manual_seed(settings.seed)
    total = 0.0
    with eval_mode(model), torch.no_grad():  # eval_mode gives the model its own mode back after
        model.train()  # as devinterp; the same as eval without dropout
        for i in range(settings.num_init_loss_batches):
            window = sequences[order[i % len(order)]].to(device)
            total += float(next_token_loss(model, window))
    return total / settings.num_init_loss_batches


def run_chain(model: nn.Module, sequences: Tensor, order: list[Tensor], settings: LLCSettings,
              chain: int, progress: Progress | None) -> list[float]:
    """One SGLD chain from the model's weights, on a copy: the loss at every step."""
    walker = copy.deepcopy(model).train()
    device = next(walker.parameters()).device
    torch.manual_seed(settings.seed + chain)
    params = [p for _, p in walker.named_parameters()]
    for p in params:
        p.requires_grad_(True)
    start = [p.detach().clone() for p in params]
    losses = []
    total_draws = settings.num_chains * settings.num_draws
    for step in range(settings.num_steps):
        window = sequences[order[step % len(order)]].to(device)
        loss = next_token_loss(walker, window)
        if not torch.isfinite(loss):
            raise InputError(f"SGLD chain {chain} diverged at step {step} (loss {float(loss)}): "
                             f"lower lr ({settings.lr:g}) or raise the localization")
        loss.backward()
        sgld_step(params, start, settings)
        for p in params:
            p.grad = None
        losses.append(float(loss.detach()))
        draw, since = divmod(step - settings.num_burnin_steps, settings.num_steps_bw_draws)
        if progress is not None and draw >= 0 and since == 0:
            progress(chain * settings.num_draws + draw + 1, total_draws)
    return losses


@torch.no_grad()
def sgld_step(params: list[nn.Parameter], start: list[Tensor], settings: LLCSettings) -> None:
    """Move every parameter one SGLD step: the drift first, then the noise, one parameter at a
    time (the order of the noise draws is the order of the parameters)."""
    lr, nbeta = settings.lr, settings.nbeta
    assert nbeta is not None
    for p, p0 in zip(params, start, strict=True):
        if p.grad is None:
            continue  # a parameter the loss does not reach: no drift, and no noise drawn
        drift = p.grad * nbeta
        drift += prior_pull(p, p0, settings)
        p.add_(drift, alpha=-0.5 * lr)
        p.add_(torch.normal(0.0, 1.0, size=p.shape, device=p.device), alpha=lr ** 0.5)


def prior_pull(p: Tensor, p0: Tensor, settings: LLCSettings) -> Tensor:
    """The prior's gradient: lambda * w (weight decay, first) plus gamma * (w - w*)."""
    pull = torch.zeros_like(p)
    if settings.weight_decay > 0:
        pull += settings.weight_decay * p
    if settings.localization > 0:
        pull += settings.localization * (p - p0)
    return pull
