"""A model's tensors in a run: what a config needs (names and shapes, from the meta device,
without allocating), read from a safetensors file and checked before any tensor is allocated,
and a GPT built around them without a random initialisation or a second copy; the weights to
write, with no wrapper prefixes and a tied head stored once.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, InputError
from glassgpt.machine.distributed import unwrap_model
from glassgpt.machine.memory import gib, physical_memory
from glassgpt.model import GPT
from glassgpt.storage.tensorfile import (
    SafetensorsFile,
    check_each_shape,
    check_finite,
    check_float_dtypes,
)


def model_tensors(model: nn.Module, state: dict[str, Tensor] | None = None
                  ) -> dict[str, Tensor]:
    """The weights to write: no wrapper prefixes, and a tied LM head stored once (as tok_emb).
    `state`, when given, is the model's whole state dict gathered already (from FSDP shards)."""
    model = unwrap_model(model)
    state = model.state_dict() if state is None else dict(state)
    if getattr(model.config, "tie_weights", False):
        state.pop("lm_head.weight", None)
    return {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}


def expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a run of `config` stores (a tied head once).

    Allocates nothing: one layer is built on the meta device and its names repeated, so even a
    config asking for 10**5 layers costs only the dictionary. Callers bound n_layer first.
    """
    try:
        with torch.device("meta"), initialisation_skipped():
            state = GPT(config.with_layers(1)).state_dict()
    except RuntimeError as error:  # sizes whose product overflows
        raise CheckpointError(f"config.json asks for tensors too large to exist "
                              f"({error})") from None
    if config.tie_weights:
        state.pop("lm_head.weight")  # the same tensor as tok_emb.weight, stored once
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in state.items():
        if name.startswith("blocks.0."):
            rest = name.removeprefix("blocks.0.")
            shapes.update((f"blocks.{i}.{rest}", tuple(tensor.shape))
                          for i in range(config.n_layer))
        else:
            shapes[name] = tuple(tensor.shape)
    return shapes


def check_shapes(config: GPTConfig, found: dict[str, tuple[int, ...]], path: Path) -> None:
    """The tensors `found` (name -> shape) are exactly those `config` needs, before anything
    is allocated: names first, then shapes."""
    if config.n_layer > len(found):  # every layer has at least one tensor
        raise CheckpointError(f"{path}: config.json asks for n_layer={config.n_layer}, but the "
                              f"file holds only {len(found)} tensors")
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: tensors do not match config.json "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    check_each_shape(found, expected, path)


def read_weights(path: Path, config: GPTConfig, dtype: torch.dtype | None = None
                 ) -> dict[str, Tensor]:
    """The tensors of a model file, checked against `config` before any is read; as `dtype`
    when given (each converted as it is read: bfloat16 weights never pass through a float32
    copy of the model)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InputError(f"dtype must be a floating-point torch.dtype (torch.float32, "
                         f"torch.bfloat16, ...), got {dtype!r:.40}")
    with SafetensorsFile(path, CheckpointError) as file:
        check_shapes(config, {name: info.shape for name, info in file.header.items()}, path)
        check_float_dtypes(file.header, path, CheckpointError)
        check_fits_memory(_loaded_bytes(file, dtype), f"the model in {path}")
        tensors = {name: file.read(name, dtype) for name in file.header}
    check_finite(tensors, path, CheckpointError)
    return tensors


def _loaded_bytes(file: SafetensorsFile, dtype: torch.dtype | None) -> int:
    """What reading `file` as `dtype` allocates: the model becomes these very tensors."""
    if dtype is None:
        return file.nbytes
    return sum(math.prod(info.shape) for info in file.header.values()) * dtype.itemsize


def check_fits_memory(needed: int, what: str) -> None:
    """Refuse, before reading, tensors this machine cannot hold (`needed` bytes: for weights,
    the tensors read, which the model then holds as they are)."""
    available = physical_memory()
    if available is not None and needed > available:
        raise CheckpointError(f"{what} needs {gib(needed)} of memory to load, more than this "
                              f"machine's {gib(available)}")


@contextlib.contextmanager
def initialisation_skipped() -> Iterator[None]:
    """torch.nn.init's functions do nothing inside: for parameters on the meta device, where
    there is nothing to fill, yet each call still costs a Python-level meta kernel (7 s for
    a 28-layer model on two busy cores)."""
    saved = {name: getattr(nn.init, name) for name in dir(nn.init)
             if name.endswith("_") and not name.startswith("_")}
    for name in saved:
        setattr(nn.init, name, _left_as_it_is)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _left_as_it_is(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    return tensor


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, uninitialised, for a
    model whose weights are about to be loaded: no memory and no random numbers drawn only
    to be overwritten. Buffers (the model's position table) are made as usual."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        with initialisation_skipped():
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def model_holding(config: GPTConfig, tensors: dict[str, Tensor], source: object) -> GPT:
    """A GPT of `config` whose weights are `tensors` themselves (names and shapes checked
    first): built without a random initialisation and without a second copy, so loading
    costs the tensors' bytes and nothing more. A tied head is tied again to the embedding."""
    check_shapes(config, {name: tuple(t.shape) for name, t in tensors.items()}, source)
    with parameters_on_meta():
        model = GPT(config)
    model.load_state_dict(tensors, strict=False, assign=True)  # a tied head is not stored
    if config.tie_weights:
        model.lm_head.weight = model.tok_emb.weight
    return model


def load_model_tensors(model: GPT, tensors: dict[str, Tensor], path: Path) -> None:
    """Copy `tensors` into `model`, after checking names and shapes against its config."""
    check_shapes(model.config, {name: tuple(t.shape) for name, t in tensors.items()}, path)
    # strict=False only because a tied lm_head.weight is absent; it stays tied to tok_emb.
    model.load_state_dict(tensors, strict=False)
