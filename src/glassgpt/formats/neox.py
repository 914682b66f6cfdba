"""GPT-NeoX (`gpt_neox`, `GPTNeoXForCausalLM`) in glassgpt's terms: its settings both ways and
its weight names.

Its sequential block (`use_parallel_residual=False`) with every feature rotated is glassgpt's
Pre-LN block with rotary positions and LayerNorm: LayerNorms with biases, a plain MLP
(`dense_h_to_4h`, the activation, `dense_4h_to_h`, with biases), scores scaled by
1/sqrt(head width), the rotary in glassgpt's layout (rotate-half). One layout differs: its fused
`query_key_value` holds each head's q, k and v rows in turn ([head 0's q, k, v, head 1's ...]),
ours every head's q, then every k, then every v; glassgpt.formats.interop regroups those rows
(`per_head_qkv`), nothing else is moved. Its head is `lm_head` in transformers 5 and
`embed_out` in every checkpoint (`stored_names`).

What glassgpt would compute differently is refused by name: the parallel residual (Pythia's
and GPT-NeoX-20B's default: attention and MLP read the same stream and are added together), a
partial rotary (`rotary_pct` / `partial_rotary_factor` below 1, a quarter by default), a rotary
scaling glassgpt lacks, `attention_bias=false` (the MLP and the norms keep theirs, where
glassgpt's `bias` is one switch), an activation glassgpt lacks, two dropout rates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from glassgpt.config import GATED_ACTIVATIONS, GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.formats.rotary import NEOX_ROTARY
from glassgpt.formats.translation import (
    ACTIVATION_FROM_HF,
    ACTIVATION_TO_HF,
    ROTARY_WRITTEN,
    Architecture,
    FamilyFields,
    one_dropout_rate,
    reader,
    rotary_context,
    shape_settings,
    unless_usual,
)

TITLE = "GPT-NeoX"
# What GPTNeoXConfig holds of a GPTConfig: its block in glassgpt's switches, and the fields its
# settings write (the rotary's are NEOX_ROTARY's).
NEOX_FIELDS = FamilyFields(
    TITLE, dict(position="rope", norm="layernorm", pre_ln=True, bias=True),
    ROTARY_WRITTEN | {"vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_hidden",
                      "activation", "norm_eps", "tie_weights", "dropout"})
# Buffers older checkpoints (Pythia's) stored beside the weights: the causal mask, its fill
# value and the rotary frequencies.
NEOX_BUFFER_SUFFIXES = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


def neox_layer(part: str) -> str:
    """The HF name of a GPT-NeoX layer's `part`: "{i}" is the layer index."""
    return f"gpt_neox.layers.{{i}}.{part}"


# glassgpt name -> HF name; `query_key_value` is our `qkv` with its rows regrouped per head.
NEOX_NAMES: dict[str, str | tuple[str, ...]] = {
    "tok_emb.weight": "gpt_neox.embed_in.weight",
    "ln_f.weight": "gpt_neox.final_layer_norm.weight",
    "ln_f.bias": "gpt_neox.final_layer_norm.bias",
    "lm_head.weight": "lm_head.weight",
    **{f"blocks.{{i}}.{ours}.{kind}": neox_layer(f"{theirs}.{kind}")
       for ours, theirs in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"),
                            ("attn.qkv", "attention.query_key_value"),
                            ("attn.proj", "attention.dense"), ("ffn.fc", "mlp.dense_h_to_4h"),
                            ("ffn.proj", "mlp.dense_4h_to_h"))
       for kind in ("weight", "bias")},
}
NEOX_PER_HEAD_QKV = frozenset({"blocks.{i}.attn.qkv.weight", "blocks.{i}.attn.qkv.bias"})


def neox_config_from_hf(hf_config: Any, dropout: float | None = None) -> GPTConfig:
    """The GPTConfig of a model that computes what a GPT-NeoX config describes."""
    setting = reader(hf_config, "gpt_neox")
    _refuse_unmirrored(setting)
    hidden = setting("hidden_size")
    return GPTConfig(
        vocab_size=setting("vocab_size"),
        block_size=rotary_context(setting),
        n_layer=setting("num_hidden_layers"),
        n_head=setting("num_attention_heads"),
        n_embd=hidden,
        dropout=_one_dropout(setting) if dropout is None else dropout,
        bias=True,
        activation=ACTIVATION_FROM_HF[setting("hidden_act")],
        pre_ln=True,
        tie_weights=setting("tie_word_embeddings"),
        norm="layernorm",
        norm_eps=float(setting("layer_norm_eps")),
        mlp_hidden=unless_usual(setting("intermediate_size"), 4 * hidden),
        position="rope",
        **NEOX_ROTARY.read(hf_config, setting),
    )


