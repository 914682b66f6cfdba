"""Gemma Scope's transcoders as circuit-tracer 0.5 reads them: `params.npz`, one a layer.

circuit-tracer's Gemma transcoders (`mwhanna/gemma-scope-transcoders`) are a config.yaml
whose `transcoders:` name Gemma Scope's files, "hf://google/gemma-scope-2b-pt-transcoders/
layer_0/width_16k/average_l0_76/params.npz" and so on; its "gemma-scope" loader
(`load_gemma_scope_transcoder`) reads each with numpy:

    W_enc (d_model, d_tc)   transposed to circuit-tracer's (d_tc, d_model)
    W_dec (d_tc, d_model),  b_enc (d_tc,),  b_dec (d_model,)
    threshold (d_tc,)       its JumpReLU's: a = z [z > threshold],  z = x @ W_enc + b_enc
nothing else (it loads them strictly). glassgpt reads the same five arrays, and nothing that
needs unpickling (`allow_pickle=False`): each array's header (name, shape, dtype) is checked
before its data is read.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from glassgpt.errors import CheckpointError

HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0,
                  (2, 0): np.lib.format.read_array_header_2_0}
NPZ_NAMES = ("W_enc", "W_dec", "b_enc", "b_dec", "threshold")
FLOAT_KINDS = ("float16", "float32", "float64")
MAX_MEMBERS = 16  # a params.npz holds five arrays; a bigger archive is not one


def read_gemma_scope_npz(path: Path, dtype: torch.dtype) -> dict[str, Tensor]:
    """A Gemma Scope `params.npz`'s five arrays in `dtype`, W_enc transposed to
    circuit-tracer's (d_tc, d_model); names, shapes and dtypes checked before reading."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.namelist()
            if len(members) > MAX_MEMBERS or sorted(members) != sorted(f"{n}.npy" for n in
                                                                        NPZ_NAMES):
                raise CheckpointError(f"{path} holds {sorted(members)[:MAX_MEMBERS]}; Gemma "
                                      f"Scope's params.npz holds {', '.join(NPZ_NAMES)}")
            headers = {name: array_header(archive, name, path) for name in NPZ_NAMES}
            check_shapes({name: shape for name, (shape, _) in headers.items()}, path)
            arrays = {name: read_array(archive, name) for name in NPZ_NAMES}
    except (zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(f"{path} is not a readable .npz ({error})") from None
    tensors = {name: torch.from_numpy(array).to(dtype) for name, array in arrays.items()}
    tensors["W_enc"] = tensors["W_enc"].T.contiguous()  # (d_model, d_tc) -> (d_tc, d_model)
    return tensors


def array_header(archive: zipfile.ZipFile, name: str, path: Path
                 ) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of `name`.npy, read from its header alone; a non-float dtype (objects
    would need unpickling) is refused."""
    with archive.open(f"{name}.npy") as member:
        try:
            version = np.lib.format.read_magic(member)
            if version not in HEADER_READERS:
                raise ValueError(f".npy format version {version}")
            shape, _, dtype = HEADER_READERS[version](member)
        except ValueError as error:
            raise CheckpointError(f"{path}: {name} is not a .npy array ({error})") from None
    if dtype.name not in FLOAT_KINDS:
        raise CheckpointError(f"{path}: {name} is {dtype}, not a float array "
                              f"({', '.join(FLOAT_KINDS)})")
    return tuple(shape), dtype


def check_shapes(shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    if len(shapes["W_enc"]) != 2 or 0 in shapes["W_enc"]:
        raise CheckpointError(f"{path}: W_enc has shape {shapes['W_enc']}, not "
                              f"(d_model, d_tc)")
    d_model, d_tc = shapes["W_enc"]
    expected = {"W_enc": (d_model, d_tc), "W_dec": (d_tc, d_model), "b_enc": (d_tc,),
                "b_dec": (d_model,), "threshold": (d_tc,)}
    for name, shape in shapes.items():
        if shape != expected[name]:
            raise CheckpointError(f"{path}: {name} has shape {shape}, W_enc's "
                                  f"{shapes['W_enc']} makes it {expected[name]}")


def read_array(archive: zipfile.ZipFile, name: str) -> np.ndarray:
    with archive.open(f"{name}.npy") as member:
        return np.lib.format.read_array(member, allow_pickle=False)
