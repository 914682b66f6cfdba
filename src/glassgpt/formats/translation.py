"""What every Hugging Face architecture's translation shares: the `Architecture` record the
table holds, and the small steps its settings go through both ways (a setting read with its
family's default, a width left None where GPTConfig's default already means it, the one
dropout rate, the fields each family writes, with every other switch refused by name).

The families themselves are glassgpt.formats.architectures (GPT-2 and the Llama family, and the
table of all) and glassgpt.formats.gemma (Gemma 3 and 2), which imports from here and not from the
table that lists it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from glassgpt.config import GPTConfig
from glassgpt.config_checks import ALL_ROPE_SCALING_SETTINGS
from glassgpt.errors import ConfigError
from glassgpt.formats.hf_settings import HF_SETTINGS
from glassgpt.formats.rotary import RotaryTranslation

# Rotary positions have no table in the weights to bound the context, and the model keeps a
# position index per position: a config.json's context is bounded here (the longest models
# published hold about 10M positions).
MAX_ROTARY_CONTEXT = 2**24
# HF activation names that compute the same function as one of ours (a plain MLP's: GPT-2's and
# GPT-NeoX's). "gelu_new" is GPT-2's own (tanh approximation); "gelu_fast" is left out because
# it rounds sqrt(2/pi) to 10 digits.
ACTIVATION_FROM_HF = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "relu": "relu",
}
ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
# Old Llama checkpoints (transformers < 4.31) saved each layer's rotary frequencies.
ROTARY_BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)


def llama_layer(part: str) -> str:
    """The HF name of a decoder layer's `part` in the Llama family and Gemma: "{i}" is the
    layer index."""
    return f"model.layers.{{i}}.{part}"


# glassgpt name -> HF name in the Llama family (Gemma starts from these too); a tuple is the HF
# tensors stacked along the rows of ours (q, k, v).
LLAMA_NAMES: dict[str, str | tuple[str, ...]] = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "blocks.{i}.ln1.weight": llama_layer("input_layernorm.weight"),
    "blocks.{i}.ln2.weight": llama_layer("post_attention_layernorm.weight"),
    **{f"blocks.{{i}}.attn.qkv.{kind}": tuple(llama_layer(f"self_attn.{p}_proj.{kind}")
                                            for p in "qkv") for kind in ("weight", "bias")},
    "blocks.{i}.attn.proj.weight": llama_layer("self_attn.o_proj.weight"),
    "blocks.{i}.attn.proj.bias": llama_layer("self_attn.o_proj.bias"),
    "blocks.{i}.attn.q_norm.weight": llama_layer("self_attn.q_norm.weight"),
    "blocks.{i}.attn.k_norm.weight": llama_layer("self_attn.k_norm.weight"),
    **{f"blocks.{{i}}.ffn.{ours}.{kind}": llama_layer(f"mlp.{theirs}_proj.{kind}")
       for ours, theirs in (("gate", "gate"), ("up", "up"), ("proj", "down"))
       for kind in ("weight", "bias")},
}


# --- GGUF: the same model as llama.cpp names it -----------------------------------------------


def gguf_block_names(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """A block's rows of a GGUF name table: each (our module, llama.cpp's tensor) pair's weight,
    then its bias, "blocks.{i}.attn.proj.weight" -> "blk.{i}.attn_output.weight"."""
    return {f"blocks.{{i}}.{ours}.{kind}": f"blk.{{i}}.{theirs}.{kind}"
            for ours, theirs in pairs for kind in ("weight", "bias")}


@dataclass(frozen=True)
class GGUFSetting:
    """One metadata key llama.cpp reads to build the model: its name ("{arch}" is
    general.architecture), the GGUF type it is written as, and its value for a config (None:
    the key is not written)."""

    key: str
    kind: str  # "uint32", "float32" or "string": gguf's GGUFWriter.add_<kind>
    value: Callable[[GPTConfig], Any]


@dataclass(frozen=True)
class GGUFLimit:
    """A setting llama.cpp's version of a family computes at fewer values than transformers':
    a config where `holds` is False is refused, naming `setting` and `why` (formatted with the
    config as `config`)."""

    setting: str
    holds: Callable[[GPTConfig], bool]
    why: str


@dataclass(frozen=True)
class GGUFArchitecture:
    """How a family is written as one GGUF file for llama.cpp: the architecture llama.cpp
    computes it as, its tensors' names, the keys of its settings, and where llama.cpp's version
    computes less than transformers'."""

    name: str  # general.architecture, llama.cpp's name for it
    # glassgpt name -> GGUF name, in the file's order (the block rows once per layer, where the
    # first of them stands); a tuple is the tensors our rows are cut into (q, k, v)
    names: dict[str, str | tuple[str, ...]]
    settings: tuple[GGUFSetting, ...]  # beyond the shape every architecture writes alike
    limits: tuple[GGUFLimit, ...] = ()
    # llama.cpp rotates adjacent features (2i, 2i + 1) where glassgpt rotates i with i + d/2:
    # each head's q and k rows are reordered to put every pair side by side
    adjacent_pairs: bool = False
    rope_factors: bool = False  # llama.cpp reads Llama 3's rotary factors (rope_freqs.weight)


