"""TransformerLens's config, both ways: a glassgpt model's settings under HookedTransformerConfig's
names. `LensConfig` is the `cfg` of a HookedGPT (`model.cfg.n_layers`, `model.cfg.d_head`, ...),
`lens_config_dict` the fields a checkpoint's config.json holds, and `gpt_config_from_lens` the
way back, a HookedTransformerConfig's fields read as GPTConfig settings.

`lens_config` reads the GPTConfig once, when the HookedGPT is built, and describes; nothing
reads it back (the glass model's own config decides how it computes). Where glassgpt has a
choice TransformerLens has no name for, the glassgpt name is kept: `act_fn="relu2"`,
`positional_embedding_type="none"` (no positions, NoPE). What TransformerLens's checkpoint
cannot hold is refused by name (`check_exportable`), and so is a field glassgpt cannot
compute (`gpt_config_from_lens`). The weights themselves are glassgpt.formats.transformer_lens's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.model import GPT

# glassgpt's activation -> TransformerLens's act_fn (the gated ones are gated_mlp=True)
ACT_FNS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "relu2": "relu2",
           "swiglu": "silu", "geglu": "gelu_pytorch_tanh"}
NORMALIZATION_TYPES = {"layernorm": "LN", "rmsnorm": "RMS", "none": None}
# after fold_layer_norm the norms keep only their statistics: TransformerLens's "...Pre"
FOLDED_TYPES = {"LN": "LNPre", "RMS": "RMSPre"}
POSITION_TYPES = {"learned": "standard", "rope": "rotary", "shortformer": "shortformer",
                  "none": "none"}
# GPTConfig field -> (what it is, whether its value is one TransformerLens has no field for)
UNEXPORTABLE = {"pre_ln": ("Post-LN blocks; HookedTransformer's are Pre-LN", lambda v: not v),
                "post_norms": ("Gemma's norms after each sub-layer", bool),
                "norm_offset": ("Gemma's RMSNorm gain 1 + w", bool),
                "embed_scale": ("Gemma's token embeddings times sqrt(n_embd)", bool),
                "sliding_window": ("local attention layers", bool),
                "qk_norm": ("RMSNorm on queries and keys", bool),
                "rope_scaling": ("scaled rotary positions", bool),
                "nope_layers": ("layers without rotary positions", bool),
                "position": ("no positions, NoPE", lambda v: v == "none"),
                "activation": ("ReLU squared", lambda v: v == "relu2")}


@dataclass
class LensConfig:
    """TransformerLens's config fields, as a HookedGPT's model has them."""

    n_layers: int
    n_heads: int
    d_head: int
    d_model: int
    d_mlp: int | None  # None: attn_only
    d_vocab: int
    d_vocab_out: int
    n_ctx: int
    n_key_value_heads: int | None  # None unless the heads are grouped (as TransformerLens)
    act_fn: str | None
    gated_mlp: bool
    normalization_type: str | None  # "LN", "RMS", None; "LNPre"/"RMSPre" once folded
    final_rms: bool
    eps: float
    positional_embedding_type: str  # "standard", "rotary", "shortformer" ("none": NoPE)
    rotary_dim: int | None
    rotary_base: float
    attn_only: bool
    use_attn_scale: bool
    attn_scale: float  # scores are q . k / attn_scale
    attn_scores_soft_cap: float  # -1.0: none (TransformerLens's convention)
    output_logits_soft_cap: float
    use_normalization_before_and_after: bool  # Gemma's post_norms
    use_qk_norm: bool
    window_size: int | None
    default_prepend_bos: bool
    tokenizer_prepends_bos: bool = False  # glassgpt's encode never adds BOS itself
    use_attn_result: bool = True  # every attention has hook_result
    use_split_qkv_input: bool = False
    use_hook_mlp_in: bool = True
    parallel_attn_mlp: bool = False
    attention_dir: str = "causal"
    model_name: str = "glassgpt"
    tokenizer_name: str | None = None
    original_architecture: str = "GPT"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    seed: int | None = None
    extra: dict = field(default_factory=dict)  # glassgpt's own GPTConfig, as a dict


def act_fn_of(config: GPTConfig) -> str | None:
    return None if config.attn_only else ACT_FNS.get(config.activation, config.activation)


def cap(value: float | None) -> float:
    return -1.0 if value is None else float(value)


def lens_config(model: nn.Module, default_prepend_bos: bool, model_name: str = "glassgpt",
                tokenizer_name: str | None = None) -> LensConfig:
    """The LensConfig of glassgpt GPT `model` (its config, device and dtype)."""
    config: GPTConfig = model.config
    weight = model.tok_emb.weight
    scalar = config.query_pre_attn_scalar
    return LensConfig(
        n_layers=config.n_layer, n_heads=config.n_head, d_head=config.head_dim,
        d_model=config.n_embd, d_mlp=None if config.attn_only else config.hidden_width,
        d_vocab=config.vocab_size, d_vocab_out=config.vocab_size, n_ctx=config.block_size,
        n_key_value_heads=config.n_kv_head if config.n_kv_head not in (None, config.n_head)
        else None,
        act_fn=act_fn_of(config), gated_mlp=config.activation in ("swiglu", "geglu"),
        normalization_type=NORMALIZATION_TYPES[config.norm], final_rms=config.norm == "rmsnorm",
        eps=config.norm_eps,
        positional_embedding_type=POSITION_TYPES[config.position],
        rotary_dim=config.head_dim if config.position == "rope" else None,
        rotary_base=config.rope_theta, attn_only=config.attn_only, use_attn_scale=True,
        attn_scale=math.sqrt(config.head_dim if scalar is None else scalar),
        attn_scores_soft_cap=cap(config.attn_softcap),
        output_logits_soft_cap=cap(config.logit_softcap),
        use_normalization_before_and_after=config.post_norms, use_qk_norm=config.qk_norm,
        window_size=config.sliding_window, default_prepend_bos=default_prepend_bos,
        model_name=model_name, tokenizer_name=tokenizer_name,
        original_architecture=type(model).__name__, device=str(weight.device),
        dtype=weight.dtype, extra=config.to_dict())


# --- a checkpoint's config.json ---------------------------------------------------------------

def check_exportable(config: GPTConfig) -> None:
    """ConfigError naming the first switch TransformerLens's checkpoint has no field for."""
    for name, (what, unholdable) in UNEXPORTABLE.items():
        value = getattr(config, name)
        if unholdable(value):
            raise ConfigError(f"{name}={value!r} ({what}) has no field in TransformerLens's "
                              f"HookedTransformer checkpoint; this model cannot be written in it")


