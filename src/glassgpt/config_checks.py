"""The checks every setting passes, beside `glassgpt.config`'s dataclasses: each field's type
and range (`check_field_types`, as JSON, TOML and flags can hold anything), the sizes and
choices the modules built standalone check too, the switches that must fit together (a rotary
scaling and its settings, per-layer lists, the local layers' settings, Gemma's scales), and a
recipe's and a sampling's checks with the choices and bounds they hold them to.

A leaf like `config.py`, which calls these checks (it imports only the errors).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

from glassgpt.errors import ConfigError, GlassGPTError, InputError

MAX_WIDTH = 2**18  # widths beyond this make matrices no machine holds (GPT-3 is 12,288)
T = TypeVar("T")


def check_size(name: str, value: object, largest: int = MAX_WIDTH) -> None:
    """Raise ConfigError unless `value` is a positive int (not a bool) of at most `largest`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a positive integer, got {value!r:.80}")
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    if value > largest:
        raise ConfigError(f"{name}={value} is too large (at most {largest:,})")


def check_heads_divide_width(d_model: int, n_heads: int) -> int:
    """Return the head width d = d_model // n_heads, or raise if the heads do not split C evenly."""
    for name, value in (("d_model", d_model), ("n_heads", n_heads)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a positive integer, got {value!r:.80}")
    if d_model <= 0 or n_heads <= 0:
        raise ConfigError(f"d_model and n_heads must be positive, got d_model={d_model}, "
                          f"n_heads={n_heads}")
    if d_model % n_heads != 0:
        raise ConfigError(f"d_model={d_model} is not divisible by n_heads={n_heads}: each head "
                          f"needs an equal slice of the width")
    check_size("d_model", d_model)
    return d_model // n_heads


def check_n_kv_head(n_head: int, n_kv_head: int) -> None:
    """Grouped-query attention: each of the n_kv_head key/value heads serves an equal group."""
    check_size("n_kv_head", n_kv_head)
    if n_head % n_kv_head != 0:
        raise ConfigError(f"n_head={n_head} is not divisible by n_kv_head={n_kv_head}: each "
                          f"key/value head must serve an equal group of query heads")


def check_dropout(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {p}")



def check_widths_and_scales(config: Any) -> None:
    """Raise ConfigError for a GPTConfig's MLP width, norm epsilon, rotary base or logit
    soft-cap out of range."""
    if config.mlp_hidden is not None:
        check_size("mlp_hidden", config.mlp_hidden, 4 * MAX_WIDTH)
    for name in ("norm_eps", "rope_theta"):
        if not getattr(config, name) > 0:
            raise ConfigError(f"{name} must be positive, got {getattr(config, name)}")
    if not config.rope_theta >= 1:  # pair i turns at rope_theta ** (-2i / d): below 1, the
        # faster pairs come last, and a tiny base overflows the angles to NaN
        raise ConfigError(f"rope_theta must be at least 1 (models use 10,000 to 10**6), "
                          f"got {config.rope_theta}")
    if config.logit_softcap is not None and not config.logit_softcap > 0:
        raise ConfigError(f"logit_softcap must be positive (or None), got "
                          f"{config.logit_softcap}")

def check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {what} {value!r}; choose one of {list(choices)}")


ROPE_SCALINGS = ("llama3", "linear")  # the rotary scalings glassgpt.rotary computes
# Which settings each scaling takes; the others must stay None.
ROPE_SCALING_SETTINGS = {
    "linear": ("rope_factor",),
    "llama3": ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_context"),
}
ALL_ROPE_SCALING_SETTINGS = ROPE_SCALING_SETTINGS["llama3"]


def check_rope_scaling(config: Any) -> None:
    """Raise ConfigError unless rope_scaling names a scaling glassgpt computes and exactly its
    settings are given, each in range."""
    kind = config.rope_scaling
    given = [name for name in ALL_ROPE_SCALING_SETTINGS if getattr(config, name) is not None]
    if kind is None:
        if given:
            raise ConfigError(f"{given[0]}={getattr(config, given[0])} needs rope_scaling "
                              f"(one of {list(ROPE_SCALINGS)})")
        return
    check_choice("rope_scaling", kind, ROPE_SCALINGS)
    if config.position != "rope":
        raise ConfigError(f"rope_scaling={kind!r} scales rotary positions, but position="
                          f"{config.position!r}")
    wanted = ROPE_SCALING_SETTINGS[kind]
    for name in ALL_ROPE_SCALING_SETTINGS:
        value = getattr(config, name)
        if name in wanted and value is None:
            raise ConfigError(f"rope_scaling={kind!r} needs {name}")
        if name not in wanted and value is not None:
            raise ConfigError(f"{name} is not a setting of rope_scaling={kind!r} (it takes "
                              f"{list(wanted)})")
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if kind == "llama3" and not config.rope_low_freq_factor < config.rope_high_freq_factor:
        raise ConfigError(f"rope_low_freq_factor={config.rope_low_freq_factor} must be below "
                          f"rope_high_freq_factor={config.rope_high_freq_factor}: the band "
                          f"between them is interpolated")


def check_layer_list(config: Any, name: str) -> None:
    """Raise ConfigError unless the per-layer list `name` names distinct layers, in order."""
    layers = getattr(config, name)
    if layers is None:
        return
    outside = [i for i in layers if not 0 <= i < config.n_layer]
    if outside:
        raise ConfigError(f"{name} holds {outside[0]}, not a layer of n_layer="
                          f"{config.n_layer} (layers count from 0)")
    if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
        raise ConfigError(f"{name} must list distinct layers in order, got {list(layers)}")


def check_nope_layers(config: Any) -> None:
    """Raise ConfigError unless nope_layers names distinct layers of a rotary model."""
    if config.nope_layers is not None and config.position != "rope":
        raise ConfigError(f"nope_layers leaves out rotary positions in some layers, but "
                          f"position={config.position!r} has none to leave out")
    check_layer_list(config, "nope_layers")


def check_local_layers(config: Any) -> None:
    """Raise ConfigError unless the sliding window's settings fit together: local_layers and
    rope_local_theta need a window, the base a rotary model."""
    if config.sliding_window is not None:
        check_size("sliding_window", config.sliding_window, 2**31)
    for name in ("local_layers", "rope_local_theta"):
        if getattr(config, name) is not None and config.sliding_window is None:
            raise ConfigError(f"{name} is a setting of the local layers, which need "
                              f"sliding_window (the tokens each one sees)")
    check_layer_list(config, "local_layers")
    theta = config.rope_local_theta
    if theta is not None:
        if config.position != "rope":
            raise ConfigError(f"rope_local_theta is a rotary base, but position="
                              f"{config.position!r}")
        if not theta >= 1:
            raise ConfigError(f"rope_local_theta must be at least 1, got {theta}")


def check_gemma_switches(config: Any) -> None:
    """Raise ConfigError for an attention scale, soft-cap or norm offset out of range."""
    for name in ("query_pre_attn_scalar", "attn_softcap"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be positive (or None), got {value}")
    if config.norm_offset and config.norm != "rmsnorm":
        raise ConfigError(f"norm_offset scales an RMSNorm by 1 + w, but norm={config.norm!r}")


def check_arena_switches(config: Any) -> None:
    """Raise ConfigError where attn_only, norm="none" or shortformer positions meet a switch
    they leave nothing for: an MLP width without an MLP, output norms without norms."""
    if config.attn_only and config.mlp_hidden is not None:
        raise ConfigError(f"mlp_hidden={config.mlp_hidden} sizes an MLP, but attn_only blocks "
                          "have none")
    if config.post_norms and config.norm == "none":
        raise ConfigError("post_norms normalises the sub-layers' outputs, but norm='none'")


DTYPES = ("auto", "float32", "bfloat16", "float16")  # training precision (autocast)
OPTIMIZERS = ("adamw", "muon")  # glassgpt.training.optim
SCHEDULES = ("cosine", "wsd")  # learning-rate decay after warmup (glassgpt.training.optim.lr_at)
# Upper bounds of a recipe (TrainConfig): batches per step or evaluation, and lr / weight decay.
MAX_GRAD_ACCUM = 10_000
MAX_EVAL_ITERS = 10_000
MAX_SNAPSHOTS = 10_000  # weight snapshots a run keeps (glassgpt.rundir.snapshots)
MAX_RATE = 10.0


def check_recipe(recipe: Any) -> None:
    """Raise ConfigError for a `TrainConfig` setting of the wrong type, out of range or not one
    of its choices, or a recipe whose work cannot finish (`check_recipe_bounds`)."""
    check_field_types(recipe)
    for name in ("max_iters", "batch_size", "grad_accum", "eval_interval", "eval_iters",
                 "log_interval"):
        if getattr(recipe, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(recipe, name)}")
    for name in ("warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip", "min_lr",
                 "early_stop", "seed", "snapshots"):
        if getattr(recipe, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(recipe, name)}")
    if not recipe.lr > 0:
        raise ConfigError(f"lr must be positive, got {recipe.lr}")
    for name in ("beta1", "beta2", "muon_momentum"):
        if not 0.0 <= getattr(recipe, name) < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {getattr(recipe, name)}")
    check_choice("dtype", recipe.dtype, DTYPES)
    check_choice("optimizer", recipe.optimizer, OPTIMIZERS)
    check_choice("schedule", recipe.schedule, SCHEDULES)
    if not recipe.muon_lr > 0 or recipe.muon_weight_decay < 0:
        raise ConfigError(f"muon_lr must be positive and muon_weight_decay >= 0, got "
                          f"{recipe.muon_lr} and {recipe.muon_weight_decay}")
    if not 0.0 < recipe.decay_fraction <= 1.0:
        raise ConfigError(f"decay_fraction must be in (0, 1], got {recipe.decay_fraction}")
    if recipe.target_loss is not None and not recipe.target_loss > 0:
        raise ConfigError(f"target_loss must be positive (a cross-entropy is never below 0), "
                          f"got {recipe.target_loss}")
    check_recipe_bounds(recipe)


def check_recipe_bounds(recipe: Any) -> None:
    """Refuse work that cannot finish (a step or an evaluation of 10**12 batches) and rates
    that only overflow: the optimizer multiplies each weight by lr * weight_decay and moves it
    by about lr a step, so values past these bounds train nothing."""
    for name, largest in (("grad_accum", MAX_GRAD_ACCUM), ("eval_iters", MAX_EVAL_ITERS)):
        if getattr(recipe, name) > largest:
            raise ConfigError(f"{name}={getattr(recipe, name)} is too large (at most "
                              f"{largest:,} batches)")
    for name in ("lr", "min_lr", "muon_lr", "weight_decay", "muon_weight_decay"):
        if getattr(recipe, name) > MAX_RATE:
            raise ConfigError(f"{name}={getattr(recipe, name)} is too large (at most "
                              f"{MAX_RATE:g}): such a step only overflows the weights")
    if recipe.snapshots > MAX_SNAPSHOTS:
        raise ConfigError(f"snapshots={recipe.snapshots} is too many (at most {MAX_SNAPSHOTS:,})")
    if recipe.optimizer == "muon" and not math.isfinite(recipe.muon_lr / recipe.lr):
        raise ConfigError(f"lr={recipe.lr} is too small beside muon_lr={recipe.muon_lr}: Muon's "
                          f"lr follows the schedule in their ratio, which overflows")


ENGINES = ("auto", "eager", "cpu", "cuda-graph")  # decoding engines (glassgpt.decoding)
DECODE_DTYPES = ("float32", "bfloat16", "int8")  # weights to decode in (decoding.prepare)
# Compiling the CPU step took 31 s cold and ~6 s from torch's cache on a 2-core machine (issue
# 51, a shared 2-core Zen 4 at load 3: a 24-token `sample --compile` took 39 s for a 0.11M model
# and 75 s for GPT-2 small cold, 13 and 20 s from the cache); it saves ~0.6 ms of ~2.4 ms per
# step (BENCHMARKS.md, shakespeare-char): ~10,000 steps to win it back.
# Only steps inside the context use it: past block_size each token recomputes the window.
COMPILE_PAYS_OFF_STEPS = 10_000


def check_sampling(settings: Any) -> None:
    """Raise InputError for a `SamplingConfig` setting of the wrong type or out of range."""
    check_field_types(settings, InputError)
    if settings.temperature < 0:
        raise InputError(f"temperature must be >= 0 (0 is greedy), got {settings.temperature}")
    if settings.top_k is not None and settings.top_k <= 0:
        raise InputError(f"top_k must be a positive integer, got {settings.top_k}")
    if settings.top_p is not None and not 0.0 < settings.top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {settings.top_p}")
    if settings.max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {settings.max_new_tokens}")
    if settings.seed is not None and settings.seed < 0:
        raise InputError(f"seed must be >= 0, got {settings.seed}")
    if settings.stop_token is not None and settings.stop_token < 0:
        raise InputError(f"stop_token must be a token id >= 0, got {settings.stop_token}")
    if settings.engine not in ENGINES:
        raise InputError(f"unknown decoding engine {settings.engine!r}; choose one of "
                         f"{list(ENGINES)}")


_FIELD_TYPES = {"int": int, "float": float, "bool": bool, "str": str}
INT64_MAX = 2**63 - 1


def check_field_types(settings: Any, error: type[GlassGPTError] = ConfigError) -> None:
    """Raise `error` for a dataclass field holding a value of the wrong type or out of reach.

    Settings may come from JSON, TOML or flags a user wrote, where `"4"`, `4.0` or `true` can
    stand where an int belongs. An int where a float belongs is fine and becomes a float. Ints
    must fit in 64 bits (they become tensor sizes and seeds) and floats must be finite.
    Annotations are the strings "int", "float", "bool", "str", optionally "... | None".
    """
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        name, _, optional = field.type.partition(" | ")
        if value is None and optional == "None":
            continue
        if name == "tuple[int, ...]":  # a list from JSON, TOML or a flag: kept as a tuple
            _check_int_tuple(settings, field.name, value, error)
            continue
        expected = _FIELD_TYPES[name]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                raise error(f"{field.name}={_int_text(value)} is too large for a float (at "
                            f"most about 1.8e308)") from None
            object.__setattr__(settings, field.name, value)  # works on frozen dataclasses too
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise error(f"{field.name} must be {field.type}, got {value!r:.80}")
        if expected is int and abs(value) > INT64_MAX:
            raise error(f"{field.name}={_int_text(value)} is too large (at most 2**63 - 1)")
        if expected is float and not math.isfinite(value):
            raise error(f"{field.name} must be a finite number, got {value}")


def _check_int_tuple(settings: Any, name: str, value: Any,
                     error: type[GlassGPTError]) -> None:
    if not isinstance(value, list | tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) and abs(v) <= INT64_MAX
            for v in value):
        raise error(f"{name} must be a list of integers, got {value!r:.80}")
    object.__setattr__(settings, name, tuple(value))  # a tuple: no change behind the checks


def _int_text(value: int) -> str:
    """An int as digits, or its size when the digits would fill the line (or exceed str())."""
    return str(value) if value.bit_length() <= 128 else f"<an integer of {value.bit_length()} bits>"


def settings_from_dict(cls: type[T], values: Any, what: str) -> T:
    """Build the settings dataclass `cls` from a plain dict; unknown keys are an error."""
    if not isinstance(values, dict):
        raise ConfigError(f"{what} must be a table of settings, got {values!r:.80}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {what} {unknown}; known keys: {sorted(known)}")
    return cls(**values)
