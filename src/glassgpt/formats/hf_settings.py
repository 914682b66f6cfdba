"""What each Hugging Face architecture's config.json may say, and how a config.json is read:
each key with transformers' default for a config that leaves it out and the type transformers
gives it, checked before anything is built (a size is an integer, not the string "32"; a flag is
true or false; a float is a number). Ranges are GPTConfig's to check; which settings glassgpt
can compute is each family's translation (glassgpt.formats.architectures).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from glassgpt.errors import ConfigError

# What each architecture's config.json may say: key -> (default, kind). The defaults are those
# of transformers' config classes, for keys a config.json leaves out; "int?" is an integer or
# null, "float?" a number or null, "bool?" true, false or null, "table?" a JSON object or null,
# "list?" a list or null.
_ROPE_SETTINGS: dict[str, tuple[Any, str]] = {
    "rope_theta": (10000.0, "float"), "rope_scaling": (None, "table?"),
    "rope_parameters": (None, "table?"), "partial_rotary_factor": (1.0, "float")}
HF_SETTINGS: dict[str, dict[str, tuple[Any, str]]] = {
    "gpt2": {
        "vocab_size": (50257, "int"), "n_positions": (1024, "int"), "n_embd": (768, "int"),
        "n_layer": (12, "int"), "n_head": (12, "int"), "n_inner": (None, "int?"),
        "activation_function": ("gelu_new", "str"), "resid_pdrop": (0.1, "float"),
        "embd_pdrop": (0.1, "float"), "attn_pdrop": (0.1, "float"),
        "layer_norm_epsilon": (1e-5, "float"), "scale_attn_weights": (True, "bool"),
        "scale_attn_by_inverse_layer_idx": (False, "bool"),
        "add_cross_attention": (False, "bool"), "tie_word_embeddings": (True, "bool")},
    "llama": {
        "vocab_size": (32000, "int"), "hidden_size": (4096, "int"),
        "intermediate_size": (11008, "int"), "num_hidden_layers": (32, "int"),
        "num_attention_heads": (32, "int"), "num_key_value_heads": (None, "int?"),
        "head_dim": (None, "int?"), "hidden_act": ("silu", "str"),
        "max_position_embeddings": (2048, "int"), "rms_norm_eps": (1e-6, "float"),
        "tie_word_embeddings": (False, "bool"), "attention_bias": (False, "bool"),
        "mlp_bias": (False, "bool"), "attention_dropout": (0.0, "float"),
        "layer_types": (None, "list?"), **_ROPE_SETTINGS},
    "qwen3": {
        "vocab_size": (151936, "int"), "hidden_size": (4096, "int"),
        "intermediate_size": (22016, "int"), "num_hidden_layers": (32, "int"),
        "num_attention_heads": (32, "int"), "num_key_value_heads": (32, "int?"),
        "head_dim": (128, "int?"), "hidden_act": ("silu", "str"),
        "max_position_embeddings": (32768, "int"), "rms_norm_eps": (1e-6, "float"),
        "tie_word_embeddings": (False, "bool"), "attention_bias": (False, "bool"),
        "attention_dropout": (0.0, "float"), "use_sliding_window": (False, "bool"),
        "layer_types": (None, "list?"),
        **_ROPE_SETTINGS},
    "qwen2": {  # no head_dim (hidden_size / heads) and no bias settings: q, k, v have biases
        "vocab_size": (151936, "int"), "hidden_size": (4096, "int"),
        "intermediate_size": (22016, "int"), "num_hidden_layers": (32, "int"),
        "num_attention_heads": (32, "int"), "num_key_value_heads": (32, "int?"),
        "head_dim": (None, "int?"), "hidden_act": ("silu", "str"),
        "max_position_embeddings": (32768, "int"), "rms_norm_eps": (1e-6, "float"),
        "tie_word_embeddings": (False, "bool"), "attention_dropout": (0.0, "float"),
        "use_sliding_window": (False, "bool"), "layer_types": (None, "list?"),
        **_ROPE_SETTINGS},
    "smollm3": {
        "vocab_size": (128256, "int"), "hidden_size": (2048, "int"),
        "intermediate_size": (11008, "int"), "num_hidden_layers": (36, "int"),
        "num_attention_heads": (16, "int"), "num_key_value_heads": (4, "int?"),
        "head_dim": (None, "int?"), "hidden_act": ("silu", "str"),
        "max_position_embeddings": (32768, "int"), "rms_norm_eps": (1e-6, "float"),
        "tie_word_embeddings": (True, "bool"), "attention_bias": (False, "bool"),
        "mlp_bias": (False, "bool"), "attention_dropout": (0.0, "float"),
        "use_sliding_window": (False, "bool"), "layer_types": (None, "list?"),
        "no_rope_layers": (None, "list?"), "no_rope_layer_interval": (4, "int"),
        **_ROPE_SETTINGS, "rope_theta": (2000000.0, "float")},  # SmolLM3's own base
    "gemma3_text": {  # rope_parameters per layer type, or transformers 4's three keys
        "vocab_size": (262208, "int"), "hidden_size": (2304, "int"),
        "intermediate_size": (9216, "int"), "num_hidden_layers": (26, "int"),
        "num_attention_heads": (8, "int"), "num_key_value_heads": (4, "int?"),
        "head_dim": (256, "int"), "hidden_activation": ("gelu_pytorch_tanh", "str"),
        "max_position_embeddings": (131072, "int"), "rms_norm_eps": (1e-6, "float"),
        "tie_word_embeddings": (True, "bool"), "attention_bias": (False, "bool"),
        "attention_dropout": (0.0, "float"), "query_pre_attn_scalar": (256, "float"),
        "sliding_window": (4096, "int?"), "layer_types": (None, "list?"),
        "sliding_window_pattern": (6, "int"), "final_logit_softcapping": (None, "float?"),
        "attn_logit_softcapping": (None, "float?"),
        "use_bidirectional_attention": (False, "bool?"),
        "rope_parameters": (None, "table?"), "rope_scaling": (None, "table?"),
        "rope_theta": (1000000.0, "float"), "rope_local_base_freq": (10000.0, "float")},
    "gemma2": {  # one rotary for every layer; both soft-caps on by default
        "vocab_size": (256000, "int"), "hidden_size": (2304, "int"),
        "intermediate_size": (9216, "int"), "num_hidden_layers": (26, "int"),
        "num_attention_heads": (8, "int"), "num_key_value_heads": (4, "int?"),
        "head_dim": (256, "int"), "hidden_activation": ("gelu_pytorch_tanh", "str"),
        "max_position_embeddings": (8192, "int"), "rms_norm_eps": (1e-6, "float"),
        "tie_word_embeddings": (True, "bool"), "attention_bias": (False, "bool"),
        "attention_dropout": (0.0, "float"), "query_pre_attn_scalar": (256, "float"),
        "sliding_window": (4096, "int?"), "layer_types": (None, "list?"),
        "final_logit_softcapping": (30.0, "float?"), "attn_logit_softcapping": (50.0, "float?"),
        "use_bidirectional_attention": (None, "bool?"), **_ROPE_SETTINGS},
    # transformers 4 named the rotary base and the fraction of each head rotated its own way
    # (5 moves both into rope_parameters); head_dim only sizes the rotary, if a config has one
    "gpt_neox": {
        "vocab_size": (50432, "int"), "hidden_size": (6144, "int"),
        "intermediate_size": (24576, "int"), "num_hidden_layers": (44, "int"),
        "num_attention_heads": (64, "int"), "head_dim": (None, "int?"),
        "hidden_act": ("gelu", "str"), "max_position_embeddings": (2048, "int"),
        "layer_norm_eps": (1e-5, "float"), "tie_word_embeddings": (False, "bool"),
        "use_parallel_residual": (True, "bool"), "attention_bias": (True, "bool"),
        "attention_dropout": (0.0, "float"), "hidden_dropout": (0.0, "float"),
        "rope_parameters": (None, "table?"), "rope_scaling": (None, "table?"),
        "rotary_emb_base": (10000.0, "float"), "rotary_pct": (0.25, "float")},
}
# Other names GPT2Config accepts for its settings.
HF_ALIASES = {"gpt2": {"hidden_size": "n_embd", "num_attention_heads": "n_head",
                       "num_hidden_layers": "n_layer", "max_position_embeddings": "n_positions"}}


def checked_settings(raw: dict[str, Any], path: Path) -> SimpleNamespace:
    """A config.json's settings (`raw`, read from `path`), type-checked, with its
    architecture's defaults for what it leaves out. A model_type glassgpt does not know comes
    back alone (interop names it); a config.json without one is GPT-2's, as GPT2Config reads
    it."""
    model_type = raw.get("model_type", "gpt2")
    _check_setting("model_type", model_type, "str", path)
    if model_type not in HF_SETTINGS:
        return SimpleNamespace(model_type=model_type)
    _apply_aliases(raw, HF_ALIASES.get(model_type, {}), path)
    settings = {"model_type": model_type}
    for key, (default, kind) in HF_SETTINGS[model_type].items():
        settings[key] = raw.get(key, default)
        _check_setting(key, settings[key], kind, path)
    return SimpleNamespace(**settings)


def _apply_aliases(raw: dict[str, Any], aliases: dict[str, str], path: Path) -> None:
    """Read each alias as its setting (GPT2Config's hidden_size is n_embd); both given with
    different values is a contradiction, refused rather than settled by a guess."""
    for alias, key in aliases.items():
        if alias not in raw:
            continue
        if key in raw and raw[key] != raw[alias]:
            raise ConfigError(f"{path}: {key}={raw[key]!r:.40} and its other name "
                              f"{alias}={raw[alias]!r:.40} disagree; keep one of them")
        raw[key] = raw[alias]


_KIND_NAMES = {"int": "an integer", "int?": "an integer or null", "float": "a number",
               "float?": "a number or null", "bool": "true or false",
               "bool?": "true, false or null", "str": "a string",
               "table?": "a JSON object or null", "list?": "a list or null"}


def _check_setting(key: str, value: Any, kind: str, path: Path) -> None:
    """One config.json value has the type transformers gives it (a size is not "32", a flag is
    not 1, a float is a number); ranges are GPTConfig's to check."""
    if value is None and kind.endswith("?"):
        return
    ok = {"int": is_int, "bool": lambda v: isinstance(v, bool), "float": is_number,
          "str": lambda v: isinstance(v, str), "table": lambda v: isinstance(v, dict),
          "list": lambda v: isinstance(v, list)}[kind.removesuffix("?")](value)
    if not ok:
        raise ConfigError(f"{path}: {key} must be {_KIND_NAMES[kind]}, got {value!r:.40}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return is_int(value) or isinstance(value, float)
