"""The integer block kernel (`blockdot.c`), built with this machine's C compiler on first use.

llama.cpp's Q8_0 and Q4_0 products multiply int8 activations by int8 (or 4-bit) weights into
int32, with AVX512-VNNI's `vpdpbusd` where the CPU has it. Neither torch nor a torchao wheel
ships such a product for a single row of CPU activations in blocks of 32 (BENCHMARKS.md, "int8
and 4-bit with integer dot products": what was measured), so glassgpt carries one C file of its
own. It is compiled here, never downloaded: `cc -O3 -march=native -fopenmp` into the user's
cache (`kernel_dir`), keyed by the source, the compiler and the CPU's flags, so a second process
loads it in milliseconds; it shares torch's OpenMP runtime (libgomp.so.1, loaded by torch
first), so its threads are torch's (a compiler without OpenMP builds it single-threaded).
Without a compiler, or if the build fails, `blockdot()` is None and glassgpt.decoding.blocks
computes the same sums with its torch reference (slowly).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from glassgpt.storage.files import atomic_path

SOURCE = Path(__file__).with_name("blockdot.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
KIND = {"q8_0": 8, "q4_0": 4}  # the C side's name for each weight format
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def kernel_dir() -> Path:
    """Where built kernels are kept: $GLASSGPT_KERNEL_DIR, else ~/.cache/glassgpt/kernels."""
    chosen = os.environ.get("GLASSGPT_KERNEL_DIR")
    if chosen:
        return Path(chosen)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "glassgpt" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler and CPU, built once into kernel_dir()."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), version, " ".join(FLAGS),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    target = kernel_dir() / f"blockdot-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as built:  # a racing process finds a whole library or none
        for flags in (FLAGS, tuple(f for f in FLAGS if f != "-fopenmp")):  # then one thread
            done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                                  capture_output=True, timeout=300)
            if done.returncode == 0:
                break
        done.check_returncode()
    return target


@functools.cache
def blockdot() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it cannot be built here (no compiler, or it fails),
    or where GLASSGPT_NO_KERNEL is set (to hold the reference path to the same tokens)."""
    compiler = _compiler()
    if os.environ.get("GLASSGPT_NO_KERNEL") or compiler is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError):
        return None
    lib.blockdot_matmul.restype = ctypes.c_int
    lib.blockdot_matmul.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr,
                                    _ptr, ctypes.c_int]
    lib.blockdot_quantize_q8_0.restype = None
    lib.blockdot_quantize_q8_0.argtypes = [_ptr, _i64, _i64, _ptr, _ptr]
    return lib


def kernel_matmul(lib: ctypes.CDLL, kind: str, x: Tensor, q: Tensor, d: Tensor,
                  bias: Tensor | None) -> Tensor:
    """x (M, K) float32 contiguous times the block weight (q, d) of `kind`, plus bias: (M, N)."""
    rows, n = x.shape[0], d.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    status = lib.blockdot_matmul(KIND[kind], x.data_ptr(), rows, x.shape[1], q.data_ptr(),
                                 d.data_ptr(), n, 0 if bias is None else bias.data_ptr(),
                                 y.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("the block kernel could not allocate its scratch memory")
    return y


def kernel_quantize_q8_0(lib: ctypes.CDLL, x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) float32 contiguous -> the kernel's Q8_0 activations: q (M, K) int8, d (M, K/32)
    float16."""
    q = torch.empty(x.shape, dtype=torch.int8)
    d = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float16)
    lib.blockdot_quantize_q8_0(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), d.data_ptr())
    return q, d
