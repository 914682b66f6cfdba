"""One function computes the attention scores (scale, soft-cap, window, mask): the model's
explicit path, the compiled CPU step's one query and every reader that explains a score use it,
and the readers (`glassgpt.interp.methods.lens`, `.heads`, the view) take the model's own
activations.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import tiny_gpt
from glassgpt import attention
from glassgpt.decoding import cpu
from glassgpt.interp import run_with_cache
from glassgpt.interp.methods.heads import head_steps
from glassgpt.interp.methods.lens import trace

SWITCHES = {
    "classic": {},
    "gemma-like": dict(position="rope", norm="rmsnorm", n_head=4, n_kv_head=2, bias=False,
                       sliding_window=3, local_layers=(0,), query_pre_attn_scalar=6.0,
                       attn_softcap=0.8, post_norms=True),
    "qknorm-window": dict(position="rope", qk_norm=True, sliding_window=4, local_layers=(1,),
                          attn_impl="explicit"),
}
T = 9


def model_of(switches):
    torch.manual_seed(0)
    return tiny_gpt(**{"vocab_size": 13, "block_size": 12, "n_layer": 2, "n_embd": 16,
                       "n_head": 2, **switches}).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 13, (2, T), generator=torch.Generator().manual_seed(3))


def q_and_k(cache, layer: int, rotary: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k the layer attended with, as the model keeps them: (B, heads, T, d)."""
    at = f"blocks.{layer}.attn.hook_{'rot_' if rotary else ''}"
    return cache[at + "q"].transpose(1, 2), cache[at + "k"].transpose(1, 2)


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_the_layers_scores_method_is_what_its_softmax_took(switches):
    model = model_of(switches)
    _, cache = run_with_cache(model, ids())
    for layer, block in enumerate(model.blocks):
        q, k = q_and_k(cache, layer, block.attn.rotary is not None)
        expected = cache[f"blocks.{layer}.attn.hook_attn_scores"]  # (B, H, T, T)
        assert torch.equal(block.attn.scores(q, k), expected)


def test_explicit_attention_takes_its_scores_from_attention_scores():
    q, k, v = torch.randn(3, 2, 4, 5, 8, generator=torch.Generator().manual_seed(0)).unbind(0)
    mask = attention.build_attention_mask(5, 5, True, None, q.device, window=2)
    seen = []
    attention.explicit_attention(q, k, v, mask, nn.Identity(), lambda s: seen.append(s) or s,
                                 scale=0.4,
                                 softcap=1.5)
    assert torch.equal(seen[0], attention.attention_scores(q, k, 0.4, 1.5, mask))
    capped = attention.soft_cap((q @ k.transpose(-2, -1)) * 0.4, 1.5)  # the formula, by hand
    torch.testing.assert_close(seen[0], capped.masked_fill(~mask, float("-inf")))


