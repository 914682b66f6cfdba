"""`glassgpt.linear.Linear`: the threaded one-row path computes exactly what nn.Linear does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from glassgpt.config import GPTConfig
from glassgpt.linear import Linear
from glassgpt.model import GPT


@pytest.fixture()
def threads() -> Iterator[None]:
    """Two threads for the test (conftest pins one), so the one-row path really runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def input_major(linear: Linear) -> Linear:
    with torch.no_grad():
        linear.weight.data = linear.weight.data.t().contiguous().t()
    return linear


@pytest.mark.parametrize("layout", ["default", "input-major"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 24), (24,)])
@pytest.mark.parametrize("out_features", [30, 31])  # even split, and one column left over
def test_one_row_path_equals_f_linear(threads, layout, bias, shape, out_features):
    linear = Linear(24, out_features, bias=bias)
    if layout == "input-major":
        input_major(linear)
    x = torch.randn(shape, requires_grad=True)
    y = linear(x)
    expected = F.linear(x, linear.weight, linear.bias)
    assert y.shape == expected.shape == (*shape[:-1], out_features)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(y.sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_many_rows_and_bf16_take_the_plain_path(threads):
    linear = Linear(24, 30)
    x = torch.randn(3, 24)
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
    half, row = linear.to(torch.bfloat16), torch.randn(1, 24, dtype=torch.bfloat16)
    assert torch.equal(half(row), F.linear(row, half.weight, half.bias))


def test_threaded_decoding_changes_no_token(threads):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=67, block_size=24, n_layer=2, n_head=2, n_embd=32)).eval()
    prompt = torch.randint(0, 67, (1, 5))
    cached = model.generate(prompt, 12, temperature=0.0)
    assert torch.equal(model.generate(prompt, 12, temperature=0.0, use_cache=False), cached)
    model.input_major_weights()
    assert torch.equal(model.generate(prompt, 12, temperature=0.0), cached)
    assert torch.equal(model.generate(prompt, 12, temperature=0.0, use_cache=False), cached)


def test_a_compiled_training_step_is_one_graph(threads):
    """Thread counts are not traceable: Linear must decide its path without asking for them
    under torch.compile, or every layer splits the compiled graph (fullgraph makes that fail)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=16))
    idx, targets = torch.randint(0, 29, (2, 8)), torch.randint(0, 29, (2, 8))
    eager_logits, eager_loss = model(idx, targets)
    logits, loss = torch.compile(model, fullgraph=True)(idx, targets)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
