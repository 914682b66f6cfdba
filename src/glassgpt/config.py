"""`GPTConfig`: every setting that decides a model's shape, validated when it is built.

Named presets live as TOML files in `glassgpt/presets/`; each has a `[model]` table (read here)
and a `[train]` table of recipe defaults (read by the trainer).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

from glassgpt.attention import ATTENTION_IMPLS, check_heads_divide_width
from glassgpt.block import ACTIVATIONS
from glassgpt.errors import ConfigError

PRESETS_PACKAGE = "glassgpt.presets"
T = TypeVar("T")


@dataclass
class GPTConfig:
    """The shape of a GPT. Defaults are GPT-2 small."""

    vocab_size: int = 50257
    block_size: int = 1024  # longest sequence, the size of the position table
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768  # C = d_model
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms
    activation: str = "gelu_tanh"
    pre_ln: bool = True
    tie_weights: bool = True  # LM head shares the token embedding matrix
    ln_eps: float = 1e-5
    attn_impl: str = "fused"

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        check_heads_divide_width(self.n_embd, self.n_head)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.ln_eps > 0:
            raise ConfigError(f"ln_eps must be positive, got {self.ln_eps}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"unknown activation {self.activation!r}; "
                              f"choose one of {sorted(ACTIVATIONS)}")
        if self.attn_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"unknown attn_impl {self.attn_impl!r}; "
                              f"choose one of {ATTENTION_IMPLS}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Build from a plain dict (JSON, TOML); unknown keys are an error, never ignored."""
        return settings_from_dict(cls, values, "model config keys")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """The `[model]` table of preset `name`, with `overrides` applied on top."""
        return cls.from_dict({**load_preset(name).get("model", {}), **overrides})


_FIELD_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def check_field_types(settings: Any) -> None:
    """Raise ConfigError for a dataclass field holding a value of the wrong type.

    Settings may come from JSON or TOML a user wrote, where `"4"`, `4.0` or `true` can stand
    where an int belongs. An int where a float belongs is fine and becomes a float.
    """
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        expected = _FIELD_TYPES[field.type]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(settings, field.name, float(value))
            continue
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"{field.name} must be {field.type}, got {value!r:.80}")


def settings_from_dict(cls: type[T], values: Any, what: str) -> T:
    """Build the settings dataclass `cls` from a plain dict; unknown keys are an error."""
    if not isinstance(values, dict):
        raise ConfigError(f"{what} must be a table of settings, got {values!r:.80}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {what} {unknown}; known keys: {sorted(known)}")
    return cls(**values)


def preset_names() -> list[str]:
    """Names of the shipped presets, e.g. ['cpu-small', 'gpt2', ...]."""
    files = resources.files(PRESETS_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".toml") for f in files if f.name.endswith(".toml"))


def load_preset(name: str) -> dict[str, Any]:
    """The whole preset `name` as a dict of tables (`model`, `train`)."""
    if name not in preset_names():
        raise ConfigError(f"unknown preset {name!r}; choose one of {preset_names()}")
    text = resources.files(PRESETS_PACKAGE).joinpath(f"{name}.toml").read_text("utf-8")
    return tomllib.loads(text)
