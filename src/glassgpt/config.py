"""The settings, each a dataclass validated when it is built: `GPTConfig` (a model's shape),
`TrainConfig` (a training recipe) and `SamplingConfig` (how to continue a prompt, with
`SAMPLING_DEFAULTS`, the one table of where a surface starts elsewhere), and the defaults the
command line lists in `--help`.

A leaf that imports no torch (only the errors and `config_checks`, the checks every setting
passes): the names of the model's choices (activations, attention paths) live here once.
Named presets live as TOML files in `glassgpt/presets/`; each has a `[model]` table and a
`[train]` table of recipe defaults.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any

from glassgpt.config_checks import (
    check_arena_switches,
    check_choice,
    check_dropout,
    check_field_types,
    check_gemma_switches,
    check_heads_divide_width,
    check_local_layers,
    check_n_kv_head,
    check_nope_layers,
    check_recipe,
    check_rope_scaling,
    check_sampling,
    check_size,
    check_widths_and_scales,
    settings_from_dict,
)
from glassgpt.errors import ConfigError, GlassGPTError

PRESETS_PACKAGE = "glassgpt.presets"
# exact GELU, GPT-2's tanh GELU, ReLU, ReLU squared, the gated SiLU (Llama) and tanh-GELU (Gemma)
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "relu2", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")  # whole MLPs with a gate and an up matrix
# a learned table, rotary, no positions (NoPE), or a learned table added to the queries' and
# keys' inputs only, never to the residual stream (shortformer: TransformerLens's, ARENA's)
POSITIONS = ("learned", "rope", "none", "shortformer")
NORMS = ("layernorm", "rmsnorm", "none")
ATTENTION_IMPLS = ("fused", "explicit")


@dataclass(frozen=True)
class AttentionKind:
    """What one layer's attention does with positions (`GPTConfig.attention_kind(layer)`).

    Per-layer variants are fields here, read by the attention built for that layer: whether
    it rotates q and k (a NoPE layer does not), with which base and whether the rotary scaling
    applies (Gemma 3's local layers have a base of their own and no scaling), and the window
    of a local layer (None: it sees every earlier position)."""

    rotary: bool
    rope_theta: float = 10000.0
    rope_scaled: bool = True
    window: int | None = None

    @property
    def local(self) -> bool:
        return self.window is not None


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
    position: str = setting("learned", "positions: learned, rope, none or shortformer")
    rope_theta: float = setting(10000.0, "base of the rotary angles")
    norm: str = setting("layernorm", "layernorm, rmsnorm or none")
    attn_only: bool = setting(False, "blocks of attention alone, no MLP (ARENA's model)")
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
    # Gemma 2 and 3: local layers beside global ones, and the scales and norms around them.
    sliding_window: int | None = setting(None, "a local layer's query sees itself and the "
                                         "W - 1 tokens before it (Gemma 3: 512)")
    local_layers: tuple[int, ...] | None = setting(None, "layers (from 0) with the sliding "
                                                   "window (default: all, once it is set)")
    rope_local_theta: float | None = setting(None, "the local layers' own rotary base, "
                                             "unscaled (Gemma 3: 10,000; default: as global)")
    query_pre_attn_scalar: float | None = setting(None, "scores times 1/sqrt(this) instead "
                                                  "of 1/sqrt(head_dim) (Gemma)")
    attn_softcap: float | None = setting(None, "cap * tanh(scores / cap) on attention scores "
                                         "(Gemma 2: 50; default: none)")
    post_norms: bool = setting(False, "norms on the attention's and the MLP's outputs too: "
                               "four a block (Gemma)")
    norm_offset: bool = setting(False, "RMSNorms scale by 1 + w, w starting at 0 (Gemma)")
    embed_scale: bool = setting(False, "token embeddings times sqrt(n_embd) (Gemma)")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        self._derive_head_dim()
        check_n_kv_head(self.n_head, self.n_head if self.n_kv_head is None else self.n_kv_head)
        check_dropout(self.dropout)
        check_widths_and_scales(self)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("attn_impl", self.attn_impl, ATTENTION_IMPLS)
        check_choice("position", self.position, POSITIONS)
        check_choice("norm", self.norm, NORMS)
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"rotary positions turn pairs of features, so the head width "
                              f"head_dim = {self.head_dim} must be even")
        check_rope_scaling(self)
        check_nope_layers(self)
        check_local_layers(self)
        check_gemma_switches(self)
        check_arena_switches(self)
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
        """head_dim left None is n_embd // n_head and follows later changes of either (`to_dict`
        writes None); `dataclasses.replace` passes the value on: give None beside new widths."""
        if self.head_dim is None or self.__dict__.get("_head_dim_derived"):
            d = check_heads_divide_width(self.n_embd, self.n_head)
            object.__setattr__(self, "head_dim", d)
            object.__setattr__(self, "_head_dim_derived", True)
        else:
            check_size("head_dim", self.head_dim)
            check_size("n_head * head_dim", self.n_head * self.head_dim)

    @property
    def q_width(self) -> int:  # all query heads side by side, H * d: n_embd unless head_dim is set
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:  # the keys (or the values) of every K/V head side by side, H_kv * d
        return (self.n_kv_head or self.n_head) * self.head_dim

    @property
    def has_qkv_bias(self) -> bool:
        """Whether q, k and v have biases: qkv_bias, or bias when it is None."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def is_local(self, layer: int) -> bool:  # whether layer `layer` has the sliding window
        if self.sliding_window is None:
            return False
        return self.local_layers is None or layer in self.local_layers

    def attention_kind(self, layer: int) -> AttentionKind:
        """How layer `layer`'s attention places positions: the per-layer switches read once,
        here, so a block is built from the config and its index."""
        rotary = self.position == "rope" and layer not in (self.nope_layers or ())
        local = self.is_local(layer)
        if local and self.rope_local_theta is not None:  # Gemma 3's local rotary
            return AttentionKind(rotary, self.rope_local_theta, False, self.sliding_window)
        return AttentionKind(rotary, self.rope_theta, True,
                             self.sliding_window if local else None)

    def with_layers(self, n_layer: int) -> GPTConfig:
        """This config with `n_layer` layers (the first ones: per-layer lists are cut), for
        the shape checks that build one or two layers of a model to learn the rest."""
        def first(layers: tuple[int, ...] | None) -> tuple[int, ...] | None:
            return None if layers is None else tuple(i for i in layers if i < n_layer)

        # An empty nope_layers is None (every layer rotates); an empty local_layers stays
        # empty (no layer is local), since None there means every layer.
        return dataclasses.replace(self, n_layer=n_layer,
                                   nope_layers=first(self.nope_layers) or None,
                                   local_layers=first(self.local_layers))

    @property
    def hidden_width(self) -> int:
        """The MLP's hidden width: mlp_hidden, or 4C when it is None."""
        return 4 * self.n_embd if self.mlp_hidden is None else self.mlp_hidden

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        if self.n_head * self.head_dim == self.n_embd:
            values["head_dim"] = None  # n_embd // n_head: what a config.json said before
        for name in ("nope_layers", "local_layers"):
            if values[name] is not None:
                values[name] = list(values[name])  # JSON and TOML hold lists
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
    snapshots: int = setting(0, "keep this many weight snapshots at log-spaced steps (0: none)")

    def __post_init__(self) -> None:
        check_recipe(self)  # types, ranges, choices and the bounds of work that can finish

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return settings_from_dict(cls, values, "training settings")


