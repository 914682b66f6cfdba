"""The checks of what the lens, the head steps and the view are given: indices, counts, traces.

A careless value (a layer of 1.5 or True, a trace of another model, a prompt of another length)
is an InputError naming it, raised before any tensor work: never a torch error from deep inside
a forward pass, and never a silently wrong number.
Notation: L = layers, B = batch, T = positions, C = width.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch import Tensor

from glassgpt.errors import InputError


def integer(what: str, value: Any) -> int:
    """`value` as an int; InputError for a bool, a float or anything else (a layer of 1.0 or
    True is a mistake, not layer 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(f"{what} must be an integer, got {value!r:.40}")
    return int(value)


def index(what: str, value: Any, size: int) -> int:
    """`value` as an index in 0..size - 1, else an InputError naming it and the range."""
    value = integer(what, value)
    if not 0 <= value < size:
        raise InputError(f"{what} {value} does not exist: there are {what}s 0..{size - 1}")
    return value


def within(what: str, value: Any, low: int, high: int) -> int:
    """`value` as an int in [low, high], else an InputError naming it and the range (a bool,
    a float or a slice included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not low <= value <= high:
        raise InputError(f"{what} must be an int in [{low}, {high}], got {value!r:.40}")
    return int(value)


def position(what: str, value: Any, length: int) -> int:
    """`value` as a position of `length` tokens, from the end when negative (-1: the last)."""
    return within(what, value, -length, length - 1)


def token_id(what: str, value: Any, vocab_size: int) -> int:
    """`value` as a token id of a vocabulary of `vocab_size`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not 0 <= value < vocab_size:
        raise InputError(f"{what} must be a token id in [0, {vocab_size}), got {value!r:.40}")
    return int(value)


def count(what: str, value: Any) -> int:
    """`value` as a positive int (how many top tokens, say)."""
    value = integer(what, value)
    if value <= 0:
        raise InputError(f"{what} must be a positive number of tokens, got {value}")
    return value


def residuals_of(config: Any, residuals: Any, idx: Tensor | None = None) -> Tensor:
    """`residuals` when they are a trace's (L + 1, B, T, C) of a model with `config` (and, given
    idx (B, T), of that prompt): a trace of another model or prompt is refused, by name."""
    if not isinstance(residuals, Tensor):
        raise InputError(f"residuals must be a tensor from `trace(model, idx).residuals`, got "
                         f"{type(residuals).__name__}")
    expected = f"(L + 1, B, T, C) = ({config.n_layer + 1}, B, T, {config.n_embd})"
    if residuals.dim() != 4 or residuals.shape[0] != config.n_layer + 1 \
            or residuals.shape[-1] != config.n_embd:
        raise InputError(f"residuals of shape {tuple(residuals.shape)} are not a trace of this "
                         f"model, whose traces are {expected}: trace this model")
    if idx is not None and tuple(residuals.shape[1:3]) != tuple(idx.shape):
        raise InputError(f"residuals of {residuals.shape[2]} positions (batch "
                         f"{residuals.shape[1]}) are not a trace of this prompt of shape "
                         f"{tuple(idx.shape)}: trace the same prompt")
    return residuals
