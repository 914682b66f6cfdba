"""What each Hugging Face architecture is in glassgpt's terms: its settings and its weight names.

Eight architectures have a glassgpt twin, all of them Pre-LN decoders with one weight per
glassgpt weight:
  * GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, a GELU MLP, biases everywhere.
    Its projections are `Conv1D` modules, which store the weight as (in, out) where `nn.Linear`
    stores (out, in): those weights are transposed on the way through, nothing else is.
  * Llama (`LlamaForCausalLM`, SmolLM2 too): rotary positions (plain, or Llama 3's or linear
    scaling), RMSNorm, a SwiGLU MLP, grouped K/V heads, no biases (or biases in every
    projection), heads of their own width where `head_dim` says so.
  * Qwen3 (`Qwen3ForCausalLM`): Llama with an RMSNorm over each head's q and k (`qk_norm`).
  * Qwen2 (`Qwen2ForCausalLM`, Qwen2.5 too): Llama with biases on q, k and v only.
  * SmolLM3 (`SmolLM3ForCausalLM`): Llama with layers that skip rotary (`nope_layers`).
  * Gemma 3 (`Gemma3ForCausalLM`, model_type `gemma3_text`): four norms a block, local and
    global layers with a rotary base each, GeGLU; Gemma 2 (`Gemma2ForCausalLM`) the same
    without QK-norm, one rotary, soft-capped scores. Their translation is glassgpt.formats.gemma's.
  * GPT-NeoX (`GPTNeoXForCausalLM`): its sequential block with every feature rotated is
    glassgpt's rotary positions with LayerNorm and a plain MLP, biases everywhere. Its fused
    `query_key_value` holds each head's q, k and v in turn: those rows are regrouped on the way
    through (`per_head_qkv`). Its translation is glassgpt.formats.neox's.
The Llama family and Gemma keep Q, K and V in three matrices where glassgpt stacks them in one
`qkv` (rows [Q, K, V]); every rotary family's layout is glassgpt's (rotate-half), so no
weight's features are permuted.

Each translation refuses, with one line naming the setting, what the other side would compute
differently (a rotary scaling glassgpt lacks, sliding windows, biases glassgpt cannot place).
An export declares per family which GPTConfig fields its HF config writes (`FamilyFields`);
every other field must keep its default, or it is refused by name, with the switches that
chose the family (tests/test_export_coverage.py walks every field on every family).
Settings come from config.json as glassgpt.formats.files reads it, or from a `transformers` config
object: both are read by attribute, with transformers' defaults for what is left out. The
rotary settings are glassgpt.formats.rotary's, the steps every family shares
glassgpt.formats.translation's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from glassgpt.config import GATED_ACTIVATIONS, GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.formats.files import MASK_BUFFER_SUFFIXES
from glassgpt.formats.gemma import GEMMA2, GEMMA3
from glassgpt.formats.neox import GPT_NEOX
from glassgpt.formats.rotary import PLAIN_ROTARY, rotary_from_hf
from glassgpt.formats.translation import (
    ACTIVATION_FROM_HF,
    ACTIVATION_TO_HF,
    DECODER_WRITTEN,
    LLAMA_NAMES,
    ROTARY_BUFFER_SUFFIXES,
    ROTARY_WRITTEN,
    Architecture,
    FamilyFields,
    GGUFArchitecture,
    GGUFLimit,
    GGUFSetting,
    decoder_fields,
    decoder_settings,
    gguf_block_names,
    one_dropout_rate,
    reader,
)

SILU_NAMES = ("silu", "swish")  # transformers' two names for x * sigmoid(x), SwiGLU's gate
IMPORTABLE = ("GPT-2 (gpt2), Llama (llama), Qwen3 (qwen3), Qwen2 (qwen2), SmolLM3 "
              "(smollm3), Gemma 3 (gemma3_text), Gemma 2 (gemma2) and GPT-NeoX (gpt_neox)")

# glassgpt name -> HF name. "{i}" is the layer index; a tuple is the HF tensors stacked along
# the rows of ours (q, k, v).
GPT2_NAMES: dict[str, str | tuple[str, ...]] = {
    "tok_emb.weight": "transformer.wte.weight",
    "pos_emb.weight": "transformer.wpe.weight",
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",
    "blocks.{i}.ln1.weight": "transformer.h.{i}.ln_1.weight",
    "blocks.{i}.ln1.bias": "transformer.h.{i}.ln_1.bias",
    "blocks.{i}.attn.qkv.weight": "transformer.h.{i}.attn.c_attn.weight",
    "blocks.{i}.attn.qkv.bias": "transformer.h.{i}.attn.c_attn.bias",
    "blocks.{i}.attn.proj.weight": "transformer.h.{i}.attn.c_proj.weight",
    "blocks.{i}.attn.proj.bias": "transformer.h.{i}.attn.c_proj.bias",
    "blocks.{i}.ln2.weight": "transformer.h.{i}.ln_2.weight",
    "blocks.{i}.ln2.bias": "transformer.h.{i}.ln_2.bias",
    "blocks.{i}.ffn.fc.weight": "transformer.h.{i}.mlp.c_fc.weight",
    "blocks.{i}.ffn.fc.bias": "transformer.h.{i}.mlp.c_fc.bias",
    "blocks.{i}.ffn.proj.weight": "transformer.h.{i}.mlp.c_proj.weight",
    "blocks.{i}.ffn.proj.bias": "transformer.h.{i}.mlp.c_proj.bias",
}
GPT2_CONV1D = frozenset({"blocks.{i}.attn.qkv.weight", "blocks.{i}.attn.proj.weight",
                         "blocks.{i}.ffn.fc.weight", "blocks.{i}.ffn.proj.weight"})
# What GPT2Config holds of a GPTConfig; rope_theta is a rotary base, and learned positions
# rotate nothing.
GPT2_FIELDS = FamilyFields(
    "GPT-2", dict(position="learned", norm="layernorm", pre_ln=True, bias=True),
    frozenset({"vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout",
               "activation", "norm_eps", "tie_weights"}),
    inert=frozenset({"rope_theta"}))


# --- GPT-2 -----------------------------------------------------------------------------------


def gpt2_config_from_hf(hf_config: Any, dropout: float | None = None) -> GPTConfig:
    """The GPTConfig of a model that computes what a GPT-2 config describes."""
    _reject_unmirrored_gpt2_settings(hf_config)
    activation = hf_config.activation_function
    if activation not in ACTIVATION_FROM_HF:
        raise ConfigError(f"activation_function={activation!r} has no glassgpt equivalent; "
                          f"supported: {sorted(ACTIVATION_FROM_HF)}")
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        block_size=hf_config.n_positions,
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        n_embd=hf_config.n_embd,
        dropout=_single_dropout(hf_config) if dropout is None else dropout,
        bias=True,
        activation=ACTIVATION_FROM_HF[activation],
        pre_ln=True,
        tie_weights=bool(getattr(hf_config, "tie_word_embeddings", True)),
        norm_eps=float(hf_config.layer_norm_epsilon),
    )


def _reject_unmirrored_gpt2_settings(hf_config: Any) -> None:
    """ConfigError for HF GPT-2 options that change the computation in a way glassgpt cannot."""
    C = hf_config.n_embd
    n_inner = getattr(hf_config, "n_inner", None)
    if n_inner is not None and n_inner != 4 * C:
        raise ConfigError(f"n_inner={n_inner} is not supported: glassgpt's GELU MLP is "
                          f"4 x n_embd = {4 * C} wide")
    if not getattr(hf_config, "scale_attn_weights", True):
        raise ConfigError("scale_attn_weights=False is not supported: glassgpt always scales "
                          "attention scores by 1/sqrt(head_dim)")
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
        raise ConfigError("scale_attn_by_inverse_layer_idx=True is not supported: glassgpt "
                          "scales every layer's attention alike")
    if getattr(hf_config, "add_cross_attention", False):
        raise ConfigError("add_cross_attention=True is not supported: glassgpt is decoder-only")
    # reorder_and_upcast_attn is accepted: it changes rounding under mixed precision, not the math.


def _single_dropout(hf_config: Any) -> float:
    return one_dropout_rate({name: float(getattr(hf_config, name)) for name in
                             ("embd_pdrop", "resid_pdrop", "attn_pdrop")})


def gpt2_settings(config: GPTConfig) -> dict[str, Any]:
    """GPT2Config's settings for `config`; a ConfigError names any switch GPT-2 lacks."""
    if config.norm != "layernorm":
        raise ConfigError(f"norm={config.norm!r} with learned positions cannot be exported: "
                          f"GPT-2 uses LayerNorm, and Llama/Qwen3 (RMSNorm) rotary positions")
    if not config.pre_ln:
        raise ConfigError("pre_ln=False (Post-LN) cannot be exported: GPT-2 normalises before "
                          "attention and MLP (Pre-LN)")
    if not config.bias:
        raise ConfigError("bias=False cannot be exported: GPT-2 has biases in every linear "
                          "layer and LayerNorm")
    if config.activation not in ACTIVATION_TO_HF:
        raise ConfigError(f"activation={config.activation!r} cannot be exported as GPT-2, "
                          f"which supports {sorted(ACTIVATION_TO_HF)}")
    GPT2_FIELDS.refuse_unwritten(config)
    return dict(
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_inner=None,  # 4 * n_embd, like ours
        activation_function=ACTIVATION_TO_HF[config.activation],
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=config.norm_eps,
        tie_word_embeddings=config.tie_weights,
    )


