"""glassgpt.interp.methods.lens and .heads: the computations behind `glassgpt view`, checked
against the model itself."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from conftest import tiny_gpt
from glassgpt import attention as attention_module
from glassgpt import block as block_module
from glassgpt import norms as norms_module
from glassgpt.config import GPTConfig
from glassgpt.decoding.sampling import sampling_distribution
from glassgpt.errors import InputError
from glassgpt.interp.methods.heads import head_steps, step_points
from glassgpt.interp.methods.lens import (
    Ablation,
    attention_maps,
    lens_top_k,
    logit_lens,
    logit_lens_top_k,
    next_token_top_k,
    prompt_loss,
    read_out,
    top_k_probabilities,
    trace,
)
from glassgpt.model import GPT, count_parameters
from glassgpt.view.card import parameter_counts

L, H, C, V, T = 2, 2, 16, 11, 7


def lens_gpt(**overrides) -> GPT:
    """The shared tiny GPT with this module's vocabulary and context, in eval mode."""
    return tiny_gpt(**{"vocab_size": V, "block_size": 8, "n_layer": L, "n_head": H,
                       "n_embd": C, **overrides}).eval()


@pytest.fixture(scope="module")
def idx() -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))  # (B, T)


@pytest.mark.parametrize("overrides", [{}, {"pre_ln": False}, {"tie_weights": False},
                                       {"bias": False}], ids=["pre-ln", "post-ln", "untied",
                                                              "no-bias"])
def test_logit_lens_after_the_last_layer_is_the_models_own_logits(idx, overrides):
    model = lens_gpt(**overrides)
    lens = logit_lens(model, idx)  # (L + 1, B, T, V)
    assert lens.shape == (L + 1, 2, T, V)
    logits, _ = model(idx)
    torch.testing.assert_close(lens[-1], logits, rtol=0, atol=1e-5)
    # The earlier read-outs are something else: the lens shows layers, not copies.
    assert not torch.allclose(lens[0], lens[-1], atol=1e-3)


def test_trace_keeps_the_residual_stream_of_every_layer(idx):
    model = lens_gpt()
    seen = trace(model, idx)
    assert seen.residuals.shape == (L + 1, 2, T, C)
    x = model.embed(idx, torch.arange(T))
    torch.testing.assert_close(seen.residuals[0], x)
    for layer, block in enumerate(model.blocks):
        x = block(x)
        torch.testing.assert_close(seen.residuals[layer + 1], x, rtol=0, atol=1e-6)


def test_attention_maps_rows_sum_to_one_and_never_look_ahead(idx):
    model = lens_gpt()
    maps = attention_maps(model, idx)  # (L, B, H, T, T)
    assert maps.shape == (L, 2, H, T, T)
    torch.testing.assert_close(maps.sum(-1), torch.ones(L, 2, H, T))
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    assert (maps[..., future] == 0).all()
    assert (maps[..., ~future] > 0).all()
    torch.testing.assert_close(trace(model, idx).attention, maps)


def test_trace_runs_without_dropout_and_leaves_the_mode_as_it_was(idx):
    model = lens_gpt(dropout=0.5)
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
    model = lens_gpt()
    top = next_token_top_k(model, idx, 3)
    expected = torch.softmax(model(idx)[0], dim=-1).topk(3, dim=-1)
    torch.testing.assert_close(top.probs, expected.values)
    assert torch.equal(top.ids, expected.indices)