@pytest.mark.parametrize("one_query", [cpu.one_query_attention, cpu.one_query_matmul_attention])
def test_the_compiled_steps_one_query_applies_the_models_scale_and_cap(one_query):
    """The step fuses its own q . k products, then hands them to the attention's own scoring
    step (`MultiHeadSelfAttention.scored`, `scale_and_cap` with its scale and cap): the same
    step the explicit path takes, never a second copy of it, so a new scoring switch changes
    the attention and not the step."""
    attn = attention.MultiHeadSelfAttention(16, 2)
    attn.scale, attn.softcap = 0.3, 2.0  # Gemma's query_pre_attn_scalar and score cap
    calls = []

    def spy(products):
        calls.append(tuple(products.shape))
        return attn.scored(products)

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 2, 1, 8, generator=g), torch.randn(2, 1, 2, 6, 8, generator=g)[0], \
        torch.randn(1, 2, 6, 8, generator=g)
    out = one_query(q, k, v, spy)
    assert len(calls) == 1
    weights = torch.softmax(attention.attention_scores(q, k, 0.3, 2.0), dim=-1)  # (1, 2, 1, 6)
    torch.testing.assert_close(out, weights @ v, rtol=0, atol=1e-6)
    torch.testing.assert_close(attn.scored(q @ k.transpose(-2, -1)),
                               attention.attention_scores(q, k, 0.3, 2.0), rtol=0, atol=0)


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_the_decoding_steps_attention_is_the_models_last_row(switches):
    """A compiled step's attention (OneQueryAttention's one query, run eagerly) over the cached
    keys gives the model's own output of the last position: the pattern row times v."""
    model = model_of(switches)
    _, cache = run_with_cache(model, ids())
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        q, k = q_and_k(cache, layer, attn.rotary is not None)
        v = cache[f"blocks.{layer}.attn.hook_v"].transpose(1, 2)
        k, v = attention.repeat_kv(k, attn.groups), attention.repeat_kv(v, attn.groups)
        seen = slice(max(0, T - attn.window), T) if attn.window else slice(0, T)  # the band
        out = cpu.one_query_attention(q[:, :, -1:], k[:, :, seen], v[:, :, seen],
                                      attn.scored)  # (B, H, 1, d)
        z = cache[f"blocks.{layer}.attn.hook_z"][:, -1:].transpose(1, 2)  # (B, H, 1, d)
        torch.testing.assert_close(out, z, rtol=0, atol=1e-6)


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_the_explainers_numbers_are_the_models_activations(switches):
    model = model_of(switches)
    one = ids()[:1]
    _, cache = run_with_cache(model, one)
    seen = trace(model, one)
    for layer, block in enumerate(model.blocks):
        at = f"blocks.{layer}.attn."
        assert torch.equal(seen.scores[layer], cache[at + "hook_attn_scores"])
        assert torch.equal(seen.attention[layer], cache[at + "hook_pattern"])
        q, k = q_and_k(cache, layer, block.attn.rotary is not None)
        for head in range(block.attn.n_heads):
            steps = head_steps(model, one, layer, head, T - 1)
            row = block.attn.scores(q, k)[0, head, T - 1]  # (T,)
            assert torch.equal(steps.scores, row)
            assert torch.equal(steps.weights, cache[at + "hook_pattern"][0, head, T - 1])
            assert torch.equal(steps.visible, row != float("-inf"))
            assert torch.equal(steps.mixed, cache[at + "hook_z"][0, T - 1, head])


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_the_readers_reproduce_the_old_explicit_formulas(switches):
    """What the view used to recompute by hand (ln1, the projections, q . k scaled, capped and
    masked, the softmax, weights @ v) equals what it now reads from the run, within 1e-6."""
    model = model_of(switches)
    one = ids()[:1]
    seen = trace(model, one)
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        x = seen.residuals[layer]
        with torch.no_grad():
            q, k, v = attn.project(block.ln1(x) if block.pre_ln else x)
        k, v = attention.repeat_kv(k, attn.groups), attention.repeat_kv(v, attn.groups)
        scores = attention.soft_cap((q @ k.transpose(-2, -1)) * attention.score_scale(
            attn.head_dim, attn.scale), attn.softcap)
        mask = attention.build_attention_mask(T, T, True, None, x.device, attn.window)
        scores = scores.masked_fill(~mask, float("-inf"))
        torch.testing.assert_close(seen.scores[layer], scores, rtol=0, atol=1e-6)
        weights = torch.softmax(scores, dim=-1)
        torch.testing.assert_close(seen.attention[layer], weights, rtol=0, atol=1e-6)
        steps = head_steps(model, one, layer, 1, T - 2)
        torch.testing.assert_close(steps.mixed, (weights @ v)[0, 1, T - 2], rtol=0, atol=1e-6)
        if block.pre_ln:
            torch.testing.assert_close(steps.normed, block.ln1(x)[0, T - 2], rtol=0, atol=1e-6)