# --- Llama, Qwen3, Qwen2 and SmolLM3 ----------------------------------------------------------


def llama_config_from_hf(hf_config: Any, dropout: float | None = None) -> GPTConfig:
    """The GPTConfig of a model that computes what a Llama, Qwen3, Qwen2 or SmolLM3 config
    describes."""
    model_type = hf_config.model_type
    setting = reader(hf_config, model_type)
    act = setting("hidden_act")
    if act not in SILU_NAMES:
        raise ConfigError(f"hidden_act={act!r} is not supported: glassgpt's SwiGLU gates with "
                          f"silu")
    _reject_windows(setting)
    n_layer = setting("num_hidden_layers")
    return GPTConfig(
        **decoder_fields(setting, dropout),
        **_biases(setting, model_type),
        activation="swiglu",
        **rotary_from_hf(hf_config, setting),
        nope_layers=_nope_layers(setting, n_layer) if model_type == "smollm3" else None,
        qk_norm=model_type == "qwen3",
    )


def _nope_layers(setting: Callable[[str], Any], n_layer: Any) -> tuple[int, ...] | None:
    """SmolLM3's layers without rotary: its `no_rope_layers` holds 1 where a layer rotates and 0
    where it does not (made from `no_rope_layer_interval` when left out, as transformers does)."""
    flags = setting("no_rope_layers")
    if not isinstance(n_layer, int):
        return None  # GPTConfig names the bad n_layer
    if flags is None:
        interval = setting("no_rope_layer_interval")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ConfigError(f"no_rope_layer_interval must be a positive integer, got "
                              f"{interval!r:.40}")
        flags = [int((i + 1) % interval != 0) for i in range(n_layer)]
    if len(flags) < n_layer or any(flag not in (0, 1) or isinstance(flag, float)
                                   for flag in flags[:n_layer]):
        raise ConfigError(f"no_rope_layers must hold a 0 or 1 for each of the {n_layer} layers, "
                          f"got {flags!r:.80}")
    return tuple(i for i, flag in enumerate(flags[:n_layer]) if not flag) or None


