"""The compiled decoding step changes the speed, not the tokens.

`generate(..., compiled=True)` runs every cached step through `torch.compile`, where one-row
products become reductions (`Linear._one_row_reduction`) and the single query's attention becomes
reductions too (`one_query_attention`). Each piece is checked against its eager reference, and
whole generations against eager decoding, token for token. Shapes: B = batch, T = prompt length.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from glassgpt.attention import one_query_attention
from glassgpt.config import GPTConfig
from glassgpt.generate import compiled_step
from glassgpt.linear import Linear
from glassgpt.model import GPT

V, BLOCK = 37, 24


@pytest.fixture(autouse=True)
def compiled_for_real():
    """Fail rather than fall back to eager (which would pass trivially) if dynamo ever gives up
    after too many recompilations: every model shape in a test session compiles once."""
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=64):
        yield


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    settings = dict(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32) | overrides
    return GPT(GPTConfig(**settings)).eval()


def prompt(B: int, T: int) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(10 * B + T))


# --- the pieces -----------------------------------------------------------------------------

@pytest.mark.parametrize("S", [1, 7])
def test_one_query_attention_equals_sdpa_float64(S):
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (1, S, S))
    expected = F.scaled_dot_product_attention(q, k, v)  # one query sees every key
    torch.testing.assert_close(one_query_attention(q, k, v), expected, rtol=1e-12, atol=1e-12)


def test_one_query_attention_scales_by_one_over_sqrt_head_width():
    q = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    k = torch.stack([torch.zeros(4), torch.ones(4)]).to(torch.float64).view(1, 1, 2, 4)
    v = torch.tensor([[0.0], [1.0]], dtype=torch.float64).view(1, 1, 2, 1)
    weight_on_second = 1 / (1 + math.exp(-4 / math.sqrt(4)))  # scores 0 and 4/sqrt(d)
    assert one_query_attention(q, k, v).item() == pytest.approx(weight_on_second, rel=1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_compiled_one_row_product_equals_f_linear(bias):
    torch.manual_seed(0)
    linear = Linear(48, 40, bias=bias)
    x = torch.randn(1, 1, 48)
    compiled = torch.compile(linear, fullgraph=True)
    torch.testing.assert_close(compiled(x), F.linear(x, linear.weight, linear.bias),
                               rtol=1e-5, atol=1e-6)


# --- whole generations ----------------------------------------------------------------------

VARIANTS = {
    "pre-ln gelu": {},
    "post-ln gelu_tanh, no bias": dict(pre_ln=False, activation="gelu_tanh", bias=False),
    "relu, untied, explicit attention": dict(activation="relu", tie_weights=False,
                                             attn_impl="explicit"),
}
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "top_k+top_p": dict(temperature=1.0, top_k=10, top_p=0.9, seed=3),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> GPT:
    return tiny_gpt(**VARIANTS[request.param])


@pytest.mark.parametrize("kind", SAMPLING)
@pytest.mark.parametrize("B, T, new", [
    (1, 5, 12),  # the shape decoding is tuned for
    (2, 3, 8),  # a batch: rows take the plain matmul path inside the compiled step
    (1, 4, 2 * BLOCK),  # runs past block_size, where the window slides by recomputation
])
def test_compiled_decoding_gives_exactly_the_eager_tokens(variant, kind, B, T, new):
    idx = prompt(B, T)
    eager = variant.generate(idx, new, **SAMPLING[kind])
    assert torch.equal(variant.generate(idx, new, compiled=True, **SAMPLING[kind]), eager)


def test_compiled_logits_match_eager_step_by_step():
    model = tiny_gpt(seed=1)
    idx = prompt(1, 6)
    eager = []
    model.setup_kv_cache(1)
    with torch.no_grad():
        model(idx[:, :3], start_pos=0)
        for pos in range(3, 6):
            eager.append(model(idx[:, pos:pos + 1], start_pos=pos, last_only=True)[0][:, -1])
        model(idx[:, :3], start_pos=0)  # the same cache contents again
        for pos, expected in zip(range(3, 6), eager, strict=True):
            got = compiled_step()(model, idx[:, pos:pos + 1], pos)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    model.remove_kv_cache()


def test_one_compilation_serves_every_position_prompt_and_call():
    model = tiny_gpt(seed=2)
    model.generate(prompt(1, 2), 3, temperature=0.0, compiled=True)  # compiles here
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T, new in [(1, 5), (7, 9), (3, BLOCK - 3)]:
            model.generate(prompt(1, T), new, temperature=0.0, compiled=True)


def test_compiled_bf16_decoding_runs_and_mostly_agrees():
    model = tiny_gpt(seed=3)
    idx = prompt(1, 4)
    fp32 = model.generate(idx, 10, temperature=0.0)
    half = model.to(torch.bfloat16).generate(idx, 10, temperature=0.0, compiled=True)
    assert half.shape == fp32.shape and half.dtype == torch.long
    assert torch.equal(half[:, :6], fp32[:, :6])  # rounding may part them late, not at once
