"""What `inspector.RunView` and `causal` (the page's patching, attribution and MLP panels)
share: a prompt as the model sees it, and tensors as the JSON the page reads (rounded numbers,
one step of a walk with its line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from glassgpt.tokenizers import Tokenizer

DECIMALS = 4  # probabilities, weights and activations are sent rounded to this many places


@dataclass(frozen=True)
class Prompt:
    """A prompt as the model sees it."""

    text: str
    ids: list[int]
    idx: Tensor  # (1, T)


class View(Protocol):
    """What the panels of `causal` ask of the run being viewed (`inspector.RunView` is one)."""

    model: nn.Module
    tokenizer: Tokenizer

    def encode(self, text: str) -> Prompt: ...

    def token_text(self, token_id: int) -> str: ...


def rounded(values: Tensor) -> Any:
    """A tensor as nested lists of floats with DECIMALS places (short JSON)."""
    return values.double().mul(10**DECIMALS).round().div(10**DECIMALS).tolist()


def step_answer(name: str, title: str, values: Tensor, source: Any) -> dict[str, Any]:
    """One step of a walk through a head or an MLP: its values, shape and the line of the
    model's code that computes it (a `glassgpt.interp.methods.heads.SourceLine`)."""
    values = values.detach().float().cpu()
    shown = values.tolist() if values.dtype == torch.bool else rounded(values)
    return {"name": name, "title": title, "shape": list(values.shape), "values": shown,
            "source": {"file": source.file, "line": source.line,
                       "function": source.function, "text": source.text}}