@dataclass(frozen=True)
class Architecture:
    """One HF architecture: its names, and the translation of its settings both ways."""

    model_type: str  # config.json's "model_type"
    title: str  # for messages
    hf_class: str  # the `transformers` class of the LM
    hf_config_class: str  # ... and of its config
    base_prefix: str  # the base model's attribute inside the LM, as its weight names show
    names: dict[str, str | tuple[str, ...]]
    conv1d: frozenset[str]  # our name patterns whose HF weight is stored (in, out)
    skipped: tuple[str, ...]  # suffixes of buffers old checkpoints stored beside the weights
    config_from_hf: Callable[[Any, float | None], GPTConfig]
    hf_settings: Callable[[GPTConfig], dict[str, Any]]  # kwargs of the transformers config
    rotary: RotaryTranslation | None = None  # how its rotary settings are written; None: none
    # settings an older transformers' config class would keep without acting on them
    required_settings: tuple[str, ...] = ()
    # our name patterns whose one HF tensor holds each head's q, k and v rows in turn (GPT-NeoX's
    # fused projection) where ours holds every head's q, then every k, then every v
    per_head_qkv: frozenset[str] = frozenset()
    # HF name in the files -> HF name in the installed transformers' model, where a checkpoint
    # keeps an older name (GPT-NeoX's head is `embed_out` on disk, `lm_head` in transformers 5)
    stored_names: dict[str, str] = field(default_factory=dict)
    gguf: GGUFArchitecture | None = None  # how it is written as GGUF; None: it is not


def reader(hf_config: Any, model_type: str) -> Callable[[str], Any]:
    """setting(key): the config's value, or transformers' default when it has none."""
    defaults = HF_SETTINGS[model_type]
    return lambda key: getattr(hf_config, key, defaults.get(key, (None,))[0])


def unless_usual(value: int, usual: int) -> int | None:
    """None where GPTConfig's None means `value` already (so a round trip keeps the config)."""
    return None if value == usual else value


def own_head_width(head_dim: Any, heads: Any, hidden: Any) -> int | None:
    """head_dim, or None where it is hidden_size / heads (GPTConfig's default)."""
    if head_dim is None or not isinstance(heads, int) or not isinstance(hidden, int):
        return head_dim  # GPTConfig's checks name a width that is no integer
    return None if head_dim * heads == hidden else head_dim


def rotary_context(setting: Callable[[str], Any]) -> Any:
    """max_position_embeddings, bounded (see MAX_ROTARY_CONTEXT)."""
    context = setting("max_position_embeddings")
    if isinstance(context, int) and context > MAX_ROTARY_CONTEXT:
        raise ConfigError(f"max_position_embeddings={context:,} is more than glassgpt holds "
                          f"(at most {MAX_ROTARY_CONTEXT:,} positions)")
    return context


def attention_dropout(setting: Callable[[str], Any]) -> float:
    """0.0: a family that drops attention weights only must not drop them (glassgpt has one
    rate for embeddings, residuals and attention), unless the caller chooses one."""
    rate = float(setting("attention_dropout"))
    if rate != 0.0:
        raise ConfigError(f"attention_dropout={rate}: glassgpt has one dropout rate (embeddings, "
                          f"residuals and attention alike); choose one with dropout=... "
                          f"(--dropout on the command line)")
    return 0.0


def one_dropout_rate(rates: dict[str, float]) -> float:
    """The one rate of a family that names several (embeddings, residuals, attention), or a
    ConfigError where they differ: glassgpt has one."""
    if len(set(rates.values())) > 1:
        raise ConfigError(f"glassgpt has one dropout rate, this model has {rates}; "
                          f"choose one with dropout=... (--dropout on the command line)")
    return next(iter(rates.values()))


# GPTConfig fields no HF config holds, because a trained model computes the same without them:
# the attention path (fused and explicit agree, tests/test_attention.py) and how the weights
# start (an export carries the weights themselves).
NOT_COMPUTED = frozenset({"attn_impl", "zero_init_proj"})
# The fields `decoder_settings` writes, and every rotary family's (glassgpt.formats.rotary's).
DECODER_WRITTEN = frozenset({"vocab_size", "block_size", "n_layer", "n_head", "n_embd",
                             "n_kv_head", "head_dim", "mlp_hidden", "norm_eps", "tie_weights",
                             "dropout"})
