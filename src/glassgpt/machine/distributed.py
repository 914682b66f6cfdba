"""Data-parallel plumbing: one process per device, launched by torchrun; one process by default.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE. Every rank holds a full model replica and reads its
own batches; DDP averages the gradients during backward. Rank 0 alone writes files. (Sharding
the model instead of replicating it, `--fsdp`, is glassgpt.training.fsdp: it wraps the model,
which this layer knows nothing of.)
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from glassgpt.errors import ConfigError


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_from_env() -> int:
    """This process's rank, readable before the process group exists (0 without torchrun)."""
    return _env_int("RANK", 0)


def _env_int(name: str, default: int, low: int = 0) -> int:
    """An integer torchrun put in the environment; a hand-set one that is not is one line."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r:.40} in the environment is not an integer "
                          f"(torchrun sets it; unset it to train in one process)") from None
    if value < low:
        raise ConfigError(f"{name}={value} in the environment must be at least {low}")
    return value


def _torchrun_context() -> DistContext:
    """The rank, local rank and world size torchrun set, checked before any process group."""
    context = DistContext(rank=_env_int("RANK", 0), local_rank=_env_int("LOCAL_RANK", 0),
                          world_size=_env_int("WORLD_SIZE", 1, low=1))
    if context.rank >= context.world_size:
        raise ConfigError(f"RANK={context.rank} in the environment is not below "
                          f"WORLD_SIZE={context.world_size}")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not: launch with torchrun, "
                          f"or unset them to train in one process")
    return context


def init_distributed(device_type: str) -> DistContext:
    """Join the process group torchrun set up (gloo on CPU, NCCL on CUDA); single otherwise."""
    if not launched_by_torchrun():
        return DistContext()
    context = _torchrun_context()
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(context.local_rank)
        _import_collectives_before_the_group()
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return context


def _import_collectives_before_the_group() -> None:
    """Import torch.distributed.nn.functional while no process group exists.

    Its functions take `group=group.WORLD` as a default argument, evaluated at import. DDP
    imports it on first use, after the group exists, and its ten defaults then hold the group:
    `destroy_process_group` no longer frees it, gloo's threads outlive it, and the group is torn
    down during interpreter shutdown, where a rank could abort ("terminate called without an
    active exception"). Imported first, the defaults are None.
    """
    import torch.distributed.nn.functional  # noqa: F401


def shutdown(context: DistContext) -> None:
    """Destroy the process group, and with it gloo's threads: a group still held elsewhere
    outlives `destroy_process_group`, and its threads run on into interpreter shutdown, where
    they can abort the rank ("terminate called without an active exception")."""
    if context.enabled and dist.is_initialized():
        _drop_what_holds_the_group()
        dist.destroy_process_group()


def _drop_what_holds_the_group() -> None:
    """A sharded model's state holds the group in reference cycles, and DTensor's caches hold
    it through the device mesh they key on: both let go here."""
    _clear_dtensor_caches()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """Each cache is private to torch and moves between versions: it is cleared only where
    this torch has it, and only in modules a run imported (none is imported to be cleared)."""
    tensor, collective_utils, redistribute = (
        sys.modules.get(f"torch.distributed.tensor{name}")
        for name in ("", "._collective_utils", "._redistribute"))
    dtensor = getattr(tensor, "DTensor", None)
    propagator = getattr(getattr(dtensor, "_op_dispatcher", None), "sharding_propagator", None)
    caches = [getattr(propagator, "propagate_op_sharding", None),
              getattr(propagator, "_propagate_tensor_meta_cached", None),
              getattr(getattr(collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
              getattr(redistribute, "_gen_transform_infos", None)]
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    for clear in (getattr(redistribute, "clear_redistribute_planner_cache", None),
                  getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)):
        if clear is not None:
            clear()


def wrap_model(model: nn.Module, context: DistContext, device: torch.device) -> nn.Module:
    """DDP around `model` when several ranks train; the model itself otherwise."""
    if not context.enabled:
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside DDP (`.module`) and `torch.compile` (`._orig_mod`) wrappers:
    what is saved and exported, never a wrapper with prefixed names."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def sync_gradients(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Skip DDP's gradient all-reduce on the micro-steps before the last of an accumulation."""
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def mean_over_ranks(value: Tensor, context: DistContext) -> Tensor:
    """The average of a tensor across ranks (the value itself with one process)."""
    if not context.enabled:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / context.world_size


def max_over_ranks(value: Tensor, context: DistContext) -> Tensor:
    """The largest value across ranks, e.g. of a flag that must stop every rank together."""
    if not context.enabled:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def gather_objects(obj: Any, context: DistContext) -> list[Any]:
    """Every rank's `obj`, in rank order (a one-item list with one process)."""
    if not context.enabled:
        return [obj]
    gathered: list[Any] = [None] * context.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier(context: DistContext) -> None:
    if context.enabled:
        dist.barrier()


@contextlib.contextmanager
def distributed(device_type: str) -> Iterator[DistContext]:
    """`init_distributed` ... `shutdown`, as a with-block."""
    context = init_distributed(device_type)
    try:
        yield context
        # Leave together: a rank tearing down while a peer still talks to it aborts the peer.
        # (After an error, no barrier: the other ranks may never reach it; torchrun stops them.)
        barrier(context)
    finally:
        shutdown(context)