def lens_config_dict(model: GPT, tokenizer_name: str | None = None,
                     model_name: str = "glassgpt") -> dict[str, Any]:
    """HookedTransformerConfig's fields for glassgpt `model` (JSON values; a field left at
    TransformerLens's default where glassgpt uses it is left out, so older versions read it)."""
    check_exportable(model.config)
    lens = lens_config(model, True, model_name, tokenizer_name)
    fields = {name: getattr(lens, name) for name in (
        "n_layers", "d_model", "n_ctx", "d_head", "n_heads", "d_mlp", "act_fn", "d_vocab",
        "d_vocab_out", "eps", "attn_only", "normalization_type", "positional_embedding_type",
        "original_architecture", "model_name", "tokenizer_name")}
    if lens.positional_embedding_type == "rotary":  # the whole head, in GPT-NeoX's halves
        fields.update(rotary_dim=lens.rotary_dim, rotary_base=lens.rotary_base,
                      rotary_adjacent_pairs=False)
    optional = {"n_key_value_heads": (lens.n_key_value_heads, None),
                "gated_mlp": (lens.gated_mlp, False), "final_rms": (lens.final_rms, False),
                "attn_scores_soft_cap": (lens.attn_scores_soft_cap, -1.0),
                "output_logits_soft_cap": (lens.output_logits_soft_cap, -1.0)}
    fields.update({name: value for name, (value, default) in optional.items()
                   if value != default})
    if model.config.query_pre_attn_scalar is not None:
        fields["attn_scale"] = lens.attn_scale  # TL divides the scores by it
    return fields


# --- the way back: a HookedTransformerConfig as a GPTConfig (TransformerLens checkpoints) -------

# (act_fn, gated_mlp) -> glassgpt's activation; TL's gelu_new and gelu_pytorch_tanh are one
# function (GELU's tanh form), its gated MLPs glassgpt's swiglu and geglu
LENS_ACTIVATIONS = {("gelu", False): "gelu", ("gelu_new", False): "gelu_tanh",
                    ("gelu_pytorch_tanh", False): "gelu_tanh", ("relu", False): "relu",
                    ("silu", True): "swiglu", ("swish", True): "swiglu",
                    ("gelu_new", True): "geglu", ("gelu_pytorch_tanh", True): "geglu"}
# normalization_type -> (glassgpt's norm, whether the checkpoint leaves its gains out: TL's
# parameter-free "Pre" norms are glassgpt's with unit gains and zero shifts)
LENS_NORMS = {"LN": ("layernorm", False), "LNPre": ("layernorm", True),
              "RMS": ("rmsnorm", False), "RMSPre": ("rmsnorm", True), None: ("none", False)}
