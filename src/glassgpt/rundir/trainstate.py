"""The training state of a run as files: JSON for what is small, safetensors for tensors.

`TrainState` is everything besides the weights that exact resumption needs: the iteration,
the optimizer's state, every rank's random states. `split_train_state` turns it into the two
halves a checkpoint writes; `check_state_header` and `join_train_state` take them back, field
by field, so that a damaged or hand-edited file is one clear error naming the field, never a
TypeError deep in a step, and an optimizer tensor of the wrong shape never reaches AdamW.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from glassgpt.errors import CheckpointError
from glassgpt.storage.layout import STATE_JSON_FILE, STATE_TENSORS_FILE
from glassgpt.storage.tensorfile import TensorInfo, check_float_dtypes

STATE_KEYS = ("iteration", "best_val_loss", "best_iteration", "optimizer", "rng", "scaler",
              "threads")


@dataclass
class TrainState:
    """Everything besides the weights that exact resumption needs."""

    iteration: int = 0
    best_val_loss: float = float("inf")
    best_iteration: int | None = None  # where best_val_loss was measured (best.safetensors)
    optimizer: dict[str, Any] = field(default_factory=dict)  # torch optimizer state_dict
    rng: list[dict[str, Any]] = field(default_factory=list)  # one capture_rng_state per rank
    scaler: dict[str, Any] | None = None  # GradScaler state (fp16 on CUDA only)
    # CPU threads the steps ran with: a resumed run keeps them (the sums of a matmul depend
    # on how many threads split it, so another count would not continue bitwise)
    threads: int | None = None


def capture_rng_state(sampler_state: Tensor) -> dict[str, Any]:
    """Random states of python, numpy, torch (CPU and CUDA) and the batch sampler."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, mt, gauss = random.getstate()
    return {"python": [version, list(mt), gauss],
            "numpy": {"keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "sampler": sampler_state}


def restore_rng_state(rng: dict[str, Any]) -> Tensor:
    """Set the global random states saved by `capture_rng_state`; returns the sampler's."""
    try:
        return _restore_rng_state(rng)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, OverflowError) as error:
        raise CheckpointError(f"{STATE_JSON_FILE}: the saved random states are malformed "
                              f"({error!r:.200})") from None


def _restore_rng_state(rng: dict[str, Any]) -> Tensor:
    version, mt, gauss = rng["python"]
    random.setstate((version, tuple(mt), gauss))
    numpy_state = rng["numpy"]
    np.random.set_state(("MT19937", np.array(numpy_state["keys"], dtype=np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"],
                         numpy_state["cached_gaussian"]))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return rng["sampler"]


_OPTIMIZER_TENSOR = re.compile(r"optimizer\.(0|[1-9][0-9]{0,8})\.([a-z_]{1,40})")
_RNG_TENSOR = re.compile(r"rng\.(0|[1-9][0-9]{0,5})\.(torch|sampler|cuda\.(0|[1-9][0-9]{0,2}))")
MAX_RNG_STATE_BYTES = 2**16  # a generator's state: 5,056 bytes on the CPU, 16 on CUDA


def check_state_header(header: dict[str, TensorInfo],
                        optimizer_shapes: dict[str, tuple[int, ...]] | None, path: Path) -> None:
    for name, info in header.items():
        if _OPTIMIZER_TENSOR.fullmatch(name):
            check_float_dtypes({name: info}, path, CheckpointError)
        elif _RNG_TENSOR.fullmatch(name):
            if info.dtype != "U8" or len(info.shape) != 1 or info.nbytes > MAX_RNG_STATE_BYTES:
                raise CheckpointError(f"{path}: random state {name} must be at most "
                                      f"{MAX_RNG_STATE_BYTES:,} bytes (U8, 1-D), got "
                                      f"{info.dtype} {info.shape}")
        else:
            raise CheckpointError(f"{path}: unexpected tensor {name!r:.80}")
    if optimizer_shapes is None:
        return
    found = {name: info.shape for name, info in header.items() if name.startswith("optimizer.")}
    missing = sorted(set(optimizer_shapes) - set(found))
    unexpected = sorted(set(found) - set(optimizer_shapes))
    if missing or unexpected:
        raise CheckpointError(f"{path}: the optimizer state does not fit the model (missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}); resuming without "
                              f"it would not continue the same run")
    for name, shape in optimizer_shapes.items():
        if found[name] != shape:
            raise CheckpointError(f"{path}: {name} has shape {found[name]}, the parameter it "
                                  f"belongs to needs {shape}")


def split_train_state(state: TrainState) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Tensors (for safetensors) and the rest (for JSON)."""
    tensors: dict[str, Tensor] = {}
    optimizer_scalars: dict[str, dict[str, Any]] = {}
    for param_id, param_state in state.optimizer.get("state", {}).items():
        for name, value in param_state.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer.{param_id}.{name}"] = value.detach().cpu().contiguous()
            else:
                optimizer_scalars.setdefault(str(param_id), {})[name] = value
    rng_json = []
    for rank, rng in enumerate(state.rng):
        tensors[f"rng.{rank}.torch"] = rng["torch"].cpu()
        tensors[f"rng.{rank}.sampler"] = rng["sampler"].cpu()
        for device, cuda_state in enumerate(rng["cuda"]):
            tensors[f"rng.{rank}.cuda.{device}"] = cuda_state.cpu()
        rng_json.append({"python": rng["python"], "numpy": rng["numpy"],
                         "cuda_devices": len(rng["cuda"])})
    best = state.best_val_loss
    state_json = {"iteration": state.iteration,
                  "best_val_loss": best if math.isfinite(best) else None,  # JSON has no inf
                  "best_iteration": state.best_iteration,
                  "optimizer": {"param_groups": state.optimizer.get("param_groups", []),
                                "scalars": optimizer_scalars},
                  "rng": rng_json, "scaler": state.scaler, "threads": state.threads}
    return tensors, state_json


def join_train_state(state_json: dict[str, Any], tensors: dict[str, Tensor]) -> TrainState:
    """The TrainState of the JSON part and the tensors, each field checked on the way."""
    iteration = state_json["iteration"]
    if not _is_int(iteration) or iteration < 0:
        raise ValueError(f"iteration must be an integer >= 0, got {iteration!r:.40}")
    best = state_json.get("best_val_loss")
    if best is not None and not _is_number(best):
        raise ValueError(f"best_val_loss must be a number or null, got {best!r:.40}")
    best_iteration = state_json.get("best_iteration")
    if best_iteration is not None and not (_is_int(best_iteration) and
                                           0 <= best_iteration <= iteration):
        raise ValueError(f"best_iteration must be an iteration up to {iteration} or null, got "
                         f"{best_iteration!r:.40}")
    return TrainState(iteration=iteration,
                      best_val_loss=float("inf") if best is None else float(best),
                      best_iteration=best_iteration,
                      optimizer=_join_optimizer(state_json["optimizer"], tensors),
                      rng=[_join_rng(rank, saved, tensors)
                           for rank, saved in enumerate(_list(state_json["rng"], "rng"))],
                      scaler=_checked_scaler(state_json.get("scaler")),
                      threads=_checked_threads(state_json.get("threads")))


def _join_optimizer(saved: Any, tensors: dict[str, Tensor]) -> dict[str, Any]:
    if not isinstance(saved, dict) or set(saved) != {"param_groups", "scalars"}:
        raise ValueError("optimizer must hold exactly 'param_groups' and 'scalars'")
    state: dict[int, dict[str, Any]] = {}
    scalars = saved["scalars"]
    if not isinstance(scalars, dict):
        raise ValueError("optimizer scalars must be a table")
    for param_id, values in scalars.items():
        if not (isinstance(param_id, str) and param_id.isdigit() and isinstance(values, dict)
                and all(_is_number(v) or isinstance(v, bool) or v is None
                        for v in values.values())):
            raise ValueError(f"optimizer scalars of {param_id!r:.20} are malformed")
        state.setdefault(int(param_id), {}).update(values)
    for key, tensor in tensors.items():
        match = _OPTIMIZER_TENSOR.fullmatch(key)
        if match:
            state.setdefault(int(match[1]), {})[match[2]] = tensor
    groups = _list(saved["param_groups"], "optimizer param_groups")
    for group in groups:
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise ValueError("each optimizer param group must be a table with a 'params' list")
    # JSON turned tuples (AdamW's betas) into lists; give them back as torch made them.
    groups = [{k: tuple(v) if k == "betas" and isinstance(v, list) else v
               for k, v in group.items()} for group in groups]
    return {"state": state, "param_groups": groups}


PYTHON_RNG_WORDS = 625  # random.getstate(): 624 words of MT19937 and the position
NUMPY_RNG_KEYS = 624


def _join_rng(rank: int, saved: Any, tensors: dict[str, Tensor]) -> dict[str, Any]:
    if not isinstance(saved, dict) or set(saved) != {"python", "numpy", "cuda_devices"}:
        raise ValueError(f"rng[{rank}] must hold exactly python, numpy and cuda_devices")
    python, numpy_state, devices = saved["python"], saved["numpy"], saved["cuda_devices"]
    if not (isinstance(python, list) and len(python) == 3 and _is_int(python[0])
            and _words(python[1], PYTHON_RNG_WORDS)
            and (python[2] is None or _is_number(python[2]))):
        raise ValueError(f"rng[{rank}].python is not a random.getstate()")
    if not (isinstance(numpy_state, dict)
            and set(numpy_state) == {"keys", "pos", "has_gauss", "cached_gaussian"}
            and _words(numpy_state["keys"], NUMPY_RNG_KEYS) and _is_int(numpy_state["pos"])
            and 0 <= numpy_state["pos"] <= NUMPY_RNG_KEYS
            and numpy_state["has_gauss"] in (0, 1)
            and _is_number(numpy_state["cached_gaussian"])):
        raise ValueError(f"rng[{rank}].numpy is not a numpy random state")
    if not _is_int(devices) or not 0 <= devices <= 1024:
        raise ValueError(f"rng[{rank}].cuda_devices must be a small integer")
    names = [f"rng.{rank}.torch", f"rng.{rank}.sampler",
             *(f"rng.{rank}.cuda.{d}" for d in range(devices))]
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"tensors {missing[:3]} are missing from {STATE_TENSORS_FILE}")
    return {"python": python, "numpy": numpy_state, "torch": tensors[names[0]],
            "sampler": tensors[names[1]], "cuda": [tensors[name] for name in names[2:]]}


SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _checked_scaler(scaler: Any) -> dict[str, Any] | None:
    if scaler is None:
        return None
    if not (isinstance(scaler, dict) and set(scaler) == set(SCALER_KEYS)
            and all(_is_number(v) for v in scaler.values())):
        raise ValueError(f"scaler must be null or a table of {list(SCALER_KEYS)}")
    return scaler


MAX_THREADS = 4096


def _checked_threads(threads: Any) -> int | None:
    if threads is not None and not (_is_int(threads) and 1 <= threads <= MAX_THREADS):
        raise ValueError(f"threads must be null or a count from 1 to {MAX_THREADS}, got "
                         f"{threads!r:.40}")
    return threads


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int or finite float from JSON (files.parse_json has already refused NaN and inf)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _words(value: Any, count: int) -> bool:
    """A list of `count` unsigned 32-bit integers (a Mersenne Twister's state)."""
    return (isinstance(value, list) and len(value) == count
            and all(_is_int(v) and 0 <= v < 2**32 for v in value))