def _reject_windows(setting: Callable[[str], Any]) -> None:
    """Sliding-window attention (Qwen's and SmolLM3's option) sees only recent keys; glassgpt
    sees all."""
    if setting("use_sliding_window"):
        raise ConfigError("use_sliding_window=True is not supported: glassgpt's attention "
                          "sees every earlier position")
    layer_types = setting("layer_types")
    if layer_types is not None:
        other = sorted({str(kind) for kind in layer_types} - {"full_attention"})
        if other:
            raise ConfigError(f"layer_types holds {other}: glassgpt has full attention in "
                              f"every layer only")


def _biases(setting: Callable[[str], Any], model_type: str) -> dict[str, bool]:
    """GPTConfig's `bias` (every projection) and `qkv_bias` (q, k, v alone) of the family.

    Qwen2 has biases on q, k and v and nowhere else. Llama and SmolLM3 put `attention_bias` on
    q, k, v and o and `mlp_bias` on the MLP; Qwen3 has no MLP bias. glassgpt's `bias` covers o
    and the MLP together, so those two must agree."""
    if model_type == "qwen2":
        return {"bias": False, "qkv_bias": True}
    attention = bool(setting("attention_bias"))
    mlp = bool(setting("mlp_bias")) if model_type != "qwen3" else False  # Qwen3's MLP has none
    if attention != mlp:
        raise ConfigError(f"attention_bias={attention} with mlp_bias={mlp} is not supported: "
                          f"glassgpt's bias is one switch for the output projection and the MLP")
    return {"bias": attention}


