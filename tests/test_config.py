"""`GPTConfig`: validation with the offending values in every message, and the shipped presets."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from glassgpt.config import GPTConfig, TrainConfig, load_preset, preset_names
from glassgpt.errors import ConfigError
from glassgpt.model import GPT, count_parameters

SPEC_PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "shakespeare-char", "cpu-small")


# --- presets -------------------------------------------------------------------------------

def test_every_preset_of_the_spec_is_shipped():
    assert set(SPEC_PRESETS) <= set(preset_names())


@pytest.mark.parametrize("name", preset_names())
def test_every_shipped_preset_parses_and_builds(name):
    preset = load_preset(name)
    assert isinstance(preset.get("train"), dict) and preset["train"], f"{name} has no [train]"
    config = GPTConfig.from_preset(name)
    assert config.to_dict() == {**GPTConfig().to_dict(), **preset["model"]}
    with torch.device("meta"):  # shapes only, even for GPT-2 XL
        model = GPT(config)
    assert count_parameters(model) == expected_parameters(config)


def expected_parameters(c: GPTConfig) -> int:
    """The parameter count of a config, by hand. GPT-2's shape gives
    (V + block_size) * C + L * (12C^2 + 13C) + 2C."""
    C, F, kv = c.n_embd, c.hidden_width, (c.n_kv_head or c.n_head) * c.head_dim
    Q = c.n_head * c.head_dim  # C unless head_dim is set
    qkv_bias = c.bias if c.qkv_bias is None else c.qkv_bias
    norm = C * (2 if c.norm == "layernorm" and c.bias else 1)
    attention = (C * (Q + 2 * kv) + Q * C + (Q + 2 * kv) * qkv_bias + C * c.bias
                 + 2 * c.head_dim * c.qk_norm)
    if c.activation in ("swiglu", "geglu"):  # gated: gate, up and down matrices
        mlp = 3 * C * F + (2 * F + C) * c.bias
    else:
        mlp = 2 * C * F + (F + C) * c.bias
    embeddings = c.vocab_size * C * (1 if c.tie_weights else 2)
    positions = c.block_size * C if c.position == "learned" else 0
    norms = 4 if c.post_norms else 2  # Gemma normalises the sub-layers' outputs too
    return embeddings + positions + c.n_layer * (attention + norms * norm + mlp) + norm


def test_the_hand_count_is_gpt2s_formula_for_gpt2():
    c = GPTConfig()
    C, L = c.n_embd, c.n_layer
    assert expected_parameters(c) == (c.vocab_size + c.block_size) * C + L * (12 * C**2 + 13 * C) \
        + 2 * C == 124_439_808


@pytest.mark.parametrize("name, shape", [
    ("gpt2", (12, 12, 768, 1024)),
    ("gpt2-medium", (24, 16, 1024, 1024)),
    ("gpt2-large", (36, 20, 1280, 1024)),
    ("gpt2-xl", (48, 25, 1600, 1024)),
    ("shakespeare-char", (6, 6, 384, 256)),
    ("cpu-small", (4, 4, 128, 64)),
])
def test_preset_shapes_are_the_documented_ones(name, shape):
    config = GPTConfig.from_preset(name)
    assert (config.n_layer, config.n_head, config.n_embd, config.block_size) == shape


def test_from_preset_applies_overrides():
    config = GPTConfig.from_preset("cpu-small", dropout=0.1, n_layer=2)
    assert (config.dropout, config.n_layer, config.n_embd) == (0.1, 2, 128)
    with pytest.raises(ConfigError, match=r"n_head.*got 'four'"):
        GPTConfig.from_preset("cpu-small", n_head="four")


def test_unknown_preset_is_an_error_listing_the_choices():
    with pytest.raises(ConfigError, match=r"unknown preset 'gpt5'.*cpu-small.*gpt2"):
        GPTConfig.from_preset("gpt5")
    with pytest.raises(ConfigError, match=r"'gpt5'"):
        load_preset("gpt5")


# --- round trips ---------------------------------------------------------------------------

def test_config_round_trips_through_json():
    config = GPTConfig(vocab_size=65, block_size=32, n_layer=3, n_head=2, n_embd=64,
                       dropout=0.1, bias=False, activation="relu", pre_ln=False)
    assert GPTConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.head_dim == 32


def test_defaults_are_gpt2_small():
    assert GPTConfig() == GPTConfig.from_preset("gpt2")


def test_an_int_is_accepted_where_a_float_is_expected():
    config = GPTConfig.from_dict({"dropout": 0, "norm_eps": 1})
    assert isinstance(config.dropout, float) and config.norm_eps == 1.0


# --- errors --------------------------------------------------------------------------------

def test_width_must_split_into_heads():
    with pytest.raises(ConfigError, match=r"d_model=100 is not divisible by n_heads=12"):
        GPTConfig(n_embd=100, n_head=12)
    with pytest.raises(ValueError, match=r"100.*12"):  # a ValueError, as the spec says
        GPTConfig(n_embd=100, n_head=12)


@pytest.mark.parametrize("field", ["vocab_size", "block_size", "n_layer", "n_head", "n_embd"])
@pytest.mark.parametrize("value", [0, -3])
def test_sizes_must_be_positive(field, value):
    with pytest.raises(ConfigError, match=rf"{field} must be positive, got {value}"):
        GPTConfig(**{field: value})


@pytest.mark.parametrize("values, message", [
    ({"n_layer": "4"}, r"n_layer must be int, got '4'"),
    ({"n_layer": 4.0}, r"n_layer must be int, got 4.0"),
    ({"n_layer": True}, r"n_layer must be int, got True"),
    ({"dropout": "0.1"}, r"dropout must be float, got '0.1'"),
    ({"bias": 1}, r"bias must be bool, got 1"),
    ({"pre_ln": "yes"}, r"pre_ln must be bool, got 'yes'"),
    ({"activation": 3}, r"activation must be str, got 3"),
    ({"vocab_size": None}, r"vocab_size must be int, got None"),
])
def test_wrong_types_are_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig.from_dict(values)


def test_unknown_keys_are_errors_not_ignored():
    with pytest.raises(ConfigError, match=r"unknown model config keys \['n_heads', 'width'\]"):
        GPTConfig.from_dict({"n_heads": 4, "width": 64, "n_layer": 2})


def test_a_config_must_be_a_table():
    with pytest.raises(ConfigError, match=r"got \[1, 2\]"):
        GPTConfig.from_dict([1, 2])


def test_unknown_activation_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown activation 'swish'.*'gelu', 'gelu_tanh'"):
        GPTConfig(activation="swish")


def test_unknown_attention_impl_is_an_error():
    with pytest.raises(ConfigError, match=r"unknown attn_impl 'flash'.*'fused', 'explicit'"):
        GPTConfig(attn_impl="flash")


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 2.5])
def test_dropout_must_be_a_probability_below_one(dropout):
    with pytest.raises(ConfigError, match=rf"dropout must be in \[0, 1\), got {dropout}"):
        GPTConfig(dropout=dropout)


@pytest.mark.parametrize("eps", [0.0, -1e-5])
def test_layernorm_eps_must_be_positive(eps):
    with pytest.raises(ConfigError, match=rf"norm_eps must be positive, got {eps}"):
        GPTConfig(norm_eps=eps)


def test_every_setting_documents_its_own_flag(capsys):
    """A field's help lives beside it (`setting(default, doc)`), never in a table kept by hand
    in the command line."""
    from glassgpt.cli import main
    from glassgpt.cli import train as train_command
    for cls in (GPTConfig, TrainConfig):
        for field in dataclasses.fields(cls):
            assert field.metadata.get("help"), f"{cls.__name__}.{field.name} has no help"
    assert not hasattr(train_command, "MODEL_HELP")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for field in dataclasses.fields(GPTConfig):
        if field.name != "vocab_size":  # the data's tokenizer sets it, never a flag
            assert " ".join(field.metadata["help"].split()[:4]) in shown, field.name