def _refuse_unmirrored(setting: Callable[[str], Any]) -> None:
    """ConfigError for the GPT-NeoX settings glassgpt would not compute as transformers does
    (the rotary's are NEOX_ROTARY's)."""
    if setting("use_parallel_residual"):
        raise ConfigError("use_parallel_residual=True is not supported: glassgpt's block "
                          "adds the attention's output to the stream before the MLP reads it "
                          "(GPT-NeoX's sequential block, use_parallel_residual=false)")
    if not setting("attention_bias"):
        raise ConfigError("attention_bias=False is not supported: GPT-NeoX's MLP and "
                          "LayerNorms keep their biases, and glassgpt's bias is one switch "
                          "for every layer")
    act = setting("hidden_act")
    if act not in ACTIVATION_FROM_HF:
        raise ConfigError(f"hidden_act={act!r:.40} has no glassgpt equivalent; supported: "
                          f"{sorted(ACTIVATION_FROM_HF)}")
    hidden, heads, head_dim = (setting(key) for key in
                               ("hidden_size", "num_attention_heads", "head_dim"))
    if head_dim is not None and isinstance(heads, int) and head_dim * heads != hidden:
        raise ConfigError(f"head_dim={head_dim} is not supported: GPT-NeoX's attention heads "
                          f"are hidden_size / num_attention_heads wide, and its rotary would "
                          f"be head_dim wide")


def _one_dropout(setting: Callable[[str], Any]) -> float:
    """`hidden_dropout` (embeddings, attention and MLP outputs) and `attention_dropout`
    (attention weights), which must agree: glassgpt drops all four at one rate."""
    return one_dropout_rate({name: float(setting(name)) for name in
                             ("hidden_dropout", "attention_dropout")})


def neox_settings(config: GPTConfig) -> dict[str, Any]:
    """GPTNeoXConfig's settings for `config` (the rotary apart: NEOX_ROTARY's kwargs); a
    ConfigError names any switch GPT-NeoX lacks."""
    _check_neox(config)
    return dict(
        shape_settings(config),
        hidden_act=ACTIVATION_TO_HF[config.activation],
        layer_norm_eps=config.norm_eps,
        use_parallel_residual=False,
        attention_bias=True,
        attention_dropout=config.dropout,
        hidden_dropout=config.dropout,
    )


def _check_neox(config: GPTConfig) -> None:
    NEOX_FIELDS.check_block(config)
    if config.activation not in ACTIVATION_TO_HF:
        gated = " (its MLP has no gate)" if config.activation in GATED_ACTIVATIONS else ""
        raise ConfigError(f"activation={config.activation!r} cannot be exported as {TITLE}, "
                          f"which supports {sorted(ACTIVATION_TO_HF)}{gated}")
    if not config.has_qkv_bias:
        raise ConfigError(f"qkv_bias={config.qkv_bias} beside bias=True cannot be exported as "
                          f"{TITLE}: its attention has biases on q, k, v and the output alike")
    if config.q_width != config.n_embd:
        raise ConfigError(f"head_dim={config.head_dim} cannot be exported: {TITLE}'s heads are "
                          f"n_embd / n_head = {config.n_embd / config.n_head:g} wide")
    NEOX_FIELDS.refuse_unwritten(config)


GPT_NEOX = Architecture("gpt_neox", TITLE, "GPTNeoXForCausalLM", "GPTNeoXConfig", "gpt_neox.",
                        NEOX_NAMES, frozenset(), NEOX_BUFFER_SUFFIXES, neox_config_from_hf,
                        neox_settings, NEOX_ROTARY, per_head_qkv=NEOX_PER_HEAD_QKV,
                        stored_names={"embed_out.weight": "lm_head.weight"})
