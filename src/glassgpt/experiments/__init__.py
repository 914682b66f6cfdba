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
}

# Extra keyword arguments an experiment accepts beyond out_dir, seed and quick.
OPTIONS: dict[str, tuple[str, ...]] = {
    "shapes": ("batch_size", "seq_len", "d_model", "n_heads"),
}


def run_experiment(name: str, out_dir: Path, seed: int = 0, quick: bool = False,
                   **options: Any) -> ExperimentResult:
    """Run experiment `name`, writing its pictures under `out_dir`."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; choose one of {list(EXPERIMENTS)}")
    if not 0 <= seed < 2**63:
        raise ConfigError(f"seed must be in [0, 2**63), got {seed:.3g}")
    unknown = sorted(set(options) - set(OPTIONS.get(name, ())))
    if unknown:
        raise ConfigError(f"experiment {name!r} takes no option(s) {unknown}; its options: "
                          f"{list(OPTIONS.get(name, ())) or 'none'}")
    module = importlib.import_module(f"glassgpt.experiments.{name}")
    return module.run(Path(out_dir), seed=seed, quick=quick, **options)


__all__ = ["EXPERIMENTS", "Check", "ExperimentResult", "Table", "run_experiment"]
