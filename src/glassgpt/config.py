"""The settings, each a dataclass validated when it is built: `GPTConfig` (a model's shape),
`TrainConfig` (a training recipe) and `SamplingConfig` (how to continue a prompt).

This module is a leaf (it imports only the errors): the names of the choices (activations,
attention paths) and the checks of a setting live here once, and the modules that take the same
settings directly (`MultiHeadSelfAttention`, `FeedForward`, ...) call these same checks.
Named presets live as TOML files in `glassgpt/presets/`; each has a `[model]` table and a
`[train]` table of recipe defaults.
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
DTYPES = ("auto", "float32", "bfloat16", "float16")  # training precision (autocast)
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


def setting(default: Any, doc: str) -> Any:
    """A dataclass field with a help text (shown by `glassgpt train --help`)."""
    return dataclasses.field(default=default, metadata={"help": doc})


@dataclass
class TrainConfig:
    """Every training setting. Defaults follow nanoGPT; presets' [train] tables override them."""

    max_iters: int = setting(5000, "optimizer steps in total (a resumed run continues to it)")
    batch_size: int = setting(12, "sequences per micro-batch, per rank")
    grad_accum: int = setting(1, "micro-batches per optimizer step")
    lr: float = setting(6e-4, "peak learning rate")
    min_lr: float = setting(6e-5, "floor of the cosine decay")
    warmup_iters: int = setting(100, "steps of linear warmup")
    lr_decay_iters: int = setting(0, "step where the cosine decay ends (0: max_iters)")
    decay_lr: bool = setting(True, "warmup and cosine decay (else a constant lr)")
    weight_decay: float = setting(0.1, "AdamW weight decay of matrices and embeddings")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "largest gradient norm (0: no clipping)")
    eval_interval: int = setting(250, "evaluate and checkpoint every this many steps")
    eval_iters: int = setting(20, "batches per split in an evaluation")
    log_interval: int = setting(10, "steps between progress updates and metrics lines")
    device: str = setting("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = setting("auto", "autocast dtype: auto (bf16/fp16 on CUDA, float32 "
                         "elsewhere), float32, bfloat16, float16")
    compile: bool = setting(False, "torch.compile the model")
    seed: int = setting(1337, "seed of initialisation, batches and dropout")
    early_stop: int = setting(0, "stop after this many evaluations without a better val loss "
                              "(0: never)")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("max_iters", "batch_size", "grad_accum", "eval_interval", "eval_iters",
                     "log_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip", "min_lr",
                     "early_stop"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        check_choice("dtype", self.dtype, DTYPES)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return settings_from_dict(cls, values, "training settings")


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