@dataclass(frozen=True)
class SamplingConfig:
    """How to continue a prompt: the settings `generate`, `glassgpt sample` and `glassgpt view`
    share. Its defaults are the library's, the model's own distribution (`temperature=0` is
    greedy); `glassgpt sample` and the view start from their rows of SAMPLING_DEFAULTS."""

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
        check_sampling(self)


@dataclass(frozen=True)
class SamplingDefaults:
    """A row of SAMPLING_DEFAULTS: where a surface samples with other defaults than
    `SamplingConfig`'s, which (`changes`), and why."""

    where: str
    changes: dict[str, Any]
    why: str


# The one table of sampling defaults. `SamplingConfig`'s own fields are the library's; a
# surface that must start elsewhere changes them here, says why, and reads its row through
# `sampling_defaults` (its flags, its requests, its page), never a number of its own.
# `glassgpt sample --help` prints this table; tests/test_sampling_defaults.py holds every
# surface to its row.
READABLE_TEXT = {"temperature": 0.8, "top_k": 200, "seed": 1337}
SAMPLING_DEFAULTS = {
    "library": SamplingDefaults(
        "generate(), SamplingConfig(), the view's next-token bars", {},
        "the model's own distribution, unseeded: a library call reshapes nothing unasked"),
    "sample": SamplingDefaults(
        "glassgpt sample", READABLE_TEXT,
        "text to read: the tail of unlikely tokens is cut (a small model's tail reads as "
        "noise; nanoGPT's settings), and the same command prints the same text"),
    "view": SamplingDefaults(
        "glassgpt view's Sampling panel (POST /api/sample)",
        {**READABLE_TEXT, "max_new_tokens": 200},
        "glassgpt sample's text, 200 tokens: a panel's worth that streams in seconds"),
}


def sampling_defaults(surface: str) -> SamplingConfig:
    """The settings `surface` ("library", "sample", "view") starts from: its row's changes
    applied to `SamplingConfig()`."""
    return SamplingConfig(**SAMPLING_DEFAULTS[surface].changes)


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


# --- What the command line lists in --help -----------------------------------------------
# `glassgpt --help` builds every command's parser, which needs its flags' choices and defaults
# before any work starts. Their users (the tokenizers, the data pipeline, the benchmarks)
# import torch or numpy; this module imports neither, so the names live here, once.

TOKENIZER_KINDS = ("char", "bpe")  # glassgpt.tokenizers
DEFAULT_BPE_VOCAB = 1024
INSTALL_HINT = "pip install 'glassgpt[hf]'"  # what installs the optional Hugging Face extra
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")  # the matrices' types `convert --to-gguf` writes
DEFAULT_BUFFER_BYTES = 64 * 2**20  # glassgpt.data.pipeline: text and token ids in flight
# glassgpt.bench: the model shapes measured by default, and the decoding workload
TRAIN_PRESETS = ("cpu-small", "shakespeare-char")
DECODE_PRESETS = ("shakespeare-char", "gpt2")
PROMPT_LEN, NEW_TOKENS = 16, 128
# glassgpt.bench.ladder: the val loss every rung trains to, and what counts as a close gain
TARGET_LOSS = 1.88  # nanoGPT's published val loss for that recipe
QUICK_TARGET = 3.5  # --quick: the same rungs at a toy size, which every rung reaches
NOISE = 0.10  # from one seed, a gain under 10% is called close (rerun it with several seeds)
