"""Tensors as the JSON the page reads: rounded numbers, and one step of a walk with its line.

Shared by `inspector.RunView` and `causal` (the page's patching, attribution and MLP panels).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

DECIMALS = 4  # probabilities, weights and activations are sent rounded to this many places


def rounded(values: Tensor) -> Any:
    """A tensor as nested lists of floats with DECIMALS places (short JSON)."""
    return values.double().mul(10**DECIMALS).round().div(10**DECIMALS).tolist()


def step_answer(name: str, title: str, values: Tensor, source: Any) -> dict[str, Any]:
    """One step of a walk through a head or an MLP: its values, shape and the line of the
    model's code that computes it (a `lens.SourceLine`)."""
    values = values.detach().float().cpu()
    shown = values.tolist() if values.dtype == torch.bool else rounded(values)
    return {"name": name, "title": title, "shape": list(values.shape), "values": shown,
            "source": {"file": source.file, "line": source.line,
                       "function": source.function, "text": source.text}}
