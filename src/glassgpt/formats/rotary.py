"""Rotary settings between a Hugging Face config and a GPTConfig: the base and the scaling.

transformers 5 keeps them in one table, `rope_parameters` ({"rope_type", "rope_theta",
"factor", ...}); checkpoints written by transformers 4 have `rope_theta` beside a
`rope_scaling` table (null when unscaled, and "type" where later ones say "rope_type"). Both
are read; the export is written the way the installed transformers takes it. The scalings
glassgpt computes (glassgpt.rotary) are the plain one ("default"), "linear" and "llama3"; any
other is refused by name, as is a key a table holds that glassgpt would not honour.

GPT-NeoX names them otherwise in transformers 4 (`rotary_emb_base`, and `rotary_pct`, the
fraction of each head rotated: a quarter unless a config says otherwise), and only a config
that rotates every feature is read.

Gemma 3 has a rotary per kind of layer: transformers 5 writes `rope_parameters` as one table
per layer type ({"full_attention": {...}, "sliding_attention": {...}}), transformers 4 wrote
`rope_theta` and `rope_scaling` for the global layers beside `rope_local_base_freq` for the
local ones. The global table may scale; the local layers rotate unscaled in glassgpt
(`rope_local_theta`), so a scaling there is refused by name.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from glassgpt.config import GPTConfig
from glassgpt.config_checks import ALL_ROPE_SCALING_SETTINGS, ROPE_SCALINGS
from glassgpt.errors import ConfigError

# HF's key in a rope table -> GPTConfig's field, for each scaling glassgpt computes.
SCALING_KEYS: dict[str, dict[str, str]] = {
    "default": {},
    "linear": {"factor": "rope_factor"},
    "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_context"},
}
PLAIN_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


def rotary_from_hf(hf_config: Any, setting: Callable[[str], Any]) -> dict[str, Any]:
    """GPTConfig's rotary fields (rope_theta, rope_scaling, rope_factor, ...) for a Llama-family
    config, read from `rope_parameters` or from `rope_theta` and `rope_scaling`. `setting(key)`
    reads the config with its family's defaults (the base where none is written)."""
    theta = setting("rope_theta")
    found: dict[str, Any] | None = None
    for key in ("rope_parameters", "rope_scaling"):
        table = getattr(hf_config, key, None)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{key} must be a JSON object or null, got {table!r:.40}")
        fields = _scaling_fields(key, table, setting)
        theta = table.get("rope_theta", theta)
        if found is not None and fields != found:
            raise ConfigError(f"rope_parameters and rope_scaling disagree ({found} and "
                              f"{fields}): which one transformers reads depends on its version")
        found = fields
    _check_partial(getattr(hf_config, "partial_rotary_factor", 1.0))
    return {"rope_theta": _base("rope_theta", theta), **(found or {})}


def _base(name: str, theta: Any) -> float:
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not math.isfinite(theta):
        raise ConfigError(f"{name} must be a finite number, got {theta!r:.40}")
    return float(theta)


def _scaling_fields(key: str, table: dict[str, Any],
                    setting: Callable[[str], Any]) -> dict[str, Any]:
    kind = table.get("rope_type", table.get("type", "default"))
    if kind not in SCALING_KEYS:
        raise ConfigError(f"{key} has rope_type={kind!r:.40}, which glassgpt does not compute "
                          f"(it computes the plain rotary and the scalings {list(ROPE_SCALINGS)})")
    names = SCALING_KEYS[kind]
    extra = sorted(set(table) - PLAIN_KEYS - set(names))
    if extra:
        raise ConfigError(f"{key}={table!r:.120} holds {extra}, which glassgpt's "
                          f"{kind!r} rotary does not take")
    _check_partial(table.get("partial_rotary_factor", 1.0))
    if kind == "default":
        return {}
    values = {"rope_scaling": kind}
    for theirs, ours in names.items():
        value = table.get(theirs)
        if value is None and theirs == "original_max_position_embeddings":
            value = setting("max_position_embeddings")  # transformers' fallback too
        if value is None:
            raise ConfigError(f"{key} of rope_type {kind!r} needs {theirs}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}'s {theirs} must be a number, got {value!r:.40}")
        values[ours] = value if ours == "rope_original_context" else float(value)
    return values