# What the Llama family's configs hold of a GPTConfig: its block, and each member's own switch.
LLAMA_BLOCK = dict(position="rope", norm="rmsnorm", activation="swiglu", pre_ln=True)
LLAMA_WRITTEN = DECODER_WRITTEN | ROTARY_WRITTEN | {"bias"}
OTHER_EXPORTS = ("; GPT-2 (learned positions, LayerNorm, a plain MLP) and GPT-NeoX (rotary, "
                 "LayerNorm, a plain MLP) are the others glassgpt exports")
LLAMA_FIELDS = FamilyFields("Llama", LLAMA_BLOCK, LLAMA_WRITTEN, hint=OTHER_EXPORTS)
QWEN3_FIELDS = FamilyFields("Qwen3", {**LLAMA_BLOCK, "qk_norm": True}, LLAMA_WRITTEN,
                            hint=OTHER_EXPORTS)
QWEN2_FIELDS = FamilyFields("Qwen2", {**LLAMA_BLOCK, "bias": False, "qkv_bias": True},
                            LLAMA_WRITTEN, hint=OTHER_EXPORTS)
SMOLLM3_FIELDS = FamilyFields("SmolLM3", LLAMA_BLOCK, LLAMA_WRITTEN | {"nope_layers"},
                              hint=OTHER_EXPORTS)


def llama_settings(config: GPTConfig) -> dict[str, Any]:
    """LlamaConfig's settings for `config`; a ConfigError names any switch Llama lacks."""
    _check_llama_family(config, LLAMA_FIELDS)
    return {**_llama_family_settings(config), "mlp_bias": config.bias}


def qwen3_settings(config: GPTConfig) -> dict[str, Any]:
    """Qwen3Config's settings for `config`; a ConfigError names any switch Qwen3 lacks."""
    _check_llama_family(config, QWEN3_FIELDS)
    if config.bias:
        raise ConfigError("bias=True with qk_norm cannot be exported: Qwen3 has biases in "
                          "attention only, never in its MLP")
    return {**_llama_family_settings(config), "use_sliding_window": False,
            "layer_types": ["full_attention"] * config.n_layer}


def qwen2_settings(config: GPTConfig) -> dict[str, Any]:
    """Qwen2Config's settings for `config`: biases on q, k and v, none elsewhere."""
    _check_llama_family(config, QWEN2_FIELDS)  # its block: biases on q, k and v alone
    settings = _llama_family_settings(config)
    del settings["attention_bias"]  # Qwen2's q, k, v biases are not a setting
    return {**settings, "use_sliding_window": False,
            "layer_types": ["full_attention"] * config.n_layer}


def smollm3_settings(config: GPTConfig) -> dict[str, Any]:
    """SmolLM3Config's settings for `config`: Llama with layers that skip rotary (NoPE)."""
    _check_llama_family(config, SMOLLM3_FIELDS)
    nope = set(config.nope_layers or ())
    return {**_llama_family_settings(config), "mlp_bias": config.bias,
            "no_rope_layers": [int(i not in nope) for i in range(config.n_layer)],
            "use_sliding_window": False, "layer_types": ["full_attention"] * config.n_layer}


def _check_llama_family(config: GPTConfig, family: FamilyFields) -> None:
    family.check_block(config)
    if family is not QWEN2_FIELDS and config.has_qkv_bias != config.bias:
        raise ConfigError(f"qkv_bias={config.qkv_bias} beside bias={config.bias} cannot be "
                          f"exported as {family.title}: biases on q, k and v alone are Qwen2's")
    family.refuse_unwritten(config)


def _llama_family_settings(config: GPTConfig) -> dict[str, Any]:
    return {**decoder_settings(config), "hidden_act": "silu", "attention_bias": config.bias}


# --- GGUF: llama.cpp's names and settings of GPT-2 and the Llama family ----------------------

