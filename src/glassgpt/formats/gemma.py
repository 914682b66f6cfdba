"""Gemma 3 (`gemma3_text`, `Gemma3ForCausalLM`) and Gemma 2 (`gemma2`, `Gemma2ForCausalLM`) in
glassgpt's terms: their settings both ways and their weight names.

A Gemma 3 block is a Pre-LN block with four RMSNorms (`post_norms`: the attention's and the
MLP's outputs are normalised too), each scaling by 1 + w (`norm_offset`, q_norm and k_norm as
well); its embeddings are multiplied by sqrt(width) (`embed_scale`); its MLP is GeGLU with the
tanh GELU; its scores are scaled by query_pre_attn_scalar ** -0.5. Layers are local
(`sliding_window`, `local_layers`: transformers' `layer_types`, or the older
`sliding_window_pattern`) or global, each kind with its own rotary base (glassgpt.formats.rotary's
LAYERED_ROTARY). Every glassgpt weight is one HF weight, q, k and v stacked as Llama's are;
the norm weights are stored as w on both sides, so nothing is rounded on the way.
Gemma 2 is the same block without QK-norm, with one rotary for every layer, local and global
layers alternating (where a config has no layer_types), and soft-caps that transformers
applies to the attention scores (`attn_logit_softcapping`: glassgpt's `attn_softcap`) as well
as to the final logits.

What glassgpt would compute differently is refused by name: `attn_logit_softcapping` (the
installed transformers' Gemma 3 does not apply it, so no model matches both the setting and
transformers), `use_bidirectional_attention`, `attention_bias` (on q, k, v and o, where
glassgpt's qkv_bias covers q, k and v alone), an activation that is not the tanh GELU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.formats.rotary import LAYERED_ROTARY, PLAIN_ROTARY
from glassgpt.formats.translation import (
    DECODER_WRITTEN,
    LLAMA_NAMES,
    ROTARY_BUFFER_SUFFIXES,
    ROTARY_WRITTEN,
    Architecture,
    FamilyFields,
    decoder_fields,
    decoder_settings,
    llama_layer,
    reader,
)

# HF activation names of the tanh GELU (GeGLU's gate), and the one an export writes.
TANH_GELU_NAMES = ("gelu_pytorch_tanh", "gelu_new", "gelu_python_tanh")
GEMMA_ACTIVATION = "gelu_pytorch_tanh"
FULL, SLIDING = "full_attention", "sliding_attention"
# The switches that make a GPTConfig Gemma's block, each with the value Gemma has (and Gemma 3
# has qk_norm too).
GEMMA_SWITCHES = dict(position="rope", norm="rmsnorm", activation="geglu", pre_ln=True,
                      post_norms=True, norm_offset=True, embed_scale=True, bias=False)
GEMMA2_PATTERN = 2  # Gemma 2 without layer_types: every second layer global
# What Gemma's configs hold of a GPTConfig: Gemma 3 has QK-norm and a local rotary base, Gemma 2
# soft-capped scores.
GEMMA_WRITTEN = DECODER_WRITTEN | ROTARY_WRITTEN | {
    "sliding_window", "local_layers", "query_pre_attn_scalar", "logit_softcap"}
GEMMA3_FIELDS = FamilyFields("Gemma 3", {**GEMMA_SWITCHES, "qk_norm": True},
                             GEMMA_WRITTEN | {"rope_local_theta"})
GEMMA2_FIELDS = FamilyFields("Gemma 2", {**GEMMA_SWITCHES, "qk_norm": False},
                             GEMMA_WRITTEN | {"attn_softcap"})


# Llama's names without its biases (Gemma has none), its ln2 renamed: Gemma's norm before the
# MLP is `pre_feedforward_layernorm`, and `post_attention_layernorm` is the norm on the
# attention's output (glassgpt's ln1_post).
GEMMA_NAMES: dict[str, str | tuple[str, ...]] = {
    **{ours: theirs for ours, theirs in LLAMA_NAMES.items() if not ours.endswith(".bias")},
    "blocks.{i}.ln1_post.weight": llama_layer("post_attention_layernorm.weight"),
    "blocks.{i}.ln2.weight": llama_layer("pre_feedforward_layernorm.weight"),
    "blocks.{i}.ln2_post.weight": llama_layer("post_feedforward_layernorm.weight"),
}


def gemma_config_from_hf(hf_config: Any, dropout: float | None = None) -> GPTConfig:
    """The GPTConfig of a model that computes what a Gemma 3 text or Gemma 2 config describes."""
    gemma3 = hf_config.model_type == "gemma3_text"
    setting = reader(hf_config, hf_config.model_type)
    _refuse_unmirrored(setting, "Gemma 3" if gemma3 else "Gemma 2")
    n_layer = setting("num_hidden_layers")
    local = _local_layers(setting, n_layer, None if gemma3 else GEMMA2_PATTERN)
    window = _window(setting) if local else None
    if gemma3:
        rotary = LAYERED_ROTARY.read(hf_config, setting)
        local_theta = rotary.pop("rope_local_theta")
        if not local or (local_theta == rotary["rope_theta"] and "rope_scaling" not in rotary):
            local_theta = None  # the local layers rotate as the global ones do
    else:  # one rotary for every layer
        rotary, local_theta = PLAIN_ROTARY.read(hf_config, setting), None
    return GPTConfig(
        **decoder_fields(setting, dropout),
        bias=False,
        activation="geglu",
        **rotary,
        sliding_window=window,
        local_layers=None if local is None or len(local) == n_layer else local,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=setting("query_pre_attn_scalar"),
        attn_softcap=None if gemma3 else setting("attn_logit_softcapping"),
        logit_softcap=setting("final_logit_softcapping"),
        qk_norm=gemma3,
        post_norms=True,
        norm_offset=True,
        embed_scale=True,
    )


def _refuse_unmirrored(setting: Callable[[str], Any], title: str) -> None:
    """ConfigError for the Gemma settings glassgpt would not compute as transformers does."""
    cap = setting("attn_logit_softcapping")
    if cap is not None and title == "Gemma 3":
        raise ConfigError(f"attn_logit_softcapping={cap} is not supported: the installed "
                          f"transformers' Gemma 3 does not apply it, so no glassgpt model "
                          f"computes both it and what transformers does")
    if setting("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=True is not supported: glassgpt's "
                          "attention is causal")
    if setting("attention_bias"):
        raise ConfigError(f"attention_bias=True is not supported: {title} puts biases on q, k, "
                          f"v and o_proj, glassgpt's qkv_bias on q, k and v alone")
    act = setting("hidden_activation")
    if act not in TANH_GELU_NAMES:
        raise ConfigError(f"hidden_activation={act!r:.40} is not supported: glassgpt's GeGLU "
                          f"gates with the tanh GELU ({', '.join(TANH_GELU_NAMES)})")


def _local_layers(setting: Callable[[str], Any], n_layer: Any,
                  pattern: int | None) -> tuple[int, ...] | None:
    """The sliding-window layers: `layer_types`' "sliding_attention" ones, or every layer but
    each `pattern`-th (Gemma 3's `sliding_window_pattern` where `pattern` is None) where a
    config has no layer_types, as transformers makes them. None where no layer is local."""
    if not isinstance(n_layer, int):
        return None  # GPTConfig names the bad n_layer
    kinds = setting("layer_types")
    if kinds is None:
        pattern = setting("sliding_window_pattern") if pattern is None else pattern
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ConfigError(f"sliding_window_pattern must be a positive integer, got "
                              f"{pattern!r:.40}")
        kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layer)]
    if len(kinds) != n_layer or any(kind not in (FULL, SLIDING) for kind in kinds):
        raise ConfigError(f"layer_types must name {FULL!r} or {SLIDING!r} for each of the "
                          f"{n_layer} layers, got {kinds!r:.80}")
    return tuple(i for i, kind in enumerate(kinds) if kind == SLIDING) or None


def _window(setting: Callable[[str], Any]) -> int:
    window = setting("sliding_window")
    if window is None:
        raise ConfigError("sliding_window=None beside sliding_attention layers: a local layer "
                          "needs the number of tokens it sees")
    return window


def gemma3_settings(config: GPTConfig) -> dict[str, Any]:
    """Gemma3TextConfig's settings for `config` (the rotary apart: LAYERED_ROTARY's kwargs);
    a ConfigError names any switch Gemma 3 lacks."""
    _check_gemma(config, GEMMA3_FIELDS)
    local = any(config.is_local(i) for i in range(config.n_layer))
    if local and config.rope_scaling is not None and config.rope_local_theta is None:
        raise ConfigError(f"rope_scaling={config.rope_scaling!r} on the local layers cannot be "
                          f"exported: Gemma 3's local layers rotate unscaled (give them "
                          f"rope_local_theta)")
    GEMMA3_FIELDS.refuse_unwritten(config)
    return {**_gemma_settings(config), "attn_logit_softcapping": None}


def gemma2_settings(config: GPTConfig) -> dict[str, Any]:
    """Gemma2Config's settings for `config` (the rotary apart: PLAIN_ROTARY's kwargs); a
    ConfigError names any switch Gemma 2 lacks."""
    _check_gemma(config, GEMMA2_FIELDS)
    if config.rope_local_theta is not None:
        raise ConfigError(f"rope_local_theta={config.rope_local_theta} cannot be exported: "
                          f"Gemma 2's layers share one rotary (Gemma 3 has QK-norm)")
    GEMMA2_FIELDS.refuse_unwritten(config)
    return {**_gemma_settings(config), "attn_logit_softcapping": config.attn_softcap}


def _check_gemma(config: GPTConfig, family: FamilyFields) -> None:
    family.check_block(config)
    if config.has_qkv_bias:
        raise ConfigError(f"qkv_bias={config.qkv_bias} cannot be exported: {family.title} has "
                          f"no biases")
    if config.n_embd % config.n_head:
        raise ConfigError(f"n_embd={config.n_embd} with n_head={config.n_head} cannot be "
                          f"exported: transformers' {family.title} needs heads that divide "
                          f"the width")


def _gemma_settings(config: GPTConfig) -> dict[str, Any]:
    return dict(
        **decoder_settings(config),
        hidden_activation=GEMMA_ACTIVATION,
        attention_bias=False,
        query_pre_attn_scalar=_integer_scalar(config),
        # transformers builds the sliding mask even where no layer is local
        sliding_window=config.sliding_window or config.block_size,
        layer_types=[SLIDING if config.is_local(i) else FULL for i in range(config.n_layer)],
        final_logit_softcapping=config.logit_softcap,
        use_bidirectional_attention=False,
    )


def _integer_scalar(config: GPTConfig) -> int:
    """query_pre_attn_scalar as transformers takes it: an integer (head_dim where unset)."""
    scalar = config.query_pre_attn_scalar
    if scalar is None:
        return config.head_dim
    if scalar != int(scalar):
        raise ConfigError(f"query_pre_attn_scalar={scalar} cannot be exported: Gemma's is an "
                          f"integer")
    return int(scalar)


# Before 4.53 transformers had no layer_types: Gemma 3's sliding_window_pattern, Gemma 2's
# alternation.
GEMMA3 = Architecture("gemma3_text", "Gemma 3", "Gemma3ForCausalLM", "Gemma3TextConfig",
                      "model.", GEMMA_NAMES, frozenset(), ROTARY_BUFFER_SUFFIXES,
                      gemma_config_from_hf, gemma3_settings, LAYERED_ROTARY,
                      required_settings=("layer_types",))
GEMMA2 = Architecture("gemma2", "Gemma 2", "Gemma2ForCausalLM", "Gemma2Config", "model.",
                      GEMMA_NAMES, frozenset(), ROTARY_BUFFER_SUFFIXES, gemma_config_from_hf,
                      gemma2_settings, PLAIN_ROTARY, required_settings=("layer_types",))
