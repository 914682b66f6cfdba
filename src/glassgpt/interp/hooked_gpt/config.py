"""A glassgpt model's settings under TransformerLens's names: `LensConfig`, the `cfg` of a
HookedGPT (`model.cfg.n_layers`, `model.cfg.d_head`, ...).

It is read from the GPTConfig once, when the HookedGPT is built, and describes; nothing reads
it back (the glass model's own config decides how it computes). Where glassgpt has a choice
TransformerLens has no name for, the glassgpt name is kept: `act_fn="relu2"`,
`positional_embedding_type="none"` (no positions, NoPE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from glassgpt.config import GPTConfig

# glassgpt's activation -> TransformerLens's act_fn (the gated ones are gated_mlp=True)
ACT_FNS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "relu2": "relu2",
           "swiglu": "silu", "geglu": "gelu_pytorch_tanh"}
NORMALIZATION_TYPES = {"layernorm": "LN", "rmsnorm": "RMS", "none": None}
# after fold_layer_norm the norms keep only their statistics: TransformerLens's "...Pre"
FOLDED_TYPES = {"LN": "LNPre", "RMS": "RMSPre"}
POSITION_TYPES = {"learned": "standard", "rope": "rotary", "shortformer": "shortformer",
                  "none": "none"}


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
