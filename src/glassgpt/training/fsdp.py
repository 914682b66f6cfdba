"""Fully sharded data parallel training (PyTorch's FSDP2, `fully_shard`), under torchrun.

Where DDP (glassgpt.machine.distributed) keeps a whole replica of the weights, gradients and
optimizer state on every rank, FSDP keeps 1/N of each: every block is its own unit, gathered
whole just before its forward and backward and sharded again after, and the root unit holds
the embeddings, the final norm and the head (a tied head shares the embedding's tensor, so the
two must live in one unit). Gradients are reduce-scattered: each rank ends a step with the
averaged gradient of its own shard, exactly what its optimizer shard needs.

A checkpoint stays the run directory of a one-process run: the weights and the optimizer
state are gathered whole (`full_weights`, `full_optimizer_state`: collectives every rank
enters) and rank 0 writes them as today; resuming shards them again (`shard_optimizer_state`).
So a run trained with `--fsdp` resumes, samples and exports like any other.

Muon is refused: it orthogonalises each whole matrix, and a rank holds only some rows of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from glassgpt.config import TrainConfig
from glassgpt.errors import ConfigError
from glassgpt.machine.distributed import DistContext


def _fsdp_api() -> tuple[Any, Any, Any] | None:
    """`fully_shard`, DTensor and `distribute_tensor` where this torch has them:
    torch.distributed.fsdp from 2.6, torch.distributed._composable.fsdp before (2.4, 2.5);
    None on an older torch."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            return None
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:
        from torch.distributed._tensor import DTensor, distribute_tensor
    return fully_shard, DTensor, distribute_tensor


def check_can_shard(cfg: TrainConfig, context: DistContext) -> None:
    """Refuse `fsdp` where it cannot run, in one line each."""
    if _fsdp_api() is None:
        raise ConfigError(f"--fsdp needs PyTorch's fully_shard (torch 2.4 or later); this is "
                          f"torch {torch.__version__}: train without --fsdp (DDP)")
    if cfg.optimizer == "muon":
        raise ConfigError("--fsdp cannot train with --optimizer muon: Muon orthogonalises "
                          "whole matrices and each rank holds a shard of them; use --optimizer "
                          "adamw, or DDP (no --fsdp)")
    if not (context.enabled and dist.is_initialized()):
        raise ConfigError("--fsdp shards the model over the ranks torchrun starts: launch with "
                          "`torchrun --nproc_per_node N -m glassgpt train ... --fsdp`, or "
                          "train in one process with --no-fsdp")


def shard_model(model: nn.Module, device: torch.device, context: DistContext) -> nn.Module:
    """Shard `model` (a GPT) in place over every rank: each block, then the root (embeddings,
    final norm, head). The mesh is built for the training device and passed explicitly, so
    a CPU run never lands on a CUDA default; `fully_shard` moves each rank's shards (and the
    buffers) to that device, so the whole model never has to fit one."""
    from torch.distributed.device_mesh import init_device_mesh

    api = _fsdp_api()
    assert api is not None, "check_can_shard first"
    fully_shard = api[0]
    mesh = init_device_mesh(device.type, (context.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(value: Any) -> bool:
    api = _fsdp_api()
    return api is not None and isinstance(value, api[1])


def full_weights(model: nn.Module) -> dict[str, Tensor]:
    """The whole state dict of a sharded model, on the CPU of rank 0 (empty on the others).
    Every rank must call it: the shards are gathered one tensor at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def full_optimizer_state(optimizer: torch.optim.Optimizer, context: DistContext
                         ) -> dict[str, Any] | None:
    """The optimizer's state_dict with each sharded tensor gathered whole: the state a
    one-process run keeps, on rank 0 (None on the others). Every rank must call it.

    Written here rather than with torch's get_optimizer_state_dict, which gives a state that has
    never stepped a step of zeros first (a checkpoint at step 0 would then resume one AdamW step
    count ahead)."""
    state = optimizer.state_dict()
    gathered: dict[int, dict[str, Any]] = {}
    for index in sorted(state["state"]):  # the same order on every rank: collectives match
        values = state["state"][index]
        gathered[index] = {name: _whole(values[name]) for name in sorted(values)}
    if not context.is_main:
        return None
    return {"state": gathered, "param_groups": state["param_groups"]}


def _whole(value: Any) -> Any:
    return value.full_tensor().cpu() if is_sharded(value) else value


def shard_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]
                          ) -> dict[str, Any]:
    """A checkpoint's whole optimizer state, each tensor shaped like its parameter sharded as
    that parameter is, so that `load_state_dict` gives each rank its shard. Every rank must
    call it, with the same state (each reads the same checkpoint)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for index in sorted(saved["state"]):
        values = saved["state"][index]
        param = params[index] if isinstance(index, int) and index < len(params) else None
        state[index] = {name: _like(values[name], param) for name in sorted(values)}
    return {**saved, "state": state}


def _like(value: Any, param: Tensor | None) -> Any:
    """`value` sharded as `param` when it is a tensor of the parameter's shape (a moment),
    else as it is (a step count; a mismatch is refused by the optimizer's own checks)."""
    if param is None or not is_sharded(param) or not isinstance(value, Tensor) \
            or tuple(value.shape) != tuple(param.shape):
        return value
    distribute_tensor = _fsdp_api()[2]
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)


def load_full_weights(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Copy whole tensors (a checkpoint's, checked already) into a sharded model: each rank
    keeps its own shard. A tied head is absent from `tensors` and stays tied."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # A copy: torch replaces the dict's entries with the shards it made.
    set_model_state_dict(model, dict(tensors),
                         options=StateDictOptions(full_state_dict=True, strict=False))
