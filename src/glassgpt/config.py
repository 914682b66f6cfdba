"""`GPTConfig`: every setting that decides a model's shape, validated when it is built.

This module is a leaf (it imports only the errors): the names of the choices (activations,
attention paths) and the checks of a setting live here once, and the modules that take the same
settings directly (`MultiHeadSelfAttention`, `FeedForward`, ...) call these same checks.
Named presets live as TOML files in `glassgpt/presets/`; each has a `[model]` table (read here)
and a `[train]` table of recipe defaults (read by the trainer).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

from glassgpt.errors import ConfigError, GlassGPTError, InputError

PRESETS_PACKAGE = "glassgpt.presets"
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")  # exact GELU, GPT-2's tanh GELU, ReLU
ATTENTION_IMPLS = ("fused", "explicit")
ENGINES = ("auto", "eager", "cpu", "cuda-graph")  # decoding engines (glassgpt.decoding)
T = TypeVar("T")


def check_heads_divide_width(d_model: int, n_heads: int) -> int:
    """Return the head width d = d_model // n_heads, or raise if the heads do not split C evenly."""
    if d_model <= 0 or n_heads <= 0:
        raise ConfigError(f"d_model and n_heads must be positive, got d_model={d_model}, "
                          f"n_heads={n_heads}")
    if d_model % n_heads != 0:
        raise ConfigError(f"d_model={d_model} is not divisible by n_heads={n_heads}: each head "
                          f"needs an equal slice of the width")
    return d_model // n_heads


def check_dropout(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {p}")


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {what} {value!r}; choose one of {list(choices)}")


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
        check_dropout(self.dropout)
        if not self.ln_eps > 0:
            raise ConfigError(f"ln_eps must be positive, got {self.ln_eps}")
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("attn_impl", self.attn_impl, ATTENTION_IMPLS)

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


@dataclass(frozen=True)
class SamplingConfig:
    """How to continue a prompt: the settings `generate`, `glassgpt sample` and `glassgpt view`
    share. Defaults sample from the model's own distribution; `temperature=0` is greedy."""

    max_new_tokens: int = 500
    temperature: float = 1.0  # divides the logits; 0 picks the most likely token
    top_k: int | None = None  # sample among the k most likely tokens only
    top_p: float | None = None  # ... or the smallest set whose probability reaches p
    seed: int | None = None  # a private random stream: the same seed, the same text
    stop_token: int | None = None  # a row that emits it is finished
    use_cache: bool = True  # the KV cache: the same tokens, far faster
    compiled: bool = False  # compile the decoding step (glassgpt.decoding)
    engine: str = "auto"  # decoding engine: auto (the device's), eager, cpu, cuda-graph

    def __post_init__(self) -> None:
        check_field_types(self, InputError)
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k <= 0:
            raise InputError(f"top_k must be a positive integer, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.seed is not None and self.seed < 0:
            raise InputError(f"seed must be >= 0, got {self.seed}")
        if self.stop_token is not None and self.stop_token < 0:
            raise InputError(f"stop_token must be a token id >= 0, got {self.stop_token}")
        if self.engine not in ENGINES:
            raise InputError(f"unknown decoding engine {self.engine!r}; choose one of "
                             f"{list(ENGINES)}")


_FIELD_TYPES = {"int": int, "float": float, "bool": bool, "str": str}
INT64_MAX = 2**63 - 1


def check_field_types(settings: Any, error: type[GlassGPTError] = ConfigError) -> None:
    """Raise `error` for a dataclass field holding a value of the wrong type or out of reach.

    Settings may come from JSON, TOML or flags a user wrote, where `"4"`, `4.0` or `true` can
    stand where an int belongs. An int where a float belongs is fine and becomes a float. Ints
    must fit in 64 bits (they become tensor sizes and seeds) and floats must be finite.
    Annotations are the strings "int", "float", "bool", "str", optionally "... | None".
    """
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        name, _, optional = field.type.partition(" | ")
        expected = _FIELD_TYPES[name]
        if value is None and optional == "None":
            continue
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value) if abs(value) <= INT64_MAX else value
            object.__setattr__(settings, field.name, value)  # works on frozen dataclasses too
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise error(f"{field.name} must be {field.type}, got {value!r:.80}")
        if expected is int and abs(value) > INT64_MAX:
            raise error(f"{field.name}={value:.3g} is too large (at most 2**63 - 1)")
        if expected is float and not math.isfinite(value):
            raise error(f"{field.name} must be a finite number, got {value}")


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
