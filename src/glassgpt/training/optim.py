"""The optimizers and their learning-rate schedules, and a checkpoint's optimizer state checked
before the optimizer sees it.

  * AdamW, nanoGPT's recipe: weight decay on matrices and embeddings only;
  * Muon (glassgpt.training.muon) for the hidden matrices, AdamW for the rest
    (`muon_parameter_split`);
  * linear warmup, then cosine decay to `min_lr` ("cosine"), or a constant lr that decays
    linearly to `min_lr` over the last `decay_fraction` of the run ("wsd", warmup-stable-decay).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.config import TrainConfig
from glassgpt.errors import CheckpointError
from glassgpt.training.muon import Muon

FUSED_ADAMW_DEVICES = ("cuda", "cpu", "mps")


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` names, with its parameter groups."""
    if cfg.optimizer == "muon":
        return make_muon(model, cfg)
    return make_adamw(model, cfg)


def make_adamw(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW decaying only tensors of 2+ dims: matrices and embeddings, not biases or norms."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # One fused kernel updates every parameter where the device has it; foreach elsewhere.
    fused = params[0].device.type in FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused,
                             foreach=None if fused else True)


def muon_parameter_split(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Which parameters Muon steps, and which AdamW: the one place that decides.

    Muon: the 2-D weights inside the blocks (attention's qkv and proj, the MLP's layers), linear
    maps from the residual stream to itself, where an orthogonal update makes sense. AdamW,
    with weight decay: the embeddings and an untied head (a lookup table and a readout, whose
    rows are tokens, not directions). AdamW, no decay: norms and biases (vectors).
    """
    split: dict[str, list[nn.Parameter]] = {"muon": [], "adamw_decay": [], "adamw": []}
    for name, param in model.named_parameters():  # a tied weight appears once
        if not param.requires_grad:
            continue
        if name.startswith("blocks.") and param.dim() == 2:
            split["muon"].append(param)
        elif param.dim() >= 2:
            split["adamw_decay"].append(param)
        else:
            split["adamw"].append(param)
    return split


def make_muon(model: nn.Module, cfg: TrainConfig) -> Muon:
    """Muon for the hidden matrices (peak lr `muon_lr`), AdamW for the rest (peak lr `lr`).

    One schedule drives both: `lr_ratio` (muon_lr / lr) is what `set_lr` multiplies the
    schedule's lr by for the Muon group.
    """
    split = muon_parameter_split(model)
    groups = [{"params": split["muon"], "use_muon": True, "lr": cfg.muon_lr,
               "lr_ratio": cfg.muon_lr / cfg.lr, "weight_decay": cfg.muon_weight_decay},
              {"params": split["adamw_decay"], "use_muon": False,
               "weight_decay": cfg.weight_decay},
              {"params": split["adamw"], "use_muon": False, "weight_decay": 0.0}]
    return Muon([g for g in groups if g["params"]], lr=cfg.lr, momentum=cfg.muon_momentum,
                betas=(cfg.beta1, cfg.beta2))


ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")
MUON_STATE = ("momentum_buffer",)


def optimizer_state_shapes(optimizer: torch.optim.Optimizer) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the optimizer keeps once it has stepped, named as a
    checkpoint names them (`optimizer.<parameter index>.<name>`): for AdamW a step count and
    two moments each, for a Muon matrix its momentum buffer."""
    shapes: dict[str, tuple[int, ...]] = {}
    for index, (param, names) in enumerate(_state_names(optimizer)):
        for name in names:
            shapes[f"optimizer.{index}.{name}"] = () if name == "step" else tuple(param.shape)
    return shapes


adamw_state_shapes = optimizer_state_shapes  # the name older callers use


def _state_names(optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, tuple[str, ...]]]:
    """Each parameter, in state_dict order, with the names of the state it keeps."""
    return [(p, MUON_STATE if group.get("use_muon") else ADAMW_STATE)
            for group in optimizer.param_groups for p in group["params"]]


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                         source: Path) -> None:
    """Give `optimizer` a checkpoint's state, checked first: the fused AdamW kernel reads
    moments of the wrong shape out of bounds (a segfault), so nothing unchecked may reach it.

    Names, shapes and dtypes of the tensors were checked as the file was read (against
    `optimizer_state_shapes`); here the groups must split the same parameters the same way,
    each parameter's state must be exactly what its optimizer keeps, and each AdamW step count
    at least 1. The hyperparameters are this run's settings: the checkpoint's own, unless a
    flag changed one.
    """
    fresh = optimizer.state_dict()["param_groups"]
    if [group.get("params") for group in saved["param_groups"]] != \
            [group["params"] for group in fresh]:
        raise CheckpointError(f"{source}: the optimizer's parameter groups do not fit the "
                              f"model")
    names = dict(enumerate(names for _, names in _state_names(optimizer)))
    for index, values in saved["state"].items():
        expected = names.get(index, ADAMW_STATE)
        if set(values) != set(expected) or not all(isinstance(v, Tensor)
                                                   for v in values.values()):
            raise CheckpointError(f"{source}: the optimizer state of parameter {index} holds "
                                  f"{sorted(values)}; {_keeper(expected)} keeps "
                                  f"{list(expected)}")
        if "step" in values and not values["step"].item() >= 1:
            raise CheckpointError(f"{source}: optimizer.{index}.step is "
                                  f"{values['step'].item()}; a saved step count is at least 1")
    optimizer.load_state_dict({"state": saved["state"], "param_groups": fresh})


load_adamw_state = load_optimizer_state  # the name older callers use


def _keeper(names: tuple[str, ...]) -> str:
    return "Muon" if names == MUON_STATE else "AdamW"


def lr_at(iteration: int, cfg: TrainConfig) -> float:
    """Linear warmup to `lr`, then the schedule's decay to `min_lr` at lr_decay_iters, then
    flat: cosine all the way, or "wsd" (warmup-stable-decay): `lr` until the last
    `decay_fraction` of the steps, then a straight line down."""
    if not cfg.decay_lr:
        return cfg.lr
    if iteration < cfg.warmup_iters:
        return cfg.lr * (iteration + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if iteration >= decay_iters:
        return cfg.min_lr
    if cfg.schedule == "wsd":
        decay_start = decay_iters - cfg.decay_fraction * (decay_iters - cfg.warmup_iters)
        if iteration < decay_start:
            return cfg.lr
        left = (decay_iters - iteration) / (decay_iters - decay_start)  # 1 -> 0
        return cfg.min_lr + left * (cfg.lr - cfg.min_lr)
    progress = (iteration - cfg.warmup_iters) / (decay_iters - cfg.warmup_iters)  # 0 -> 1
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's lr to the schedule's `lr`, times the group's `lr_ratio` (Muon's)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)
