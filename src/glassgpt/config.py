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
# exact GELU, GPT-2's tanh GELU, ReLU, ReLU squared, and the gated SiLU MLP of Llama/Qwen3
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "relu2", "swiglu")
POSITIONS = ("learned", "rope", "none")  # a learned table, rotary, or no positions (NoPE)
NORMS = ("layernorm", "rmsnorm")
MAX_WIDTH = 2**18  # widths beyond this make matrices no machine holds (GPT-3 is 12,288)
ATTENTION_IMPLS = ("fused", "explicit")
ENGINES = ("auto", "eager", "cpu", "cuda-graph")  # decoding engines (glassgpt.decoding)
DTYPES = ("auto", "float32", "bfloat16", "float16")  # training precision (autocast)
OPTIMIZERS = ("adamw", "muon")  # glassgpt.training.optim
SCHEDULES = ("cosine", "wsd")  # learning-rate decay after warmup (glassgpt.training.optim.lr_at)
# Upper bounds of a recipe (TrainConfig): batches per step or evaluation, and lr / weight decay.
MAX_GRAD_ACCUM = 10_000
MAX_EVAL_ITERS = 10_000
MAX_RATE = 10.0
T = TypeVar("T")


def check_size(name: str, value: object, largest: int = MAX_WIDTH) -> None:
    """Raise ConfigError unless `value` is a positive int (not a bool) of at most `largest`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a positive integer, got {value!r:.80}")
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    if value > largest:
        raise ConfigError(f"{name}={value} is too large (at most {largest:,})")


def check_heads_divide_width(d_model: int, n_heads: int) -> int:
    """Return the head width d = d_model // n_heads, or raise if the heads do not split C evenly."""
    for name, value in (("d_model", d_model), ("n_heads", n_heads)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a positive integer, got {value!r:.80}")
    if d_model <= 0 or n_heads <= 0:
        raise ConfigError(f"d_model and n_heads must be positive, got d_model={d_model}, "
                          f"n_heads={n_heads}")
    if d_model % n_heads != 0:
        raise ConfigError(f"d_model={d_model} is not divisible by n_heads={n_heads}: each head "
                          f"needs an equal slice of the width")
    check_size("d_model", d_model)
    return d_model // n_heads


def check_n_kv_head(n_head: int, n_kv_head: int) -> None:
    """Grouped-query attention: each of the n_kv_head key/value heads serves an equal group."""
    check_size("n_kv_head", n_kv_head)
    if n_head % n_kv_head != 0:
        raise ConfigError(f"n_head={n_head} is not divisible by n_kv_head={n_kv_head}: each "
                          f"key/value head must serve an equal group of query heads")


def check_dropout(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {p}")


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {what} {value!r}; choose one of {list(choices)}")


ROPE_SCALINGS = ("llama3", "linear")  # the rotary scalings glassgpt.rotary computes
# Which settings each scaling takes; the others must stay None.
ROPE_SCALING_SETTINGS = {
    "linear": ("rope_factor",),
    "llama3": ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_context"),
}
ALL_ROPE_SCALING_SETTINGS = ROPE_SCALING_SETTINGS["llama3"]


@dataclass(frozen=True)
class AttentionKind:
    """What one layer's attention does with positions (`GPTConfig.attention_kind(layer)`).

    Per-layer variants are fields here, read by the attention built for that layer; today
    whether it rotates q and k (a NoPE layer does not)."""

    rotary: bool


def check_rope_scaling(config: Any) -> None:
    """Raise ConfigError unless rope_scaling names a scaling glassgpt computes and exactly its
    settings are given, each in range."""
    kind = config.rope_scaling
    given = [name for name in ALL_ROPE_SCALING_SETTINGS if getattr(config, name) is not None]
    if kind is None:
        if given:
            raise ConfigError(f"{given[0]}={getattr(config, given[0])} needs rope_scaling "
                              f"(one of {list(ROPE_SCALINGS)})")
        return
    check_choice("rope_scaling", kind, ROPE_SCALINGS)
    if config.position != "rope":
        raise ConfigError(f"rope_scaling={kind!r} scales rotary positions, but position="
                          f"{config.position!r}")
    wanted = ROPE_SCALING_SETTINGS[kind]
    for name in ALL_ROPE_SCALING_SETTINGS:
        value = getattr(config, name)
        if name in wanted and value is None:
            raise ConfigError(f"rope_scaling={kind!r} needs {name}")
        if name not in wanted and value is not None:
            raise ConfigError(f"{name} is not a setting of rope_scaling={kind!r} (it takes "
                              f"{list(wanted)})")
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if kind == "llama3" and not config.rope_low_freq_factor < config.rope_high_freq_factor:
        raise ConfigError(f"rope_low_freq_factor={config.rope_low_freq_factor} must be below "
                          f"rope_high_freq_factor={config.rope_high_freq_factor}: the band "
                          f"between them is interpolated")


def check_nope_layers(config: Any) -> None:
    """Raise ConfigError unless nope_layers names distinct layers of a rotary model."""
    layers = config.nope_layers
    if layers is None:
        return
    if config.position != "rope":
        raise ConfigError(f"nope_layers leaves out rotary positions in some layers, but "
                          f"position={config.position!r} has none to leave out")
    outside = [i for i in layers if not 0 <= i < config.n_layer]
    if outside:
        raise ConfigError(f"nope_layers holds {outside[0]}, not a layer of n_layer="
                          f"{config.n_layer} (layers count from 0)")
    if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
        raise ConfigError(f"nope_layers must list distinct layers in order, got {list(layers)}")


def setting(default: Any, doc: str) -> Any:
    """A dataclass field with a help text: its `--flag`'s help in `glassgpt train --help`."""
    return dataclasses.field(default=default, metadata={"help": doc})


@dataclass
class GPTConfig:
    """The shape of a GPT. Defaults are GPT-2 small.

    The blocks, attention, MLPs and norms are built from the config passed whole
    (`TransformerBlock.from_config`, ...), so a new switch is a field here, read by the one
    module that uses it (docs/reading-the-code.md, "Adding a switch")."""

    vocab_size: int = setting(50257, "tokens in the vocabulary (set by the data's tokenizer)")
    block_size: int = setting(1024, "context length in tokens (the size of the position "
                              "table and of the KV cache)")
    n_layer: int = setting(12, "Transformer blocks")
    n_head: int = setting(12, "attention heads")
    n_embd: int = setting(768, "width C (= d_model)")
    dropout: float = setting(0.0, "dropout probability")
    bias: bool = setting(True, "biases in Linear layers and LayerNorms")
    activation: str = setting("gelu_tanh", "gelu, gelu_tanh, relu, relu2 or swiglu")
    pre_ln: bool = setting(True, "Pre-LN blocks (else Post-LN)")
    tie_weights: bool = setting(True, "LM head shares the embedding")
    norm_eps: float = setting(1e-5, "epsilon of every LayerNorm / RMSNorm (was `ln_eps`)")
    attn_impl: str = setting("fused", "attention path: fused or explicit")
    # The modern Transformer (docs/modern.md); the defaults above and below are GPT-2.
    position: str = setting("learned", "positions: learned, rope or none")
    rope_theta: float = setting(10000.0, "base of the rotary angles")
    norm: str = setting("layernorm", "layernorm or rmsnorm")
    mlp_hidden: int | None = setting(None, "MLP hidden width (default 4C)")
    n_kv_head: int | None = setting(None, "key/value heads (default n_head; 1: multi-query)")
    qk_norm: bool = setting(False, "RMSNorm on queries and keys (Qwen3)")
    logit_softcap: float | None = setting(None, "cap * tanh(logits / cap) (default: none)")
    zero_init_proj: bool = setting(False, "output projections start at zero")
    # The widths and rotary variants of published models (Qwen3, Llama 3, SmolLM3, Qwen2).
    head_dim: int | None = setting(None, "head width d, independent of n_embd (Qwen3: 128 "
                                   "beside 1024 / 16 heads; default n_embd // n_head)")
    qkv_bias: bool | None = setting(None, "biases on q, k and v only (Qwen2: True beside "
                                    "bias=False; default: bias)")
    rope_scaling: str | None = setting(None, "rotary scaling: llama3 or linear (default none)")
    rope_factor: float | None = setting(None, "rope_scaling's factor: wavelengths stretched "
                                        "this many times")
    rope_low_freq_factor: float | None = setting(None, "llama3: wavelengths beyond "
                                                 "original context / this are all scaled")
    rope_high_freq_factor: float | None = setting(None, "llama3: wavelengths below "
                                                  "original context / this are kept")
    rope_original_context: int | None = setting(None, "llama3: the context trained before "
                                                "scaling (original_max_position_embeddings)")
    nope_layers: tuple[int, ...] | None = setting(None, "layers (from 0) without rotary "
                                                  "positions, e.g. 3,7,11 (SmolLM3's NoPE)")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        self._derive_head_dim()
        check_n_kv_head(self.n_head, self.n_head if self.n_kv_head is None else self.n_kv_head)
        check_dropout(self.dropout)
        for name in ("norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.rope_theta >= 1:  # pair i turns at rope_theta ** (-2i / d): below 1, the
            # faster pairs come last, and a tiny base overflows the angles to NaN
            raise ConfigError(f"rope_theta must be at least 1 (models use 10,000 to 10**6), "
                              f"got {self.rope_theta}")
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("attn_impl", self.attn_impl, ATTENTION_IMPLS)
        check_choice("position", self.position, POSITIONS)
        check_choice("norm", self.norm, NORMS)
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"rotary positions turn pairs of features, so the head width "
                              f"head_dim = {self.head_dim} must be even")
        check_rope_scaling(self)
        check_nope_layers(self)
        if self.mlp_hidden is not None:
            check_size("mlp_hidden", self.mlp_hidden, 4 * MAX_WIDTH)
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ConfigError(f"logit_softcap must be positive (or None), got "
                              f"{self.logit_softcap}")
        object.__setattr__(self, "_checked", True)  # from now on, every change is checked

    def __setattr__(self, name: str, value: Any) -> None:
        """A field changed after construction is checked like a new config; a bad value is
        refused and the old one kept (`cfg.n_layer = -3` is a ConfigError, not a broken model)."""
        if not self.__dict__.get("_checked"):
            object.__setattr__(self, name, value)
            return
        before = {key: self.__dict__.get(key) for key in (name, "head_dim", "_head_dim_derived")}
        object.__setattr__(self, name, value)
        if name == "head_dim":  # a head width set by hand is the config's own from now on
            object.__setattr__(self, "_head_dim_derived", False)
        try:
            self.__post_init__()
        except GlassGPTError:
            for key, old in before.items():  # the derived head width too
                object.__setattr__(self, key, old)
            raise

    def _derive_head_dim(self) -> None:
        """head_dim left None is n_embd // n_head, and stays derived: it follows a later
        change of n_embd or n_head (`to_dict` writes None for it, a config.json as before the
        switch). `dataclasses.replace` passes the value on: give head_dim=None beside new
        widths."""
        if self.head_dim is None or self.__dict__.get("_head_dim_derived"):
            d = check_heads_divide_width(self.n_embd, self.n_head)
            object.__setattr__(self, "head_dim", d)
            object.__setattr__(self, "_head_dim_derived", True)
        else:
            check_size("head_dim", self.head_dim)
            check_size("n_head * head_dim", self.n_head * self.head_dim)

    @property
    def q_width(self) -> int:
        """Width of all query heads side by side, H * d: n_embd unless head_dim is set."""
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the keys (or the values) of every K/V head side by side, H_kv * d."""
        return (self.n_kv_head or self.n_head) * self.head_dim

    @property
    def has_qkv_bias(self) -> bool:
        """Whether q, k and v have biases: qkv_bias, or bias when it is None."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def attention_kind(self, layer: int) -> AttentionKind:
        """How layer `layer`'s attention places positions: the per-layer switches read once,
        here, so a block is built from the config and its index."""
        rotary = self.position == "rope" and layer not in (self.nope_layers or ())
        return AttentionKind(rotary=rotary)

    def with_layers(self, n_layer: int) -> GPTConfig:
        """This config with `n_layer` layers (the first ones: per-layer lists are cut), for
        the shape checks that build one or two layers of a model to learn the rest."""
        nope = None if self.nope_layers is None else tuple(i for i in self.nope_layers
                                                           if i < n_layer)
        return dataclasses.replace(self, n_layer=n_layer, nope_layers=nope or None)

    @property
    def hidden_width(self) -> int:
        """The MLP's hidden width: mlp_hidden, or 4C when it is None."""
        return 4 * self.n_embd if self.mlp_hidden is None else self.mlp_hidden

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        if self.n_head * self.head_dim == self.n_embd:
            values["head_dim"] = None  # n_embd // n_head: what a config.json said before
        if self.nope_layers is not None:
            values["nope_layers"] = list(self.nope_layers)  # JSON and TOML hold lists
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """Build from a plain dict (JSON, TOML); unknown keys are an error, never ignored.

        The legacy key `ln_eps` (config.json of runs made before `norm_eps`) is read as
        `norm_eps`."""
        if isinstance(values, dict) and "ln_eps" in values:
            if "norm_eps" in values:
                raise ConfigError("give norm_eps or its old name ln_eps, not both")
            values = {("norm_eps" if k == "ln_eps" else k): v for k, v in values.items()}
        return settings_from_dict(cls, values, "model config keys")

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """The `[model]` table of preset `name`, with `overrides` applied on top."""
        return cls.from_dict({**load_preset(name).get("model", {}), **overrides})


@dataclass
class TrainConfig:
    """Every training setting. Defaults follow nanoGPT; presets' [train] tables override them."""

    max_iters: int = setting(5000, "optimizer steps in total (a resumed run continues to it)")
    batch_size: int = setting(12, "sequences per micro-batch, per rank")
    grad_accum: int = setting(1, "micro-batches per optimizer step (at most 10,000)")
    lr: float = setting(6e-4, "peak learning rate")
    min_lr: float = setting(6e-5, "floor of the lr decay (cosine or wsd)")
    warmup_iters: int = setting(100, "steps of linear warmup")
    lr_decay_iters: int = setting(0, "step where the cosine decay ends (0: max_iters)")
    decay_lr: bool = setting(True, "warmup and cosine decay (else a constant lr)")
    weight_decay: float = setting(0.1, "AdamW weight decay of matrices and embeddings")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "largest gradient norm (0: no clipping)")
    eval_interval: int = setting(250, "evaluate and checkpoint every this many steps")
    eval_iters: int = setting(20, "batches per split in an evaluation (at most 10,000)")
    log_interval: int = setting(10, "steps between progress updates and metrics lines")
    device: str = setting("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = setting("auto", "autocast dtype: auto (bf16/fp16 on CUDA, float32 "
                         "elsewhere), float32, bfloat16, float16")
    compile: bool = setting(False, "torch.compile the model")
    fsdp: bool = setting(False, "under torchrun, shard weights, gradients and optimizer state "
                         "over the ranks (FSDP2) instead of a replica per rank (DDP)")
    seed: int = setting(1337, "seed of initialisation, batches and dropout")
    early_stop: int = setting(0, "stop after this many evaluations without a better val loss "
                              "(0: never)")
    target_loss: float | None = setting(None, "stop at the first evaluation whose val loss is "
                                        "at or below this (time to loss)")
    optimizer: str = setting("adamw", "adamw, or muon: Muon for the hidden matrices, AdamW "
                             "(lr, betas, weight_decay) for embeddings, head, norms and biases")
    muon_lr: float = setting(0.02, "peak lr of the Muon matrices (the schedule scales it)")
    muon_momentum: float = setting(0.95, "Muon's momentum (Nesterov)")
    muon_weight_decay: float = setting(0.0, "Muon's decoupled weight decay")
    schedule: str = setting("cosine", "decay after warmup: cosine, or wsd (constant lr, then "
                            "linear to min_lr over the last decay_fraction)")
    decay_fraction: float = setting(0.2, "wsd: the share of the steps after warmup spent "
                                    "decaying")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("max_iters", "batch_size", "grad_accum", "eval_interval", "eval_iters",
                     "log_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip", "min_lr",
                     "early_stop", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("schedule", self.schedule, SCHEDULES)
        if not self.muon_lr > 0 or self.muon_weight_decay < 0:
            raise ConfigError(f"muon_lr must be positive and muon_weight_decay >= 0, got "
                              f"{self.muon_lr} and {self.muon_weight_decay}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.target_loss is not None and not self.target_loss > 0:
            raise ConfigError(f"target_loss must be positive (a cross-entropy is never "
                              f"below 0), got {self.target_loss}")
        self._check_bounds()

    def _check_bounds(self) -> None:
        """Refuse work that cannot finish (a step or an evaluation of 10**12 batches) and rates
        that only overflow: the optimizer multiplies each weight by lr * weight_decay and moves
        it by about lr a step, so values past these bounds train nothing."""
        for name, largest in (("grad_accum", MAX_GRAD_ACCUM), ("eval_iters", MAX_EVAL_ITERS)):
            if getattr(self, name) > largest:
                raise ConfigError(f"{name}={getattr(self, name)} is too large (at most "
                                  f"{largest:,} batches)")
        for name in ("lr", "min_lr", "muon_lr", "weight_decay", "muon_weight_decay"):
            if getattr(self, name) > MAX_RATE:
                raise ConfigError(f"{name}={getattr(self, name)} is too large (at most "
                                  f"{MAX_RATE:g}): such a step only overflows the weights")
        if self.optimizer == "muon" and not math.isfinite(self.muon_lr / self.lr):
            raise ConfigError(f"lr={self.lr} is too small beside muon_lr={self.muon_lr}: Muon's "
                              f"lr follows the schedule in their ratio, which overflows")

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
        if value is None and optional == "None":
            continue
        if name == "tuple[int, ...]":  # a list from JSON, TOML or a flag: kept as a tuple
            _check_int_tuple(settings, field.name, value, error)
            continue
        expected = _FIELD_TYPES[name]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                raise error(f"{field.name}={_int_text(value)} is too large for a float (at "
                            f"most about 1.8e308)") from None
            object.__setattr__(settings, field.name, value)  # works on frozen dataclasses too
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise error(f"{field.name} must be {field.type}, got {value!r:.80}")
        if expected is int and abs(value) > INT64_MAX:
            raise error(f"{field.name}={_int_text(value)} is too large (at most 2**63 - 1)")
        if expected is float and not math.isfinite(value):
            raise error(f"{field.name} must be a finite number, got {value}")


def _check_int_tuple(settings: Any, name: str, value: Any,
                     error: type[GlassGPTError]) -> None:
    if not isinstance(value, list | tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) and abs(v) <= INT64_MAX
            for v in value):
        raise error(f"{name} must be a list of integers, got {value!r:.80}")
    object.__setattr__(settings, name, tuple(value))  # a tuple: no change behind the checks


def _int_text(value: int) -> str:
    """An int as digits, or its size when the digits would fill the line (or exceed str())."""
    return str(value) if value.bit_length() <= 128 else f"<an integer of {value.bit_length()} bits>"


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