# The rows of every block llama.cpp names alike, and the output's (GPT-2 adds its position table
# after the embedding; a tied head has no `output` of its own: llama.cpp reads token_embd).
GGUF_BLOCK_START = [("ln1", "attn_norm"), ("ln2", "ffn_norm"), ("attn.proj", "attn_output"),
                    ("ffn.proj", "ffn_down")]
GGUF_OUTPUT_NAMES = {"ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias",
                     "lm_head.weight": "output.weight"}
# GPT-2: our `qkv` goes whole (attn_qkv), its MLP's first matrix is ffn_up.
GPT2_GGUF = GGUFArchitecture(
    "gpt2",
    {"tok_emb.weight": "token_embd.weight", "pos_emb.weight": "position_embd.weight",
     **gguf_block_names([*GGUF_BLOCK_START, ("attn.qkv", "attn_qkv"), ("ffn.fc", "ffn_up")]),
     **GGUF_OUTPUT_NAMES},
    (GGUFSetting("{arch}.attention.layer_norm_epsilon", "float32", lambda c: c.norm_eps),),
    (GGUFLimit("activation", lambda c: c.activation == "gelu_tanh",
               "llama.cpp's GPT-2 computes GPT-2's tanh GELU (gelu_tanh) only"),))
# The Llama family: q, k and v as three tensors, SwiGLU's gate and up, QK-norm's weights.
LLAMA_GGUF_NAMES: dict[str, str | tuple[str, ...]] = {
    "tok_emb.weight": "token_embd.weight",
    **gguf_block_names([*GGUF_BLOCK_START, ("ffn.gate", "ffn_gate"), ("ffn.up", "ffn_up"),
                        ("attn.q_norm", "attn_q_norm"), ("attn.k_norm", "attn_k_norm")]),
    **{f"blocks.{{i}}.attn.qkv.{kind}": tuple(f"blk.{{i}}.attn_{p}.{kind}" for p in "qkv")
       for kind in ("weight", "bias")},
    **GGUF_OUTPUT_NAMES,
}


def _own_head_width(config: GPTConfig) -> int | None:
    """head_dim where the heads have a width of their own (Qwen3's), else None: not written."""
    return config.head_dim if config.q_width != config.n_embd else None


def _linear(value: Callable[[GPTConfig], Any]) -> Callable[[GPTConfig], Any]:
    """`value` of a config with linear rotary scaling, None (not written) for any other."""
    return lambda config: value(config) if config.rope_scaling == "linear" else None


LLAMA_GGUF_SETTINGS = (
    GGUFSetting("{arch}.attention.layer_norm_rms_epsilon", "float32", lambda c: c.norm_eps),
    GGUFSetting("{arch}.attention.key_length", "uint32", _own_head_width),
    GGUFSetting("{arch}.attention.value_length", "uint32", _own_head_width),
    GGUFSetting("{arch}.rope.dimension_count", "uint32", lambda c: c.head_dim),
    GGUFSetting("{arch}.rope.freq_base", "float32", lambda c: c.rope_theta),
    GGUFSetting("{arch}.rope.scaling.type", "string", _linear(lambda c: "linear")),
    GGUFSetting("{arch}.rope.scaling.factor", "float32", _linear(lambda c: c.rope_factor)),
)
# llama.cpp's `llama` rotates adjacent pairs (its NORM rotary) and reads Llama 3's factors;
# `qwen2` and `qwen3` rotate halves (NEOX), as glassgpt does.
LLAMA_GGUF = GGUFArchitecture("llama", LLAMA_GGUF_NAMES, LLAMA_GGUF_SETTINGS,
                              adjacent_pairs=True, rope_factors=True)
QWEN3_GGUF = GGUFArchitecture("qwen3", LLAMA_GGUF_NAMES, LLAMA_GGUF_SETTINGS)
QWEN2_GGUF = GGUFArchitecture(
    "qwen2", LLAMA_GGUF_NAMES, LLAMA_GGUF_SETTINGS,
    (GGUFLimit("head_dim", lambda c: c.q_width == c.n_embd,
               "llama.cpp's Qwen2 needs n_head * head_dim = n_embd ({config.n_embd})"),))


# --- the table ---------------------------------------------------------------------------------

GPT2 = Architecture("gpt2", "GPT-2", "GPT2LMHeadModel", "GPT2Config", "transformer.",
                    GPT2_NAMES, GPT2_CONV1D, MASK_BUFFER_SUFFIXES, gpt2_config_from_hf,
                    gpt2_settings, gguf=GPT2_GGUF)
