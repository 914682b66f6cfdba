"""glassgpt.lens: the computations behind `glassgpt view`, checked against the model itself."""

from __future__ import annotations

import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.errors import InputError
from glassgpt.lens import (
    attention_maps,
    lens_top_k,
    logit_lens,
    logit_lens_top_k,
    next_token_top_k,
    parameter_counts,
    read_out,
    top_k_probabilities,
    trace,
)
from glassgpt.model import GPT, count_parameters

L, H, C, V, T = 2, 2, 16, 11, 7


def tiny_gpt(**overrides) -> GPT:
    settings = dict(vocab_size=V, block_size=8, n_layer=L, n_head=H, n_embd=C) | overrides
    return GPT(GPTConfig(**settings)).eval()


@pytest.fixture(scope="module")
def idx() -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))  # (B, T)


@pytest.mark.parametrize("overrides", [{}, {"pre_ln": False}, {"tie_weights": False},
                                       {"bias": False}], ids=["pre-ln", "post-ln", "untied",
                                                              "no-bias"])
def test_logit_lens_after_the_last_layer_is_the_models_own_logits(idx, overrides):
    model = tiny_gpt(**overrides)
    lens = logit_lens(model, idx)  # (L + 1, B, T, V)
    assert lens.shape == (L + 1, 2, T, V)
    logits, _ = model(idx)
    torch.testing.assert_close(lens[-1], logits, rtol=0, atol=1e-5)
    # The earlier read-outs are something else: the lens shows layers, not copies.
    assert not torch.allclose(lens[0], lens[-1], atol=1e-3)


def test_trace_keeps_the_residual_stream_of_every_layer(idx):
    model = tiny_gpt()
    seen = trace(model, idx)
    assert seen.residuals.shape == (L + 1, 2, T, C)
    x = model.embed(idx, torch.arange(T))
    torch.testing.assert_close(seen.residuals[0], x)
    for layer, block in enumerate(model.blocks):
        x = block(x)
        torch.testing.assert_close(seen.residuals[layer + 1], x, rtol=0, atol=1e-6)


def test_attention_maps_rows_sum_to_one_and_never_look_ahead(idx):
    model = tiny_gpt()
    maps = attention_maps(model, idx)  # (L, B, H, T, T)
    assert maps.shape == (L, 2, H, T, T)
    torch.testing.assert_close(maps.sum(-1), torch.ones(L, 2, H, T))
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    assert (maps[..., future] == 0).all()
    assert (maps[..., ~future] > 0).all()
    torch.testing.assert_close(trace(model, idx).attention, maps)


def test_trace_runs_without_dropout_and_leaves_the_mode_as_it_was(idx):
    model = tiny_gpt(dropout=0.5)
    expected = trace(model, idx)
    model.train()
    again = trace(model, idx)
    assert model.training
    torch.testing.assert_close(again.attention, expected.attention)
    torch.testing.assert_close(again.residuals, expected.residuals)


def test_top_k_probabilities_are_the_largest_softmax_entries_in_order():
    logits = torch.randn(3, 5, V, generator=torch.Generator().manual_seed(2))
    top = top_k_probabilities(logits, 4)
    assert top.probs.shape == top.ids.shape == (3, 5, 4)
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(top.probs, probs.gather(-1, top.ids))
    expected = probs.sort(dim=-1, descending=True).values[..., :4]
    torch.testing.assert_close(top.probs, expected)
    assert top_k_probabilities(logits, 100).ids.shape[-1] == V  # k past V: every token


def test_top_k_refuses_a_k_that_is_not_positive():
    with pytest.raises(InputError, match="k must be a positive"):
        top_k_probabilities(torch.zeros(1, V), 0)


def test_next_token_top_k_reads_the_models_logits(idx):
    model = tiny_gpt()
    top = next_token_top_k(model, idx, 3)
    expected = torch.softmax(model(idx)[0], dim=-1).topk(3, dim=-1)
    torch.testing.assert_close(top.probs, expected.values)
    assert torch.equal(top.ids, expected.indices)


def test_logit_lens_top_k_matches_the_full_lens_layer_by_layer(idx):
    model = tiny_gpt()
    top = logit_lens_top_k(model, idx, 5)  # (L + 1, B, T, 5)
    full = top_k_probabilities(logit_lens(model, idx), 5)
    torch.testing.assert_close(top.probs, full.probs)
    assert torch.equal(top.ids, full.ids)
    last = next_token_top_k(model, idx, 5)
    torch.testing.assert_close(top.probs[-1], last.probs, rtol=0, atol=1e-6)
    residuals = trace(model, idx).residuals
    torch.testing.assert_close(lens_top_k(model, residuals, 5).probs, top.probs)
    torch.testing.assert_close(read_out(model, residuals[-1]), model(idx)[0], rtol=0,
                               atol=1e-5)


def test_too_long_input_is_an_input_error():
    model = tiny_gpt()
    with pytest.raises(InputError, match="longer than block_size"):
        trace(model, torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("overrides", [{}, {"tie_weights": False}, {"bias": False}],
                         ids=["tied", "untied", "no-bias"])
def test_parameter_counts_by_part_add_up_to_count_parameters(overrides):
    model = tiny_gpt(**overrides)
    parts = parameter_counts(model)
    assert sum(parts.values()) == count_parameters(model)
    assert "other" not in parts
    bias = overrides.get("bias", True)
    # Per block: qkv + proj = 4C^2 (+ 4C biases); the MLP 8C^2 (+ 5C); two LayerNorms 2C each.
    assert parts["attention"] == L * (4 * C * C + (4 * C if bias else 0))
    assert parts["ffn"] == L * (8 * C * C + (5 * C if bias else 0))
    assert parts["layernorm"] == (2 * L + 1) * (2 * C if bias else C)
    assert parts["embeddings"] == V * C + 8 * C  # token + position; a tied head lives here
    assert parts["lm_head"] == (V * C if overrides.get("tie_weights") is False else 0)


def test_parameter_counts_of_gpt2_small_match_the_published_total():
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(GPTConfig.from_preset("gpt2"))
    parts = parameter_counts(model)
    assert sum(parts.values()) == 124_439_808
    assert parts["embeddings"] == 50257 * 768 + 1024 * 768