LENS_POSITIONS = {value: key for key, value in POSITION_TYPES.items() if value != "none"}
# Fields that change what a HookedTransformer computes, at the one value glassgpt computes too.
SWITCHED_OFF = {"attention_dir": "causal", "use_local_attn": False, "parallel_attn_mlp": False,
                "scale_attn_by_inverse_layer_idx": False, "post_embedding_ln": False,
                "rotary_adjacent_pairs": False, "use_NTK_by_parts_rope": False,
                "use_normalization_before_and_after": False, "use_qk_norm": False,
                "num_experts": None, "load_in_4bit": False}
# Fields read into the GPTConfig (gpt_config_from_lens), and fields that change nothing it
# computes: names, initialisation, devices, which hook points exist, settings of switches off.
READ_FIELDS = frozenset({
    "n_layers", "d_model", "n_ctx", "d_head", "n_heads", "d_mlp", "act_fn", "d_vocab",
    "d_vocab_out", "eps", "attn_only", "normalization_type", "positional_embedding_type",
    "final_rms", "rotary_dim", "rotary_base", "gated_mlp", "n_key_value_heads", "use_attn_scale",
    "attn_scale", "attn_scores_soft_cap", "output_logits_soft_cap"})
INERT_FIELDS = frozenset({
    "model_name", "tokenizer_name", "original_architecture", "seed", "device", "n_devices",
    "dtype", "n_params", "init_mode", "initializer_range", "init_weights", "from_checkpoint",
    "checkpoint_index", "checkpoint_label_type", "checkpoint_value", "default_prepend_bos",
    "tokenizer_prepends_bos", "trust_remote_code", "tie_word_embeddings", "use_attn_result",
    "use_split_qkv_input", "use_hook_mlp_in", "use_attn_in", "use_hook_tokens",
    "ungroup_grouped_query_attention", "window_size", "attn_types", "experts_per_token",
    "relative_attention_max_distance", "relative_attention_num_buckets",
    "decoder_start_token_id", "NTK_by_parts_low_freq_factor", "NTK_by_parts_high_freq_factor",
    "NTK_by_parts_factor", "NTK_original_ctx_len", "architecture", "uses_rms_norm"})


def check_lens_fields(cfg: dict) -> None:
    """ConfigError naming a field glassgpt cannot compute: a switch at another value than
    SWITCHED_OFF's, or a field it does not know that is set (None or False: left off)."""
    attn_types = cfg.get("attn_types")  # TransformerLens bands a "local" layer by window_size
    if attn_types is not None and (not isinstance(attn_types, list)
                                   or any(kind != "global" for kind in attn_types)):
        raise ConfigError(f"attn_types={attn_types!r:.60} holds other than global layers (a "
                          f"local one sees only window_size keys), and glassgpt reads "
                          f"TransformerLens's checkpoints of global attention only")
    for name, value in cfg.items():
        if name in READ_FIELDS or name in INERT_FIELDS:
            continue
        if name in SWITCHED_OFF:
            if value != SWITCHED_OFF[name] and not (value is None and name != "attention_dir"):
                raise ConfigError(f"{name}={value!r} changes what the model computes, and "
                                  f"glassgpt computes only {name}={SWITCHED_OFF[name]!r}")
        elif value is not None and value is not False:
            raise ConfigError(f"unknown HookedTransformerConfig field {name}={value!r:.40}: "
                              f"glassgpt cannot tell what it changes, so it is refused")


def lens_number(cfg: dict, name: str) -> int:
    """cfg[name], a positive integer (d_vocab=-1, TL's "from the tokenizer", is refused)."""
    if name not in cfg:
        raise ConfigError(f"the TransformerLens config has no {name}; it is needed")
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"HookedTransformerConfig's {name} must be a positive integer, got "
                          f"{value!r:.40}")
    return value


def lens_activation(cfg: dict, attn_only: bool) -> str:
    if attn_only:
        return "gelu_tanh"  # no MLP: act_fn is not read (as TransformerLens)
    key = (cfg.get("act_fn"), bool(cfg.get("gated_mlp", False)))
    if key not in LENS_ACTIVATIONS:
        gated = " with gated_mlp=True" if key[1] else ""
        raise ConfigError(f"act_fn={key[0]!r:.30}{gated} has no glassgpt activation (glassgpt "
                          f"computes gelu, gelu_new, relu, and gated silu or gelu_pytorch_tanh)")
    return LENS_ACTIVATIONS[key]