LLAMA = Architecture("llama", "Llama", "LlamaForCausalLM", "LlamaConfig", "model.", LLAMA_NAMES,
                     frozenset(), ROTARY_BUFFER_SUFFIXES, llama_config_from_hf, llama_settings,
                     PLAIN_ROTARY, gguf=LLAMA_GGUF)
QWEN3 = Architecture("qwen3", "Qwen3", "Qwen3ForCausalLM", "Qwen3Config", "model.", LLAMA_NAMES,
                     frozenset(), ROTARY_BUFFER_SUFFIXES, llama_config_from_hf, qwen3_settings,
                     PLAIN_ROTARY, gguf=QWEN3_GGUF)
QWEN2 = Architecture("qwen2", "Qwen2", "Qwen2ForCausalLM", "Qwen2Config", "model.", LLAMA_NAMES,
                     frozenset(), ROTARY_BUFFER_SUFFIXES, llama_config_from_hf, qwen2_settings,
                     PLAIN_ROTARY, gguf=QWEN2_GGUF)
SMOLLM3 = Architecture("smollm3", "SmolLM3", "SmolLM3ForCausalLM", "SmolLM3Config", "model.",
                       LLAMA_NAMES, frozenset(), ROTARY_BUFFER_SUFFIXES, llama_config_from_hf,
                       smollm3_settings, PLAIN_ROTARY)
ARCHITECTURES = {arch.model_type: arch for arch in (GPT2, LLAMA, QWEN3, QWEN2, SMOLLM3, GEMMA3,
                                                    GEMMA2, GPT_NEOX)}


def architecture_of(model_type: Any) -> Architecture:
    """The architecture of a HF config's model_type, or a ConfigError naming it."""
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"only {IMPORTABLE} models can be imported, this one has "
                          f"model_type={model_type!r}")
    return ARCHITECTURES[model_type]


def architecture_for(config: GPTConfig) -> Architecture:
    """The HF architecture that computes what `config` does (`family_choice`'s)."""
    return family_choice(config)[0]


def refuse_what_no_family_has(config: GPTConfig) -> None:
    """ConfigError for a switch no Hugging Face family computes, whichever family the rest of
    the config would choose."""
    if config.position == "shortformer":
        raise ConfigError("position='shortformer' cannot be exported: no Hugging Face family "
                          "adds positions to the queries and keys alone")
    if config.norm == "none":
        raise ConfigError("norm='none' cannot be exported: every Hugging Face family "
                          "glassgpt exports has norms")


def family_choice(config: GPTConfig) -> tuple[Architecture, str]:
    """The HF architecture that computes what `config` does, and the switches that chose it:
    GPT-2 for learned positions; Gemma's block (its post-norms,
    1 + w norms or scaled embeddings) is Gemma 3 with QK-norm, Gemma 2 without; other rotary
    ones are GPT-NeoX with LayerNorm and a plain (ungated) MLP, else Qwen3 with QK-norm, SmolLM3
    with NoPE layers, Qwen2 with biases on q, k and v alone, Llama otherwise. Whether it can
    hold every other switch is its settings' check, whose refusal names the switches that chose
    it: the one a user changed may have moved the config to another family. No family has
    shortformer positions or a model without norms (ARENA's model): those are refused first,
    by name."""
    refuse_what_no_family_has(config)
    if config.position == "learned":
        return GPT2, "position='learned'"
    gemma = [f"{name}=True" for name in ("post_norms", "norm_offset", "embed_scale")
             if getattr(config, name)]
    if gemma:
        if config.qk_norm:
            return GEMMA3, " and ".join([*gemma, "qk_norm=True"])
        return GEMMA2, " and ".join(gemma)
    norm_and_mlp = f"norm={config.norm!r} and activation={config.activation!r}"
    if config.norm == "layernorm" and config.activation not in GATED_ACTIVATIONS:
        return GPT_NEOX, norm_and_mlp
    if config.qk_norm:
        return QWEN3, "qk_norm=True"
    if config.nope_layers:
        return SMOLLM3, f"nope_layers={config.nope_layers}"
    if config.has_qkv_bias and not config.bias:
        return QWEN2, f"qkv_bias={config.qkv_bias} beside bias=False"
    return LLAMA, norm_and_mlp
