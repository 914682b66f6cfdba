"""safetensors files read without trusting them.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON naming each tensor
with its dtype, shape and byte range, then the tensors' bytes. `SafetensorsFile` opens one
without following a link and checks that description before anything else happens: a bounded
header of bounded JSON, known dtypes, and byte ranges that match the shapes and tile the data
exactly, no gap, no overlap, nothing after the last tensor. So a file padded to 64 GiB, or
a header that promises more bytes than the file has, is refused before anything is read.

The caller then compares names, shapes and dtypes with what it expects (a run's config.json,
the optimizer's parameters), and only then do `read` / `read_all` allocate tensors, one at a
time, from the descriptor that was checked. No pickle is ever involved: the format has none.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
from torch import Tensor

from glassgpt.errors import CheckpointError
from glassgpt.storage import files
from glassgpt.storage.files import ErrorType

# safetensors dtype names -> torch dtypes (the ones glassgpt may meet; others are refused).
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself sets
METADATA_KEY = "__metadata__"
CONVERT_CHUNK_BYTES = 16 * 2**20  # what a dtype conversion reads at a time


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it; `start` and `end` are offsets in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """An open safetensors file whose header has been checked (a context manager).

    `header` maps each tensor name to its TensorInfo, `metadata` holds the header's
    __metadata__ strings; no tensor is read until asked for.
    """

    def __init__(self, path: str | Path, error: ErrorType):
        self.path, self.error = Path(path), error
        self._fd = files.open_regular_file(self.path, error)
        try:
            self.header = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors together (what reading them all allocates)."""
        return sum(info.nbytes for info in self.header.values())

    # --- the header --------------------------------------------------------------------------

    def _fail(self, reason: str) -> Exception:
        """The error to raise (an instance of the caller's error class)."""
        return self.error(f"{self.path} is not a valid safetensors file ({reason}; pickle/.pt "
                          f"files are never loaded)")

    def _read_header(self) -> dict[str, TensorInfo]:
        size = os.fstat(self._fd).st_size
        if size < HEADER_LENGTH_BYTES:
            raise self._fail(f"{size} bytes, too short for a header")
        length = int.from_bytes(self._pread(HEADER_LENGTH_BYTES, 0), "little")
        if length > min(size - HEADER_LENGTH_BYTES, MAX_HEADER_BYTES):
            raise self._fail(f"its header claims {length:,} bytes, the file holds {size:,}")
        try:
            text = self._pread(length, HEADER_LENGTH_BYTES).decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail("its header is not UTF-8 JSON") from None
        described = files.parse_json(text, f"{self.path} (safetensors header)", self.error)
        if not isinstance(described, dict):
            raise self._fail("its header is not a JSON object")
        metadata = described.pop(METADATA_KEY, {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str)
                                                     for v in metadata.values()):
            raise self._fail(f"{METADATA_KEY} must map names to strings")
        self.metadata: dict[str, str] = metadata
        data_start = HEADER_LENGTH_BYTES + length
        header = {name: self._tensor_info(name, entry, data_start)
                  for name, entry in described.items()}
        self._check_tiling(header, data_start, size)
        return header

    def _tensor_info(self, name: str, entry: object, data_start: int) -> TensorInfo:
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise self._fail(f"tensor {name!r:.80} needs exactly dtype, shape, data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise self._fail(f"tensor {name!r:.80} has dtype {dtype!r:.20}; known: "
                             f"{sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(_natural(d) for d in shape):
            raise self._fail(f"tensor {name!r:.80} has shape {shape!r:.80}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))
                and offsets[0] <= offsets[1]):
            raise self._fail(f"tensor {name!r:.80} has data_offsets {offsets!r:.80}")
        expected = math.prod(shape) * DTYPES[dtype].itemsize  # Python ints: no overflow
        if offsets[1] - offsets[0] != expected:
            raise self._fail(f"tensor {name!r:.80} of shape {tuple(shape)} and dtype {dtype} "
                             f"needs {expected:,} bytes, its offsets give "
                             f"{offsets[1] - offsets[0]:,}")
        return TensorInfo(dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])

    def _check_tiling(self, header: dict[str, TensorInfo], data_start: int, size: int) -> None:
        """The tensors cover the data exactly: no overlap, no gap, nothing after the last."""
        position = data_start
        for info in sorted(header.values(), key=lambda i: (i.start, i.end)):
            if info.start != position:
                raise self._fail(f"tensor bytes overlap or leave a gap at byte {position:,}")
            position = info.end
        if position != size:
            raise self._fail(f"the file holds {size:,} bytes but its header describes "
                             f"{position:,}: damaged, padded or cut short")

    # --- tensors -----------------------------------------------------------------------------

    def read(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """The tensor `name`, in memory (a copy: the file can be closed afterwards), as `dtype`
        when given. A conversion goes a chunk at a time, so reading a float32 tensor as bfloat16
        costs the bfloat16 bytes and one chunk, never a float32 copy of the whole tensor."""
        info = self.header[name]
        stored = DTYPES[info.dtype]
        if dtype is not None and dtype != stored:
            return self._read_as(name, info, dtype)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=stored)
        buffer = bytearray(info.nbytes)
        self._read_bytes(name, memoryview(buffer), info.start)
        return torch.frombuffer(buffer, dtype=stored).reshape(info.shape)

    def _read_as(self, name: str, info: TensorInfo, dtype: torch.dtype) -> Tensor:
        stored = DTYPES[info.dtype]
        out = torch.empty(info.shape, dtype=dtype)
        flat, step = out.view(-1), max(1, CONVERT_CHUNK_BYTES // stored.itemsize)
        buffer = bytearray(min(info.nbytes, step * stored.itemsize))
        for first in range(0, flat.numel(), step):
            count = min(step, flat.numel() - first)
            view = memoryview(buffer)[:count * stored.itemsize]
            self._read_bytes(name, view, info.start + first * stored.itemsize)
            flat[first:first + count] = torch.frombuffer(view, dtype=stored)
        return out

    def _read_bytes(self, name: str, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):  # a pread may return less than asked
            count = os.preadv(self._fd, [view[done:]], offset + done)
            if count == 0:
                raise self._fail(f"tensor {name!r:.80} is cut short")
            done += count

    def read_all(self) -> dict[str, Tensor]:
        return {name: self.read(name) for name in self.header}

    def _pread(self, count: int, offset: int) -> bytes:
        data = os.pread(self._fd, count, offset)
        if len(data) != count:
            raise self._fail("cut short")
        return data


def _natural(value: object) -> bool:
    """A JSON integer >= 0 (bool is an int in Python, not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_finite(tensors: dict[str, Tensor], source: str | Path, error: ErrorType) -> None:
    """Raise `error` naming the first floating tensor that holds a NaN or an infinity."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not _all_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            raise error(f"{source}: tensor {name} holds {bad:,} NaN or infinite values; a "
                        f"model with them computes nothing but NaN")


def _all_finite(tensor: Tensor) -> bool:
    """Whether no value is NaN or infinite, read in one pass with no tensor-sized temporary
    (`isfinite(t).all()` allocates one per tensor: half of a 508M-parameter model's load)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)  # a NaN propagates to both; an infinity is an extreme
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_float_dtypes(header: dict[str, TensorInfo], source: str | Path,
                       error: ErrorType) -> None:
    """Weights are floating point: a bool or int64 tensor is not a weight."""
    for name, info in header.items():
        if info.dtype not in FLOAT_DTYPES:
            raise error(f"{source}: tensor {name} has dtype {info.dtype}; weights are floating "
                        f"point ({', '.join(FLOAT_DTYPES)})")


def check_each_shape(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                     source: object) -> None:
    """Each tensor of `expected` has its shape in `found` (names already matched)."""
    for name, shape in expected.items():
        if found[name] != shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {found[name]}, "
                                  f"config.json needs {shape}")