def test_logit_lens_top_k_matches_the_full_lens_layer_by_layer(idx):
    model = lens_gpt()
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
    model = lens_gpt()
    with pytest.raises(InputError, match="longer than block_size"):
        trace(model, torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("overrides", [{}, {"tie_weights": False}, {"bias": False}],
                         ids=["tied", "untied", "no-bias"])
def test_parameter_counts_by_part_add_up_to_count_parameters(overrides):
    model = lens_gpt(**overrides)
    parts = parameter_counts(model)
    assert sum(parts.values()) == count_parameters(model)
    assert "other" not in parts
    bias = overrides.get("bias", True)
    # Per block: qkv + proj = 4C^2 (+ 4C biases); the MLP 8C^2 (+ 5C); two LayerNorms 2C each.
    assert parts["attention"] == L * (4 * C * C + (4 * C if bias else 0))
    assert parts["ffn"] == L * (8 * C * C + (5 * C if bias else 0))
    assert parts["norm"] == (2 * L + 1) * (2 * C if bias else C)
    assert parts["embeddings"] == V * C + 8 * C  # token + position; a tied head lives here
    assert parts["lm_head"] == (V * C if overrides.get("tie_weights") is False else 0)


def test_parameter_counts_of_gpt2_small_match_the_published_total():
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(GPTConfig.from_preset("gpt2"))
    parts = parameter_counts(model)
    assert sum(parts.values()) == 124_439_808
    assert parts["embeddings"] == 50257 * 768 + 1024 * 768


# --- inside one head -------------------------------------------------------------------------

ARCHITECTURES = {"gpt2": {}, "post-ln": {"pre_ln": False},
                 "modern": {"position": "rope", "norm": "rmsnorm", "activation": "swiglu",
                            "n_head": 4, "n_kv_head": 2, "qk_norm": True, "bias": False}}


@pytest.mark.parametrize("overrides", ARCHITECTURES.values(), ids=ARCHITECTURES.keys())
def test_one_head_step_by_step_has_the_models_own_numbers(idx, overrides):
    torch.manual_seed(0)
    model = lens_gpt(**overrides)
    one = idx[:1]  # (1, T)
    seen = trace(model, one)
    layer, position = 1, 5
    block = model.blocks[layer]
    attn_in = block.ln1(seen.residuals[layer]) if block.pre_ln else seen.residuals[layer]
    q, k, v = block.attn.project(attn_in)  # the module's own projections
    heads = block.attn.n_heads
    steps = [head_steps(model, one, layer, h, position) for h in range(heads)]
    for h, step in enumerate(steps):
        kv = h // (heads // block.attn.n_kv_head)
        assert step.kv_head == kv
        torch.testing.assert_close(step.residual, seen.residuals[layer][0, position])
        torch.testing.assert_close(step.q, q[0, h, position])
        torch.testing.assert_close(step.keys, k[0, kv])
        assert step.visible.tolist() == [t <= position for t in range(T)]
        # The softmax row is the model's own attention map row, zero on the future.
        torch.testing.assert_close(step.weights, seen.attention[layer, 0, h, position],
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(step.mixed, step.weights @ v[0, kv], rtol=0, atol=1e-6)
    # The heads' contributions (and W_O's bias) add up to what the attention adds at p.
    total = sum(step.contribution for step in steps)
    if block.attn.proj.bias is not None:
        total = total + block.attn.proj.bias
    torch.testing.assert_close(total, block.attn(attn_in)[0, position], rtol=0, atol=1e-5)


@pytest.mark.parametrize("switches", [{}, dict(position="rope", qk_norm=True)],
                         ids=["classic", "rotary+qknorm"])
def test_each_step_names_the_line_that_computes_it(idx, switches):
    """The line is the one that calls the step's hook point (found while the block runs, not
    by searching the source for text), so renaming a variable there cannot break it."""
    model = lens_gpt(**switches)
    steps = head_steps(model, idx[:1], 0, 1, 3)
    points = step_points(model.blocks[0])
    files = {"attention.py": Path(attention_module.__file__),
             "block.py": Path(block_module.__file__), "norms.py": Path(norms_module.__file__)}
    for name, point in points.items():
        source = steps.sources[name]
        assert point.rsplit(".", 1)[-1] + "(" in source.text, (name, source)
        line = files[source.file].read_text().splitlines()[source.line - 1]
        assert line.strip() == source.text
    assert "rot_q" in points["q"] if switches else points["q"] == "attn.hook_q"


def test_one_head_refuses_what_does_not_exist(idx):
    model = lens_gpt()
    for layer, head, position in [(L, 0, 0), (0, H, 0), (0, 0, T)]:
        with pytest.raises(InputError, match="does not exist"):
            head_steps(model, idx[:1], layer, head, position)
    with pytest.raises(InputError, match=r"\(1, T\)"):
        head_steps(model, idx, 0, 0, 0)


def test_scores_before_the_softmax_give_the_weights_and_mask_the_future(idx):
    model = lens_gpt()
    seen = trace(model, idx)
    scores = seen.scores[1]  # (B, H, T, T)
    assert torch.isinf(scores.triu(1)[..., 0, 1:]).all()
    torch.testing.assert_close(torch.softmax(scores, dim=-1), seen.attention[1], rtol=0,
                               atol=1e-6)


# --- ablation --------------------------------------------------------------------------------

def logits_of(model: GPT, idx: torch.Tensor, ablation: Ablation | None = None) -> torch.Tensor:
    return read_out(model, trace(model, idx, ablation).residuals[-1])


@pytest.mark.parametrize("overrides", ARCHITECTURES.values(), ids=ARCHITECTURES.keys())
def test_a_head_switched_off_is_a_model_whose_head_rows_of_w_o_are_zero(idx, overrides):
    torch.manual_seed(0)
    model = lens_gpt(**overrides)
    layer, head = 1, 1
    by_hand = copy.deepcopy(model)
    d = model.config.n_embd // model.config.n_head
    with torch.no_grad():  # W_O reads head h from its inputs h*d..(h+1)*d
        by_hand.blocks[layer].attn.proj.weight[:, head * d:(head + 1) * d] = 0.0
    ablated = logits_of(model, idx, Ablation(heads=[(layer, head)]))
    torch.testing.assert_close(ablated, by_hand(idx)[0], rtol=0, atol=1e-5)
    assert not torch.allclose(ablated, model(idx)[0], atol=1e-4)  # it changed something
    torch.testing.assert_close(logits_of(model, idx), model(idx)[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("part", ["attention", "mlp"])
def test_a_layers_attention_or_mlp_switched_off_is_that_output_zeroed_by_hand(idx, part):
    model = lens_gpt()
    by_hand = copy.deepcopy(model)
    sub_layer = by_hand.blocks[0].attn if part == "attention" else by_hand.blocks[0].ffn
    with torch.no_grad():
        sub_layer.proj.weight.zero_()
        sub_layer.proj.bias.zero_()
    ablated = logits_of(model, idx, Ablation(**{part: [0]}))
    torch.testing.assert_close(ablated, by_hand(idx)[0], rtol=0, atol=1e-5)
    # The switches are gone after the pass: the model is intact again.
    torch.testing.assert_close(model(idx)[0], logits_of(model, idx), rtol=0, atol=1e-5)
    assert not model.blocks[0].attn._forward_hooks and not model.blocks[0].ffn._forward_hooks


def test_an_ablation_of_what_does_not_exist_is_refused(idx):
    model = lens_gpt()
    for ablation in [Ablation(heads=[(L, 0)]), Ablation(heads=[(0, H)]), Ablation(mlp=[-1])]:
        with pytest.raises(InputError, match="does not exist"):
            trace(model, idx, ablation)
    assert Ablation(heads=[(1, 0), (0, 1)]) == Ablation(heads=[(0, 1), (1, 0)])
    assert not Ablation()


def test_the_loss_on_the_prompt_is_the_models_loss(idx):
    model = lens_gpt()
    with torch.no_grad():
        _, loss = model(idx[:, :-1], idx[:, 1:])
    assert prompt_loss(model, trace(model, idx), idx) == pytest.approx(loss.item(), abs=1e-5)
    assert prompt_loss(model, trace(model, idx[:, :1]), idx[:, :1]) is None


# --- what sampling draws from ----------------------------------------------------------------

def test_the_sampling_distribution_follows_temperature_and_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(sampling_distribution(logits), torch.softmax(logits, -1))
    hot = sampling_distribution(logits, temperature=2.0)
    torch.testing.assert_close(hot, torch.softmax(logits / 2, -1))
    assert hot[0, 0] < torch.softmax(logits, -1)[0, 0]  # a higher temperature flattens it
    kept = sampling_distribution(logits, top_k=2)
    torch.testing.assert_close(kept, torch.tensor([[0.7311, 0.2689, 0.0, 0.0]]), atol=1e-4,
                               rtol=0)
    for greedy in (0.0, 1e-300):
        assert sampling_distribution(logits, temperature=greedy).tolist() == [[1, 0, 0, 0]]
    with pytest.raises(InputError, match="temperature"):
        sampling_distribution(logits, temperature=-1.0)
