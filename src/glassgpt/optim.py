"""AdamW and its learning-rate schedule, nanoGPT's recipe: weight decay on matrices and
embeddings only, linear warmup, then cosine decay to `min_lr`; and a checkpoint's AdamW state
checked before the optimizer sees it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.config import TrainConfig
from glassgpt.errors import CheckpointError

FUSED_ADAMW_DEVICES = ("cuda", "cpu", "mps")


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW decaying only tensors of 2+ dims: matrices and embeddings, not biases or norms."""
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # One fused kernel updates every parameter where the device has it; foreach elsewhere.
    fused = params[0].device.type in FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused,
                             foreach=None if fused else True)


ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")


def adamw_state_shapes(optimizer: torch.optim.Optimizer) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor AdamW keeps once it has stepped, named as a checkpoint
    names them (`optimizer.<parameter index>.<name>`): a step count and two moments each."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    shapes: dict[str, tuple[int, ...]] = {}
    for index, param in enumerate(params):
        shapes[f"optimizer.{index}.step"] = ()
        shapes[f"optimizer.{index}.exp_avg"] = tuple(param.shape)
        shapes[f"optimizer.{index}.exp_avg_sq"] = tuple(param.shape)
    return shapes


def load_adamw_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                     source: Path) -> None:
    """Give `optimizer` a checkpoint's state, checked first: the fused AdamW kernel reads
    moments of the wrong shape out of bounds (a segfault), so nothing unchecked may reach it.

    Names, shapes and dtypes of the tensors were checked as the file was read (against
    `adamw_state_shapes`); here the groups must split the same parameters the same way, each
    parameter's state must be exactly AdamW's, and each step count at least 1. The
    hyperparameters are this run's settings: the checkpoint's own, unless a flag changed one.
    """
    fresh = optimizer.state_dict()["param_groups"]
    if [group.get("params") for group in saved["param_groups"]] != \
            [group["params"] for group in fresh]:
        raise CheckpointError(f"{source}: the optimizer's parameter groups do not fit the "
                              f"model")
    for index, values in saved["state"].items():
        if set(values) != set(ADAMW_STATE) or not all(isinstance(v, Tensor)
                                                      for v in values.values()):
            raise CheckpointError(f"{source}: the optimizer state of parameter {index} holds "
                                  f"{sorted(values)}; AdamW keeps {list(ADAMW_STATE)}")
        if not values["step"].item() >= 1:
            raise CheckpointError(f"{source}: optimizer.{index}.step is "
                                  f"{values['step'].item()}; a saved step count is at least 1")
    optimizer.load_state_dict({"state": saved["state"], "param_groups": fresh})


def lr_at(iteration: int, cfg: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at lr_decay_iters, then flat."""
    if not cfg.decay_lr:
        return cfg.lr
    if iteration < cfg.warmup_iters:
        return cfg.lr * (iteration + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if iteration >= decay_iters:
        return cfg.min_lr
    progress = (iteration - cfg.warmup_iters) / (decay_iters - cfg.warmup_iters)  # 0 -> 1
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
