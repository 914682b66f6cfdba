"""Rotary settings between a Hugging Face config and a GPTConfig: the base and the scaling.

transformers 5 keeps them in one table, `rope_parameters` ({"rope_type", "rope_theta",
"factor", ...}); checkpoints written by transformers 4 have `rope_theta` beside a
`rope_scaling` table (null when unscaled, and "type" where later ones say "rope_type"). Both
are read; the export is written the way the installed transformers takes it. The scalings
glassgpt computes (glassgpt.rotary) are the plain one ("default"), "linear" and "llama3"; any
other is refused by name, as is a key a table holds that glassgpt would not honour.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from glassgpt.config import ALL_ROPE_SCALING_SETTINGS, ROPE_SCALINGS, GPTConfig
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
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not math.isfinite(theta):
        raise ConfigError(f"rope_theta must be a finite number, got {theta!r:.40}")
    return {"rope_theta": float(theta), **(found or {})}


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


def _check_partial(partial: Any) -> None:
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor={partial!r:.40} is not supported: glassgpt "
                          f"rotates every feature of q and k")


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
    kind = config.rope_scaling or "default"
    scaling = {theirs: getattr(config, ours) for theirs, ours in SCALING_KEYS[kind].items()}
    if "rope_parameters" in inspect.signature(config_class.__init__).parameters:
        return {"rope_parameters": {"rope_type": kind, "rope_theta": config.rope_theta,
                                    **scaling}}
    table = {"rope_type": kind, **scaling} if config.rope_scaling else None
    return {"rope_theta": config.rope_theta, "rope_scaling": table}