def _check_partial(partial: Any, name: str = "partial_rotary_factor") -> None:
    if partial != 1.0:
        raise ConfigError(f"{name}={partial!r:.40} is not supported: glassgpt rotates every "
                          f"feature of q and k")


def rotary_of(config: GPTConfig) -> dict[str, Any]:
    """The rotary fields of `config`, as `rotary_from_hf` gives them (to compare the two)."""
    fields = {"rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        fields["rope_scaling"] = config.rope_scaling
        fields.update({name: getattr(config, name) for name in ALL_ROPE_SCALING_SETTINGS
                       if getattr(config, name) is not None})
    return fields


def rope_kwargs(config_class: Any, config: GPTConfig) -> dict[str, Any]:
    """How the installed transformers takes `config`'s rotary: `rope_parameters` (5.x), or
    `rope_theta` and `rope_scaling` (4.x), told by the config class's own signature."""
    if _takes_rope_parameters(config_class):
        return {"rope_parameters": _rope_table(config)}
    return {"rope_theta": config.rope_theta, "rope_scaling": _scaling_table(config)}


def _takes_rope_parameters(config_class: Any) -> bool:
    return "rope_parameters" in inspect.signature(config_class.__init__).parameters


def _scaling_table(config: GPTConfig) -> dict[str, Any] | None:
    """transformers 4's `rope_scaling` of `config`: its kind and settings, None unscaled."""
    if config.rope_scaling is None:
        return None
    names = SCALING_KEYS[config.rope_scaling]
    return {"rope_type": config.rope_scaling,
            **{theirs: getattr(config, ours) for theirs, ours in names.items()}}


def _rope_table(config: GPTConfig) -> dict[str, Any]:
    """transformers 5's `rope_parameters` of `config`'s (global) rotary."""
    scaling = _scaling_table(config) or {"rope_type": "default"}
    return {**scaling, "rope_theta": config.rope_theta}


# --- GPT-NeoX: its own names, a quarter rotated by default ----------------------------------

# The Llama family's name -> transformers 4's GPT-NeoX name (a config.json written by it).
NEOX_ROTARY_NAMES = {"rope_theta": "rotary_emb_base"}


def neox_rotary_from_hf(hf_config: Any, setting: Callable[[str], Any]) -> dict[str, Any]:
    """GPT-NeoX's rotary fields, as `rotary_from_hf` reads them. transformers 4 named the base
    `rotary_emb_base` and the fraction of each head rotated `rotary_pct`; transformers 5 moves
    both into `rope_parameters`, taking `rotary_pct` (0.25, Pythia's, where it is left out) for
    a table without `partial_rotary_factor`. Only a full rotary is glassgpt's."""
    tables = [table for table in (getattr(hf_config, key, None)
                                  for key in ("rope_parameters", "rope_scaling"))
              if isinstance(table, dict)]
    if not tables or any("partial_rotary_factor" not in table for table in tables):
        _check_partial(setting("rotary_pct"), "rotary_pct")
    return rotary_from_hf(hf_config, lambda key: setting(NEOX_ROTARY_NAMES.get(key, key)))


def neox_rope_kwargs(config_class: Any, config: GPTConfig) -> dict[str, Any]:
    """How the installed transformers takes a GPT-NeoX rotary, every feature rotated (its
    default rotates a quarter): `rope_parameters` (5.x), or `rotary_emb_base`, `rotary_pct`
    and `rope_scaling` (4.x)."""
    if _takes_rope_parameters(config_class):
        return {"rope_parameters": {**_rope_table(config), "partial_rotary_factor": 1.0}}
    return {"rotary_emb_base": config.rope_theta, "rotary_pct": 1.0,
            "rope_scaling": _scaling_table(config)}


# --- Gemma 3: a rotary per layer type ------------------------------------------------------

LAYER_TYPES = ("full_attention", "sliding_attention")


def layered_rotary_from_hf(hf_config: Any, setting: Callable[[str], Any]) -> dict[str, Any]:
    """The global layers' rotary fields (as `rotary_from_hf` gives them) and the local
    layers' base, `rope_local_theta`, of a Gemma 3 config: from `rope_parameters` per layer
    type, or from `rope_theta`, `rope_scaling` and `rope_local_base_freq`."""
    table = getattr(hf_config, "rope_parameters", None)
    scaling = getattr(hf_config, "rope_scaling", None)
    if table is None:  # transformers 4
        full = {} if scaling is None else _checked_table("rope_scaling", scaling)
        sliding: dict[str, Any] = {}
        key = "rope_scaling"
    else:
        table = _checked_table("rope_parameters", table)
        other = sorted(set(table) - set(LAYER_TYPES))
        if other:
            raise ConfigError(f"rope_parameters holds {other}; a Gemma 3 config has one table "
                              f"per layer type, {list(LAYER_TYPES)}")
        full, sliding = (_checked_table(f"rope_parameters' {kind}", table.get(kind) or {})
                         for kind in LAYER_TYPES)
        key = "rope_parameters' full_attention"
    fields = _scaling_fields(key, full, setting)
    # transformers 5 reads a rope_scaling over the global table (its config objects also
    # answer `rope_scaling` with rope_parameters itself)
    if table is not None and scaling is not None and scaling != table:
        old = _scaling_fields("rope_scaling", _checked_table("rope_scaling", scaling), setting)
        if old != fields:
            raise ConfigError(f"rope_parameters and rope_scaling disagree ({fields} and {old}): "
                              f"which one transformers reads depends on its version")
    local = _scaling_fields("rope_parameters' sliding_attention", sliding, setting)
    if local:
        raise ConfigError(f"rope_parameters' sliding_attention has rope_type="
                          f"{local['rope_scaling']!r}: glassgpt's local layers rotate unscaled "
                          f"(rope_local_theta), as Gemma 3's do")
    theta = _base("rope_theta", full.get("rope_theta", setting("rope_theta")))
    local_theta = sliding.get("rope_theta", setting("rope_local_base_freq"))
    return {"rope_theta": theta, **fields,
            "rope_local_theta": _base("rope_local_base_freq", local_theta)}


def _checked_table(key: str, table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{key} must be a JSON object or null, got {table!r:.40}")
    return table


def layered_rotary_of(config: GPTConfig) -> dict[str, Any]:
    """`config`'s rotary as `layered_rotary_from_hf` gives it (the local base is the global
    one where the config has none of its own)."""
    local = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
    return {**rotary_of(config), "rope_local_theta": local}


def layered_rope_kwargs(config_class: Any, config: GPTConfig) -> dict[str, Any]:
    """How the installed transformers takes a Gemma 3 rotary: `rope_parameters` per layer type
    (5.x), or `rope_theta`, `rope_scaling` and `rope_local_base_freq` (4.x)."""
    local = layered_rotary_of(config)["rope_local_theta"]
    if _takes_rope_parameters(config_class):
        return {"rope_parameters": {
            "full_attention": _rope_table(config),
            "sliding_attention": {"rope_type": "default", "rope_theta": local}}}
    return {"rope_theta": config.rope_theta, "rope_scaling": _scaling_table(config),
            "rope_local_base_freq": local}


@dataclass(frozen=True)
class RotaryTranslation:
    """An architecture's rotary settings both ways: read from a HF config (with its family's
    `setting` defaults), the same fields of a GPTConfig (to check an export reads back), and
    the kwargs the installed transformers' config class takes."""

    read: Callable[[Any, Callable[[str], Any]], dict[str, Any]]
    of: Callable[[GPTConfig], dict[str, Any]]
    kwargs: Callable[[Any, GPTConfig], dict[str, Any]]


PLAIN_ROTARY = RotaryTranslation(rotary_from_hf, rotary_of, rope_kwargs)
NEOX_ROTARY = RotaryTranslation(neox_rotary_from_hf, rotary_of, neox_rope_kwargs)
LAYERED_ROTARY = RotaryTranslation(layered_rotary_from_hf, layered_rotary_of,
                                   layered_rope_kwargs)
