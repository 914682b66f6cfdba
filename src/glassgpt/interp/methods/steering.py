"""Steering: add a fixed direction to an activation at every position of every decoding step.

A steering hook is the smallest intervention there is (ActAdd's activation addition, nnsight's
most used edit): `x + scale * direction` at one hook point. Run by `glassgpt.generate(model,
ids, hooks=[(name, steering_hook(direction, scale))])`, it applies at the prompt's prefill and
at every KV-cache step, so the tokens equal a recompute of the whole sequence with the same hook.

    from glassgpt.interp.methods.steering import load_steering, steering_hook
    steer = load_steering(model, "my_sae:123")        # a dictionary's decoder row W_dec[123]
    steer = load_steering(model, "v.safetensors", at="blocks.1.hook_resid_post")
    glassgpt.generate(model, ids, hooks=[(steer.hook, steering_hook(steer.direction, 8.0))])

A direction comes from a sparse dictionary saved in SAELens's format (`DIR:INDEX`: its decoder
row, at the point it writes to unless `at` says otherwise) or from a file of one vector: a
safetensors file holding one tensor, or a JSON list of numbers. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from glassgpt.errors import CheckpointError, InputError
from glassgpt.hooks import HookFn
from glassgpt.interp.core.cache import unknown_name_message
from glassgpt.interp.core.hooked import as_glass, hook_points, run_with_cache
from glassgpt.storage import files
from glassgpt.storage.tensorfile import SafetensorsFile, check_finite, check_float_dtypes

__all__ = ["Steering", "load_steering", "steering_hook"]

VECTOR_SUFFIXES = (".safetensors", ".json")
MAX_VECTOR_JSON_BYTES = 64 * 2**20  # a list of a few million numbers
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # a larger number would read as inf
# `DIR:INDEX`, the index written as an integer (a sign is caught and refused by name).
DICTIONARY_SPEC = re.compile(r"^(?P<dir>.+):(?P<index>[+-]?\d+)$")


@dataclass(frozen=True)
class Steering:
    """A direction to add at a hook point: `hook` (a TransformerLens name), `direction` (the
    shape of one position's activation there: (C,) in the residual stream) and `source`, what
    it was read from, for messages; `trained_on`, a dictionary's metadata (the run it was
    trained on, glassgpt.interp.sae.provenance), empty for a vector file."""

    hook: str
    direction: Tensor
    source: str
    trained_on: dict = field(default_factory=dict)


def steering_hook(direction: Tensor, scale: float) -> HookFn:
    """A hook fn(tensor, name) that returns tensor + scale * direction, the direction broadcast
    over the leading (batch, position) dimensions; a tensor whose trailing shape is not the
    direction's is refused (InputError) naming the point and both shapes."""
    if not isinstance(direction, Tensor) or not direction.is_floating_point():
        raise InputError(f"a steering direction must be a floating-point tensor, got "
                         f"{direction!r:.60}")
    if not math.isfinite(float(scale)):
        raise InputError(f"a steering scale must be a finite number, got {scale!r}")
    if not bool(torch.isfinite(direction).all()):
        raise InputError("a steering direction holds NaN or infinite values")
    added = float(scale) * direction.detach()  # (*shape): computed once, not per step
    moved: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def steer(tensor: Tensor, name: str) -> Tensor:
        width = tuple(tensor.shape[tensor.dim() - added.dim():])
        if tensor.dim() < added.dim() or width != tuple(added.shape):
            raise InputError(f"a steering direction of shape {tuple(added.shape)} cannot be "
                             f"added at {name}, whose activation is {tuple(tensor.shape)}")
        key = (tensor.dtype, tensor.device)
        if key not in moved:  # once per dtype and device, not at every step
            moved[key] = added.to(device=tensor.device, dtype=tensor.dtype)
        return tensor + moved[key]

    return steer


def load_steering(model: nn.Module, spec: str, at: str | None = None) -> Steering:
    """The direction `spec` names, at the hook point `at` (a TransformerLens name) of `model`:

    - `DIR:INDEX`: the decoder row W_dec[INDEX] of the dictionary saved in DIR (SAELens's
      format), added by default where the dictionary writes its reconstruction (its hook, or a
      transcoder's output hook); with `at`, that point's width must be the row's.
    - a vector file (`.safetensors` holding one tensor, or `.json`: a list of numbers, nested
      for a point with more than one trailing dimension), added at `at`, which it needs.

    Errors name the offending value: a missing file or directory (CheckpointError), an index
    outside the dictionary, an unknown hook point (with the closest names) or a width that does
    not match the point's (InputError).
    """
    if not isinstance(spec, str) or not spec:
        raise InputError(f"a steering direction is DIR:INDEX or a vector file, got {spec!r:.60}")
    points = hook_points(model)
    if at is not None and at not in points:
        raise InputError(unknown_name_message(at, points, "the model"))
    match = DICTIONARY_SPEC.match(spec)
    if match and not Path(spec).exists():  # a file whose name ends in ":3" is a file
        hook, direction, trained_on = _decoder_row(match["dir"], match["index"], spec)
        if at is None and hook not in points:
            raise InputError(f"{spec}: the dictionary writes to {hook}, which the model has "
                             f"not ({unknown_name_message(hook, points, 'the model')}); "
                             f"choose a point with --at")
        at = at or hook
    else:
        direction = _read_vector(spec)
        if at is None:
            raise InputError(f"{spec} is a vector with no hook point: say where it is added, "
                             f"e.g. at blocks.0.hook_resid_post")
        trained_on = {}
    _check_width(model, at, direction, spec)
    return Steering(at, direction, spec, trained_on)