def lens_norm(cfg: dict) -> tuple[str, bool]:
    kind = cfg.get("normalization_type", "LN")  # TransformerLens's default
    if kind not in LENS_NORMS:
        raise ConfigError(f"normalization_type={kind!r:.30} is not one glassgpt computes "
                          f"(LN, LNPre, RMS, RMSPre or None)")
    norm, unit = LENS_NORMS[kind]
    if cfg.get("final_rms") and norm != "rmsnorm":
        raise ConfigError(f"final_rms=True with normalization_type={kind!r}: glassgpt's final "
                          f"norm is the blocks' kind")
    return norm, unit


def lens_position(cfg: dict, d_head: int) -> str:
    kind = cfg.get("positional_embedding_type", "standard")
    if kind not in LENS_POSITIONS:
        raise ConfigError(f"positional_embedding_type={kind!r:.30} is not one glassgpt computes "
                          f"(standard, shortformer or rotary)")
    rotary_dim = cfg.get("rotary_dim")
    if kind == "rotary" and rotary_dim not in (None, d_head):
        raise ConfigError(f"rotary_dim={rotary_dim!r:.20} rotates part of each head; glassgpt "
                          f"rotates the whole head (d_head={d_head})")
    return LENS_POSITIONS[kind]


def lens_query_scalar(cfg: dict, d_head: int) -> float | None:
    """GPTConfig.query_pre_attn_scalar for TL's attn_scale (scores = q . k / attn_scale):
    None for sqrt(d_head), TransformerLens's default."""
    if not cfg.get("use_attn_scale", True):
        return 1.0  # unscaled scores
    scale = cfg.get("attn_scale", -1.0)
    if scale is None or float(scale) == -1.0 or float(scale) == math.sqrt(d_head):
        return None
    if not float(scale) > 0:
        raise ConfigError(f"attn_scale={scale!r:.20} must be positive (or -1: sqrt(d_head))")
    return float(scale) ** 2


def lens_float(cfg: dict, name: str, default: float) -> float:
    """cfg[name] (or `default` when absent) as a float; a string or None is refused by name."""
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"HookedTransformerConfig's {name} must be a number, got "
                          f"{value!r:.40}")
    return float(value)


def lens_cap(cfg: dict, name: str) -> float | None:
    value = cfg.get(name, -1.0)
    return None if value is None or float(value) <= 0 else float(value)


def gpt_config_from_lens(cfg: dict) -> tuple[dict, bool]:
    """The GPTConfig settings of a HookedTransformerConfig's fields (`cfg`, as a dict), all
    but the biases and the tie, which the weights decide; and whether its norms are the
    parameter-free "LNPre"/"RMSPre", whose gains the checkpoint leaves out."""
    if not isinstance(cfg, dict) or not all(isinstance(key, str) for key in cfg):
        raise ConfigError(f"a TransformerLens config is a dict of HookedTransformerConfig "
                          f"fields, got {type(cfg).__name__}")
    check_lens_fields(cfg)
    d_model, d_head = lens_number(cfg, "d_model"), lens_number(cfg, "d_head")
    n_heads = cfg.get("n_heads", -1)
    n_heads = d_model // d_head if n_heads in (-1, None) else lens_number(cfg, "n_heads")
    d_vocab = lens_number(cfg, "d_vocab")
    if cfg.get("d_vocab_out", -1) not in (-1, None, d_vocab):
        raise ConfigError(f"d_vocab_out={cfg['d_vocab_out']!r:.20} differs from d_vocab="
                          f"{d_vocab}; glassgpt's head scores the input vocabulary")
    attn_only = bool(cfg.get("attn_only", False))
    norm, unit_norms = lens_norm(cfg)
    d_mlp = None  # attn_only: no MLP; else TransformerLens's default 4 d_model when None
    if not attn_only:
        d_mlp = 4 * d_model if cfg.get("d_mlp") is None else lens_number(cfg, "d_mlp")
    settings = dict(
        vocab_size=d_vocab, block_size=lens_number(cfg, "n_ctx"),
        n_layer=lens_number(cfg, "n_layers"), n_head=n_heads, n_embd=d_model,
        head_dim=None if n_heads * d_head == d_model else d_head,
        activation=lens_activation(cfg, attn_only), attn_only=attn_only, mlp_hidden=d_mlp,
        n_kv_head=cfg.get("n_key_value_heads"), norm=norm,
        norm_eps=lens_float(cfg, "eps", 1e-5), position=lens_position(cfg, d_head),
        rope_theta=float(cfg.get("rotary_base", 10000)),
        query_pre_attn_scalar=lens_query_scalar(cfg, d_head),
        attn_softcap=lens_cap(cfg, "attn_scores_soft_cap"),
        logit_softcap=lens_cap(cfg, "output_logits_soft_cap"), dropout=0.0)
    return settings, unit_norms
