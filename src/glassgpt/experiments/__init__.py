"""The "seeing inside" experiments: each a module with `run(out_dir, seed, quick, ...)`.

Every experiment returns an `ExperimentResult` (tables of numbers, the expected outcomes it
checked, the pictures it wrote under `out_dir`) and prints nothing. The modules are imported on
first use, so listing the experiments (the CLI's `--help`) stays cheap.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from glassgpt.errors import ConfigError
from glassgpt.experiments.results import Check, ExperimentResult, Table

# name -> what it shows, in the order `demo all` runs them.
EXPERIMENTS: dict[str, str] = {
    "shapes": "every step of multi-head attention with its tensor shape",
    "parity": "parallel heads vs the per-head loop, SDPA and nn.MultiheadAttention (float64)",
    "multihead": "why several heads: copy the tokens 1, 2 and 4 back with 1, 2, 3, 6 heads",
    "layernorm": "LayerNorm by hand, scale invariance, the (T, C) causality leak",
    "params": "12C^2 + 13C per block, and GPT-2 small's 124,439,808 parameters",
    "residual": "8 blocks with and without residuals: collapse at init, loss, accuracy",
    "dropout": "attention dropout in train vs eval vs no_grad, and the fused path",
    "sharing": "[block] * L versus L independent blocks",
    # The modern Transformer's switches (issue 21), each trained on Tiny Shakespeare characters.
    "positions": "learned vs rotary vs no positions, and contexts longer than trained",
    "norms": "LayerNorm vs RMSNorm: the same loss with fewer operations",
    "mlps": "GELU vs SwiGLU vs ReLU² MLPs at equal parameter count",
    "kvheads": "4, 2, 1 key/value heads: cache bytes, decoding speed, loss",
    "qknorm": "a high learning rate: attention logits with and without QK-norm",
    # Asking why (issue 29): the circuit that made the field.
    "induction": "induction heads: a 2-layer attention-only model's phase change, 1 layer cannot",
    # Local and global layers (issue 30, Gemma).
    "windows": "sliding windows: what local layers cannot see, a global layer, the KV cache",
    # Features, not only heads (issue 41): sparse dictionaries with known answers.
    "features": "a dictionary recovers planted features, then reads a char model's residual",
}

# Extra keyword arguments an experiment accepts beyond out_dir, seed and quick.
OPTIONS: dict[str, tuple[str, ...]] = {
    "shapes": ("batch_size", "seq_len", "d_model", "n_heads"),
    "features": ("snapshots",),
}


def run_experiment(name: str, out_dir: Path, seed: int = 0, quick: bool = False,
                   threads: int | str | None = None, **options: Any) -> ExperimentResult:
    """Run experiment `name`, writing its pictures under `out_dir`.

    `threads` (a count, "auto" or None: glassgpt.machine.threadsetting) is the CPU's thread count;
    "auto" times a step of the size the experiments train and keeps the faster count. The
    result's `threads` is the count it ran with."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; choose one of {list(EXPERIMENTS)}")
    if not 0 <= seed < 2**63:
        raise ConfigError(f"seed must be in [0, 2**63), got {seed:.3g}")
    unknown = sorted(set(options) - set(OPTIONS.get(name, ())))
    if unknown:
        raise ConfigError(f"experiment {name!r} takes no option(s) {unknown}; its options: "
                          f"{list(OPTIONS.get(name, ())) or 'none'}")
    chosen = choose_threads(threads)
    module = importlib.import_module(f"glassgpt.experiments.{name}")
    result = module.run(Path(out_dir), seed=seed, quick=quick, **options)
    result.threads = chosen
    return result


def choose_threads(threads: int | str | None) -> int:
    """Apply the setting; for "auto", time a forward and backward pass of the size the
    experiments train (a block of width 64 on batches of short sequences)."""
    import torch  # here: listing the experiments (`demo --help`) must not load torch

    from glassgpt.block import TransformerBlock
    from glassgpt.machine.devices import settle_threads

    def step() -> None:
        TransformerBlock(64, 4)(torch.randn(16, 12, 64)).sum().backward()

    with torch.random.fork_rng(devices=[]):  # the timing draws no numbers an experiment sees
        return settle_threads(threads, torch.device("cpu"), step)


__all__ = ["EXPERIMENTS", "Check", "ExperimentResult", "Table", "run_experiment"]
