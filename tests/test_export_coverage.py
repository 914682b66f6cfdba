"""Export coverage: every GPTConfig field, on every family the export writes, is either written
to the Hugging Face config or refused by name.

For each family (one tiny config that exports as it) and each field, the field alone is changed
to another valid value. Then either the export writes it (the HF config differs from the
base's, and reading it back gives the new value), or it raises a ConfigError that names the
field. An export that succeeds with the same HF config has dropped the switch: transformers
would compute something else than glassgpt. The few fields no HF config holds, because a
trained model computes the same without them, are listed below with the reason.

Configs only (`hf_config_from_glassgpt`), no weights: the whole file runs in a few seconds.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers")

from glassgpt.config import GPTConfig  # noqa: E402
from glassgpt.errors import ConfigError  # noqa: E402
from glassgpt.formats.interop import architecture_for, config_from_hf, hf_config_from_glassgpt  # noqa: E402

SHAPE = dict(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32)
LLAMA = dict(SHAPE, position="rope", norm="rmsnorm", activation="swiglu", bias=False)
GEMMA = dict(LLAMA, activation="geglu", post_norms=True, norm_offset=True, embed_scale=True)
# One config per family the export writes, keyed by the model_type it exports as.
FAMILIES = {
    "gpt2": SHAPE,
    "llama": LLAMA,
    "qwen3": dict(LLAMA, qk_norm=True),
    "qwen2": dict(LLAMA, qkv_bias=True),
    "smollm3": dict(LLAMA, nope_layers=(1,)),
    "gemma3_text": dict(GEMMA, qk_norm=True),
    "gemma2": GEMMA,
    "gpt_neox": dict(SHAPE, position="rope"),
}

# Fields no HF config holds, because a trained model computes the same whatever they are.
NOT_COMPUTED = {
    # the attention path: fused and explicit compute the same scores (tests/test_attention.py)
    "attn_impl",
    # how the weights start: an export carries the trained weights themselves
    "zero_init_proj",
}
# Fields a family's block never reads, so its HF config has no place for them.
INERT = {
    ("gpt2", "rope_theta"),  # a rotary base, and learned positions rotate nothing
}


@dataclasses.dataclass(frozen=True)
class Change:
    """How to give a field another valid value: the fields it needs set first (`given`: a
    rope_factor needs a rope_scaling), then `value(config, name)`, the new value, with the
    fields that must come with it (`along`: a rope_scaling needs its factor)."""

    value: Callable[[GPTConfig, str], Any]
    given: dict[str, Any] = dataclasses.field(default_factory=dict)
    along: dict[str, Any] = dataclasses.field(default_factory=dict)

    def configs(self, family: str, name: str) -> tuple[GPTConfig, GPTConfig]:
        """The family's config with `given`, and the same with `name` changed: built anew,
        so a width derived from others (head_dim) follows a changed n_embd."""
        settings = {**FAMILIES[family], **self.given}
        base = GPTConfig(**settings)
        return base, GPTConfig(**{**settings, name: self.value(base, name), **self.along})


def flipped(config: GPTConfig, name: str) -> bool:
    return not getattr(config, name)


def one_of(*values: Any) -> Callable[[GPTConfig, str], Any]:
    """The first of `values` the config does not have already."""
    return lambda config, name: next(v for v in values if v != getattr(config, name))


LINEAR = dict(rope_scaling="linear", rope_factor=2.0)
LLAMA3 = dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
              rope_high_freq_factor=4.0, rope_original_context=8)
# Another valid value of every GPTConfig field. A new field needs a row here: the test then
# tells whether each family writes it or refuses it by name.
CHANGES: dict[str, Change] = {
    "vocab_size": Change(one_of(97)),
    "block_size": Change(one_of(24)),
    "n_layer": Change(one_of(3)),
    "n_head": Change(one_of(8, 2)),
    "n_embd": Change(one_of(48)),
    "dropout": Change(one_of(0.1)),
    "bias": Change(flipped),
    "activation": Change(one_of("relu", "gelu")),
    "pre_ln": Change(flipped),
    "tie_weights": Change(flipped),
    "norm_eps": Change(one_of(1e-6)),
    "attn_impl": Change(one_of("explicit")),
    "position": Change(one_of("none", "learned")),
    "rope_theta": Change(one_of(500000.0)),
    "norm": Change(one_of("rmsnorm", "layernorm")),
    "mlp_hidden": Change(one_of(40)),
    "n_kv_head": Change(one_of(2)),
    "qk_norm": Change(flipped),
    "logit_softcap": Change(one_of(30.0)),
    "zero_init_proj": Change(flipped),
    "head_dim": Change(one_of(16)),
    # the biases q, k and v have, turned: None already means "as bias"
    "qkv_bias": Change(lambda config, name: not config.has_qkv_bias),
    "rope_scaling": Change(one_of("linear"), along=dict(rope_factor=2.0)),
    "rope_factor": Change(one_of(4.0), LINEAR),
    "rope_low_freq_factor": Change(one_of(2.0), LLAMA3),
    "rope_high_freq_factor": Change(one_of(3.0), LLAMA3),
    "rope_original_context": Change(one_of(12), LLAMA3),
    "nope_layers": Change(one_of((0,), (1,))),
    "sliding_window": Change(one_of(4, 8)),
    "local_layers": Change(one_of((0,), (1,)), dict(sliding_window=4)),
    "rope_local_theta": Change(one_of(20000.0), dict(sliding_window=4)),
    "query_pre_attn_scalar": Change(one_of(16.0)),
    "attn_softcap": Change(one_of(50.0)),
    "post_norms": Change(flipped),
    "norm_offset": Change(flipped),
    "embed_scale": Change(flipped),
    "attn_only": Change(flipped),
}
# Fields exported as a model that computes the same in another shape: an attention-only block
# as one whose MLP (the usual 4C wide) has zero weights (glassgpt.formats.interop.with_zero_mlps).
# field -> what the config read back has instead.
EQUIVALENT = {"attn_only": {"attn_only": False, "mlp_hidden": None}}
FIELDS = [field.name for field in dataclasses.fields(GPTConfig)]


def exported(config: GPTConfig) -> dict[str, Any] | ConfigError:
    """The HF config `config` exports as, as a dict, or the ConfigError refusing it."""
    try:
        return hf_config_from_glassgpt(config).to_dict()
    except ConfigError as error:
        return error


def names(error: ConfigError, fields: list[str]) -> bool:
    """Whether the message names one of `fields` with its value ("qk_norm=True")."""
    return any(re.search(rf"(?<![\w.]){name}=", str(error)) for name in fields)


def in_effect(config: GPTConfig, name: str) -> Any:
    """What `config` computes with for `name` (qkv_bias None means "as bias")."""
    return config.has_qkv_bias if name == "qkv_bias" else getattr(config, name)


def test_every_field_has_another_value() -> None:
    missing = [name for name in FIELDS if name not in CHANGES]
    assert not missing, (f"GPTConfig fields {missing} have no row in CHANGES: give each another "
                         f"valid value there, then make every HF family write it or refuse it "
                         f"by name (glassgpt.formats.translation.FamilyFields)")
    assert set(CHANGES) <= set(FIELDS), sorted(set(CHANGES) - set(FIELDS))
    exempt = NOT_COMPUTED | {name for _, name in INERT}
    assert not exempt - set(FIELDS), sorted(exempt - set(FIELDS))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_base_exports_as_it(family: str) -> None:
    assert architecture_for(GPTConfig(**FAMILIES[family])).model_type == family


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_field_is_written_or_refused_by_name(family: str, name: str) -> None:
    where = f"{name} on {family}"
    change = CHANGES.get(name)
    if change is None:
        pytest.fail(f"{name} has no row in CHANGES (test_every_field_has_another_value)")
    try:
        base, changed = change.configs(family, name)
    except ConfigError:
        return  # GPTConfig itself refuses the switch on this family: no export can see it
    before, after = exported(base), exported(changed)
    if isinstance(before, ConfigError):
        # a field that needs another one set first (local_layers needs sliding_window):
        # a family that refuses that one by name refuses both
        assert isinstance(after, ConfigError), f"{where}: exported where its context is refused"
        assert names(after, [name, *change.given]), f"{where}: refused unnamed: {after}"
        return
    if isinstance(after, ConfigError):
        assert names(after, [name]), f"{where}: the refusal does not name it: {after}"
        return
    if name in NOT_COMPUTED or (family, name) in INERT:
        assert after == before, (f"{where} is listed as not computed, yet the HF config "
                                 f"changes with it: take it off the list")
        return
    if name in EQUIVALENT:  # the config of the equivalent model, its weights carry the rest
        twin = dataclasses.replace(changed, **EQUIVALENT[name])
        assert after == exported(twin), f"{where}: not exported as {EQUIVALENT[name]}"
        return
    assert after != before, (f"{where}: exported with the same HF config, the switch silently "
                             f"dropped; write it or refuse it by name in the family's "
                             f"FamilyFields (glassgpt.formats)")
    read_back = config_from_hf(hf_config_from_glassgpt(changed), dropout=changed.dropout)
    assert in_effect(read_back, name) == in_effect(changed, name), (
        f"{where}: the HF config holds something else than {getattr(changed, name)!r}")


def test_every_field_reaches_the_export_somewhere() -> None:
    """Each changed field is exported or refused by some family, not skipped by all (a row in
    CHANGES no base can take checks nothing)."""
    reached = set()
    for family in FAMILIES:
        for name in FIELDS:
            try:
                CHANGES[name].configs(family, name)
            except ConfigError:
                continue
            reached.add(name)
    assert reached == set(FIELDS), sorted(set(FIELDS) - reached)