ROTARY_WRITTEN = frozenset({"rope_theta", "rope_scaling", *ALL_ROPE_SCALING_SETTINGS})
DEFAULTS = {known.name: known.default for known in dataclasses.fields(GPTConfig)}
# Fields whose default (None) stands for a value that follows from others: (what `config`
# computes with, what the default would).
DERIVED_DEFAULTS: dict[str, Callable[[GPTConfig], tuple[Any, Any]]] = {
    "mlp_hidden": lambda config: (config.hidden_width, 4 * config.n_embd),
    "n_kv_head": lambda config: (config.n_kv_head or config.n_head, config.n_head),
    "head_dim": lambda config: (config.q_width, config.n_embd),
    "qkv_bias": lambda config: (config.has_qkv_bias, config.bias),
}


@dataclass(frozen=True)
class FamilyFields:
    """What one family's HF config holds of a GPTConfig, declared once beside its settings:
    `block`, the switches that make a config this family's block, each with the one value it
    has; `written`, the fields its settings write; `inert`, fields its block never reads.
    Every other field must keep its default (`refuse_unwritten`), so a switch no family writes,
    a new GPTConfig field included, is refused by name rather than dropped
    (tests/test_export_coverage.py walks them all)."""

    title: str
    block: dict[str, Any]
    written: frozenset[str]
    inert: frozenset[str] = frozenset()
    hint: str = ""  # follows a block switch's refusal: where a config with another one goes

    def check_block(self, config: GPTConfig) -> None:
        """ConfigError for the first block switch `config` sets otherwise."""
        for name in self.block:
            self._refuse_unless_kept(config, name)

    def refuse_unwritten(self, config: GPTConfig) -> None:
        """ConfigError for the first field neither written nor at the value this family has
        (its block's, else GPTConfig's default)."""
        skipped = self.written | self.inert | NOT_COMPUTED
        for known in dataclasses.fields(GPTConfig):
            if known.name not in skipped:
                self._refuse_unless_kept(config, known.name)

    def _refuse_unless_kept(self, config: GPTConfig, name: str) -> None:
        value = getattr(config, name)
        if name in self.block:
            if value != self.block[name]:
                raise ConfigError(f"{name}={value!r} cannot be exported: {self.title} has "
                                  f"{name}={self.block[name]!r}{self.hint}")
            return
        in_effect, default = (DERIVED_DEFAULTS[name](config) if name in DERIVED_DEFAULTS
                              else (value, DEFAULTS[name]))
        if in_effect != default:
            raise ConfigError(f"{name}={value!r} cannot be exported: {self.title} has no such "
                              f"setting")


def shape_settings(config: GPTConfig) -> dict[str, Any]:
    """The transformers config settings every rotary family writes alike: the shape, the
    position table's length and the tie (and no padding token)."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.hidden_width,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        max_position_embeddings=config.block_size,
        tie_word_embeddings=config.tie_weights,
        pad_token_id=None,
    )


def decoder_settings(config: GPTConfig) -> dict[str, Any]:
    """The transformers config settings the Llama family and Gemma share (the shape, the norm's
    epsilon, the tie, the dropout); each family adds its activation, biases and its own."""
    return dict(
        shape_settings(config),
        num_key_value_heads=config.n_kv_head or config.n_head,
        head_dim=config.head_dim,
        rms_norm_eps=config.norm_eps,
        attention_dropout=config.dropout,  # HF drops attention weights only
    )


def decoder_fields(setting: Callable[[str], Any], dropout: float | None) -> dict[str, Any]:
    """GPTConfig's fields that the Llama family and Gemma read alike (`decoder_settings` the
    other way): the shape, a rotary Pre-LN RMSNorm decoder, the tie and the one dropout rate.
    Each family adds its activation, biases, rotary and switches."""
    hidden, heads = setting("hidden_size"), setting("num_attention_heads")
    n_kv_head = setting("num_key_value_heads") or heads
    return dict(
        vocab_size=setting("vocab_size"),
        block_size=rotary_context(setting),
        n_layer=setting("num_hidden_layers"),
        n_head=heads,
        n_embd=hidden,
        head_dim=own_head_width(setting("head_dim"), heads, hidden),
        n_kv_head=None if n_kv_head == heads else n_kv_head,
        dropout=attention_dropout(setting) if dropout is None else dropout,
        mlp_hidden=unless_usual(setting("intermediate_size"), 4 * hidden),
        pre_ln=True,
        tie_weights=setting("tie_word_embeddings"),
        norm="rmsnorm",
        norm_eps=float(setting("rms_norm_eps")),
        position="rope",
    )

