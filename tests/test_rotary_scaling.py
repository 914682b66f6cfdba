"""Rotary scaling (`rope_scaling`: "llama3", "linear") against its formula in float64, against
transformers' own rope init functions, and refused by name for any other kind."""

from __future__ import annotations

import math

import pytest
import torch

from glassgpt import ConfigError, GPTConfig
from glassgpt.model import GPT
from glassgpt.rotary import RopeScaling, RotaryEmbedding, rotary_frequencies

# Llama 3.2's settings: with head width 64 and base 500,000 the pairs fall in all three bands.
LLAMA3 = RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_context=8192)


def llama3_by_hand(d: int, theta: float, s: RopeScaling) -> list[float]:
    """The Llama 3 scaling pair by pair, as its paper's rule reads: keep the fast pairs,
    divide the slow ones by the factor, interpolate in context / wavelength between."""
    out = []
    for i in range(0, d, 2):
        freq = theta ** (-i / d)
        wavelength = 2 * math.pi / freq
        if wavelength < s.original_context / s.high_freq_factor:
            out.append(freq)
        elif wavelength > s.original_context / s.low_freq_factor:
            out.append(freq / s.factor)
        else:
            smooth = ((s.original_context / wavelength - s.low_freq_factor)
                      / (s.high_freq_factor - s.low_freq_factor))
            out.append((1 - smooth) * freq / s.factor + smooth * freq)
    return out


def test_llama3_frequencies_equal_the_formula_in_float64():
    ours = rotary_frequencies(64, 500000.0, LLAMA3, torch.float64)
    expected = torch.tensor(llama3_by_hand(64, 500000.0, LLAMA3), dtype=torch.float64)
    torch.testing.assert_close(ours, expected, rtol=1e-14, atol=0)
    plain = rotary_frequencies(64, 500000.0, None, torch.float64)
    assert (ours == plain).any() and (ours == plain / 32).any()  # kept and divided pairs
    assert ((ours < plain) & (ours > plain / 32)).any()  # ... and blended ones


def test_linear_scaling_turns_position_p_as_the_plain_rotary_turns_p_over_factor():
    scaled = RotaryEmbedding(16, 10000.0, RopeScaling("linear", factor=4.0))
    plain = RotaryEmbedding(16, 10000.0)
    positions = torch.arange(0, 40, dtype=torch.float64)
    for ours, theirs in zip(scaled.cos_sin(positions, torch.float64),
                            plain.cos_sin(positions / 4, torch.float64), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_frequencies_equal_transformers_rope_init_functions(kind):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    table = {"rope_type": kind, "factor": 8.0, "rope_theta": 500000.0}
    if kind == "llama3":
        table |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
    hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                  max_position_embeddings=131072, rope_parameters=table)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf, None)
    assert attention_factor == 1.0  # nothing scales cos and sin themselves
    config = GPTConfig(n_embd=256, n_head=4, position="rope", rope_theta=500000.0,
                       rope_scaling=kind, rope_factor=8.0,
                       **(dict(rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                               rope_original_context=8192) if kind == "llama3" else {}))
    rotary = RotaryEmbedding.from_config(config)
    ours = rotary_frequencies(64, rotary.theta, rotary.scaling, torch.float32)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)


def test_a_scaled_model_turns_by_the_scaled_angles():
    config = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16,
                       position="rope", rope_scaling="linear", rope_factor=2.0)
    attn = GPT(config).blocks[0].attn
    assert attn.rotary.scaling == RopeScaling("linear", 2.0)
    assert "scaling=linear" in repr(attn.rotary)


@pytest.mark.parametrize(("settings", "message"), [
    (dict(rope_scaling="yarn", rope_factor=2.0), "unknown rope_scaling 'yarn'"),
    (dict(rope_scaling="dynamic"), "unknown rope_scaling 'dynamic'"),
    (dict(rope_factor=2.0), "rope_factor=2.0 needs rope_scaling"),
    (dict(rope_scaling="linear"), "rope_scaling='linear' needs rope_factor"),
    (dict(rope_scaling="linear", rope_factor=2.0, rope_low_freq_factor=1.0),
     "rope_low_freq_factor is not a setting of rope_scaling='linear'"),
    (dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
          rope_high_freq_factor=4.0), "needs rope_original_context"),
    (dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=4.0,
          rope_high_freq_factor=4.0, rope_original_context=8192),
     "rope_low_freq_factor=4.0 must be below rope_high_freq_factor=4.0"),
    (dict(rope_scaling="linear", rope_factor=-1.0), "rope_factor must be positive"),
    (dict(rope_scaling="linear", rope_factor=2.0, position="learned"),
     "scales rotary positions, but position='learned'"),
])
def test_other_scalings_and_incomplete_settings_are_refused_by_name(settings, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**{"position": "rope", **settings})