# --- where a direction comes from ------------------------------------------------------------

def _decoder_row(directory: str, index_text: str, spec: str) -> tuple[str, Tensor, dict]:
    """(the point the dictionary writes to, its decoder row W_dec[index] (d_out,), its
    metadata)."""
    from glassgpt.interp.sae import SAE  # the dictionaries load torch modules: only when asked

    if not Path(directory).is_dir():
        raise CheckpointError(f"{spec}: no dictionary directory {directory} (DIR:INDEX names "
                              f"a dictionary saved in SAELens's format and one of its latents)")
    sae = SAE.load(directory)
    index, d_sae = int(index_text), sae.cfg.d_sae
    if not 0 <= index < d_sae:
        raise InputError(f"{spec}: latent {index} is outside the dictionary's {d_sae} latents "
                         f"[0, {d_sae})")
    return sae.cfg.hook_name_out, sae.W_dec.detach()[index].clone(), dict(sae.cfg.metadata)


def _read_vector(spec: str) -> Tensor:
    """The one vector of a .safetensors or .json file, as float32, finite."""
    path = Path(spec)
    if path.is_dir():
        raise InputError(f"{spec} is a directory: name one of a dictionary's latents as "
                         f"{spec}:INDEX")
    if path.suffix not in VECTOR_SUFFIXES:
        raise InputError(f"{spec}: a steering vector is a .safetensors file of one tensor or a "
                         f".json list of numbers (.pt and .npy files are not read: they may "
                         f"hold pickles), or DIR:INDEX for a dictionary's latent")
    if files.entry_kind(path) == "missing":
        raise CheckpointError(f"no steering vector file {spec}")
    vector = _read_safetensors(path) if path.suffix == ".safetensors" else _read_json(path)
    if vector.dim() == 0 or vector.numel() == 0:
        raise InputError(f"{spec}: a steering vector needs at least one number, got shape "
                         f"{tuple(vector.shape)}")
    check_finite({"vector": vector}, path, InputError)
    return vector


def _read_safetensors(path: Path) -> Tensor:
    with SafetensorsFile(path, CheckpointError) as file:
        if len(file.header) != 1:
            raise InputError(f"{path} holds {len(file.header)} tensors "
                             f"{sorted(file.header)[:4]}; a steering vector file holds one")
        check_float_dtypes(file.header, path, InputError)
        (name,) = file.header
        return file.read(name, torch.float32)


def _read_json(path: Path) -> Tensor:
    """A JSON list of numbers (lists of equal lists for a point of several dimensions); NaN
    and Infinity are refused by the reader, everything that is not a number here."""
    data = files.read_json(path, CheckpointError, MAX_VECTOR_JSON_BYTES)
    _check_numbers_only(data, path)
    try:
        vector = torch.tensor(data, dtype=torch.float32)
    except (TypeError, ValueError) as error:  # ragged lists: [[1, 2], [3]]
        raise InputError(f"{path} is not a list of numbers of one shape: its lists nest "
                         f"unevenly ({error})") from None
    return vector


def _check_numbers_only(data: object, path: Path) -> None:
    """InputError naming an item of `data` that is not a number float32 holds: true
    and false are not 1 and 0 here, nor is a string, null or an object a number. Walked
    without recursion: the file may nest as deep as the JSON reader allows."""
    if not isinstance(data, list):
        raise InputError(f"{path} holds {_json_text(data)}, not a list of numbers")
    lists: list[tuple[tuple[int, ...], list]] = [((), data)]
    while lists:
        where, items = lists.pop()
        for i, item in enumerate(items):
            if isinstance(item, list):
                lists.append(((*where, i), item))
            elif type(item) not in (int, float):  # bool is an int: refused here by its type
                raise InputError(f"{path}: item {_index_text((*where, i))} is "
                                 f"{_json_text(item)}, not a number; a steering vector file "
                                 f"holds numbers only")
            elif abs(item) > FLOAT32_MAX:
                raise InputError(f"{path}: item {_index_text((*where, i))} is {item:.4g}, "
                                 f"beyond float32's range (+-{FLOAT32_MAX:.4g})")


def _index_text(where: tuple[int, ...]) -> str:
    return "".join(f"[{i}]" for i in where)


def _json_text(value: object) -> str:
    if isinstance(value, dict):
        return "an object"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:39] + "..."


# --- the point's width -----------------------------------------------------------------------

def _check_width(model: nn.Module, hook: str, direction: Tensor, spec: str) -> None:
    """The direction's shape must be one position's activation at `hook`, read from a
    one-token run of the model (the activation's shape past (batch, position))."""
    glass = as_glass(model)
    device = next(glass.parameters()).device
    probe = torch.zeros(1, 1, dtype=torch.long, device=device)  # (B=1, T=1)
    _, cache = run_with_cache(glass, probe, [hook])
    per_position = tuple(cache[hook].shape[2:])
    if tuple(direction.shape) != per_position:
        raise InputError(f"{spec} has shape {tuple(direction.shape)}, but one position of "
                         f"{hook} is {per_position}: a direction must have the point's width")
