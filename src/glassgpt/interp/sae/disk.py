"""SAELens 6.x's directory of one dictionary, read without trusting it and written atomically.

    cfg.json                  the SAEConfig (glassgpt.interp.sae.config), SAELens's fields
    sae_weights.safetensors   W_enc (d_in, d_sae), b_enc (d_sae,), W_dec (d_sae, d_out),
                              b_dec (d_out,), and the (d_sae,) tensors the architecture
                              adds (Architecture.tensors: a JumpReLU's threshold)
    sparsity.safetensors      optional: "sparsity" (d_sae,), log10 of each latent's firing
                              frequency, as SAELens's trainer writes it

Reading checks cfg.json's fields, then each file's header (names, shapes, dtypes) against them,
and only then reads the tensors and checks that they are finite: a corrupt or lying directory
is one CheckpointError naming what is wrong, and nothing is built. Only JSON and safetensors are
read; nothing is ever unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from glassgpt.errors import CheckpointError
from glassgpt.interp.sae.config import DTYPES, SAEConfig, config_from_dict
from glassgpt.storage import files
from glassgpt.storage.commit import staged_directory
from glassgpt.storage.tensorfile import (
    SafetensorsFile,
    check_finite,
    check_float_dtypes,
)

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
SPARSITY_FILE = "sparsity.safetensors"
SAE_FILES = (CFG_FILE, WEIGHTS_FILE, SPARSITY_FILE)
MAX_CFG_BYTES = 2**20  # SAELens's cfg.json is under 2 KB; metadata may hold a runner's settings


@dataclass(frozen=True)
class SavedSAE:
    """What a directory holds, checked: its config and tensors (in the config's dtype)."""

    config: SAEConfig
    tensors: dict[str, Tensor]
    log_sparsity: Tensor | None


def expected_shapes(config: SAEConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, as SAELens's state dict of this architecture holds them."""
    shapes = {"W_enc": (config.d_in, config.d_sae), "b_enc": (config.d_sae,),
              "W_dec": (config.d_sae, config.width_out), "b_dec": (config.width_out,)}
    for name in config.arch.tensors:  # a JumpReLU's threshold
        shapes[name] = (config.d_sae,)
    return shapes


def read_sae(path: str | Path, dtype: str | None = None) -> SavedSAE:
    """The dictionary in the directory `path`, every part checked (see the module docstring);
    `dtype` (a name such as "float32") overrides cfg.json's."""
    directory = files.check_path_given(path, CheckpointError, "path")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory holding {CFG_FILE} and "
                              f"{WEIGHTS_FILE}")
    config = read_config(directory / CFG_FILE, dtype)
    tensors = read_tensors(directory / WEIGHTS_FILE, expected_shapes(config), config.dtype)
    sparsity_path = directory / SPARSITY_FILE
    log_sparsity = None
    if files.entry_kind(sparsity_path) != "missing":
        log_sparsity = read_tensors(sparsity_path, {"sparsity": (config.d_sae,)},
                                    config.dtype)["sparsity"]
    return SavedSAE(config, tensors, log_sparsity)


def read_config(path: Path, dtype: str | None = None) -> SAEConfig:
    data = files.read_json_object(path, CheckpointError, MAX_CFG_BYTES)
    if dtype is not None:
        if dtype not in DTYPES:
            raise CheckpointError(f"dtype {dtype!r:.40} is none of {', '.join(DTYPES)}")
        data["dtype"] = dtype
    return config_from_dict(data, str(path), CheckpointError)


def read_tensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str) -> dict[str, Tensor]:
    """The tensors of `path`, which must be exactly `shapes` (names and shapes), floating
    point and finite, read as `dtype`."""
    with SafetensorsFile(path, CheckpointError) as file:
        found = {name: info.shape for name, info in file.header.items()}
        if set(found) != set(shapes):
            raise CheckpointError(f"{path} holds tensors {sorted(found)}; cfg.json's "
                                  f"architecture needs exactly {sorted(shapes)}")
        for name, shape in shapes.items():
            if found[name] != shape:
                raise CheckpointError(f"{path}: tensor {name} has shape {found[name]}, but "
                                      f"cfg.json says {shape}")
        check_float_dtypes(file.header, path, CheckpointError)
        tensors = {name: file.read(name, DTYPES[dtype]) for name in shapes}
    check_finite(tensors, path, CheckpointError)
    return tensors


def write_sae(path: str | Path, config: dict[str, Any], tensors: dict[str, Tensor],
              log_sparsity: Tensor | None, overwrite: bool = False) -> Path:
    """Write a dictionary's directory at `path` in one go (staged beside it, renamed into
    place). An existing directory is replaced only with `overwrite`, and only when it holds
    nothing but a dictionary's files; an empty one is filled."""
    out = files.check_can_make_dir(files.check_path_given(path, CheckpointError, "path"),
                                   CheckpointError)
    replacing = out.exists() and any(out.iterdir())
    if replacing:
        check_replaceable(out, overwrite)
    sparsity = {} if log_sparsity is None else {"sparsity": log_sparsity}
    check_finite({**tensors, **sparsity}, "the dictionary being saved", CheckpointError)
    weights = safetensors_bytes({name: t.detach().cpu().contiguous()
                                 for name, t in tensors.items()})
    with staged_directory(out, replacing) as staging:
        files.write_text_atomic(staging / CFG_FILE, json.dumps(config))  # SAELens's layout
        files.write_bytes_atomic(staging / WEIGHTS_FILE, weights)
        if log_sparsity is not None:
            files.write_bytes_atomic(staging / SPARSITY_FILE, safetensors_bytes(
                {"sparsity": log_sparsity.detach().cpu().contiguous()}))
    return out


def check_replaceable(out: Path, overwrite: bool) -> None:
    """An existing directory goes only when asked and when it is a dictionary's: anything
    else in it (a run, the user's files) is refused, never deleted."""
    foreign = sorted(entry.name for entry in out.iterdir() if entry.name not in SAE_FILES)
    if not overwrite:
        raise CheckpointError(f"{out} is not empty; save elsewhere, or pass overwrite=True to "
                              f"replace the dictionary saved there")
    if foreign or not (out / CFG_FILE).is_file():
        raise CheckpointError(f"{out} holds more than a dictionary's files "
                              f"({', '.join(foreign[:3]) or 'no ' + CFG_FILE}); it is not "
                              f"replaced")
