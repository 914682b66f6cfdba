"""The lecture's interface (SPEC §1) as a contract: `forward(x, pad_mask=None, return_attn=False)`
on `MultiHeadSelfAttention` and `TransformerBlock`, `pad_mask` positional, `return_attn=True`
giving `(y, weights)` with weights `(B, H, T, T)` equal to `nn.MultiheadAttention`'s, and a
subclass of the block written as the lecture writes it. The weights are `hook_pattern`'s tensor
itself (one source: no second softmax)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor, nn

from glassgpt import MultiHeadSelfAttention, TransformerBlock
from glassgpt.experiments.references import to_torch_multihead
from glassgpt.hooks import recorded

B, T, C, H = 2, 6, 24, 3


@pytest.mark.parametrize("cls", [MultiHeadSelfAttention, TransformerBlock])
def test_forward_keeps_the_specs_signature(cls: type) -> None:
    parameters = list(inspect.signature(cls.forward).parameters.values())
    assert [p.name for p in parameters[:4]] == ["self", "x", "pad_mask", "return_attn"]
    assert parameters[2].default is None and parameters[3].default is False
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters[1:4])


def padded_input(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    torch.manual_seed(0)
    x = torch.randn(B, T, C, dtype=dtype)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, -2:] = True  # the second sequence is two tokens shorter
    return x, pad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_return_attn_weights_equal_torch_multihead_attention(causal: bool,
                                                             dtype: torch.dtype) -> None:
    """The lecture's demo 2: the weights (B, H, T, T) against need_weights=True,
    average_attn_weights=False, with padding given positionally (real queries compared: a
    padding query's row is never used)."""
    x, pad = padded_input(dtype)
    attn = MultiHeadSelfAttention(C, H, causal=causal).to(dtype).eval()
    y, weights = attn(x, pad, return_attn=True)
    assert weights.shape == (B, H, T, T)
    mha = to_torch_multihead(attn).eval()
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1) if causal else None
    y_mha, w_mha = mha(x, x, x, key_padding_mask=pad, attn_mask=future, need_weights=True,
                       average_attn_weights=False)
    real = ~pad  # (B, T)
    assert (y - y_mha)[real].abs().max().item() <= 1e-6
    assert (weights - w_mha).transpose(1, 2)[real].abs().max().item() <= 1e-6
    # The same output as without return_attn (there: the fused path, SDPA).
    assert (attn(x, pad) - y)[real].abs().max().item() <= 1e-6
    assert torch.equal(attn(x, pad_mask=pad), attn(x, pad))


def test_the_weights_are_the_tensor_hook_pattern_sees() -> None:
    """One source: what return_attn hands back is hook_pattern's output, a hook's replacement
    included, and no hook stays attached after the call."""
    x, _ = padded_input(torch.float32)
    attn = MultiHeadSelfAttention(C, H).eval()
    with recorded(attn.hook_pattern) as seen:
        _, weights = attn(x, return_attn=True)
    assert weights is seen[0]
    uniform = torch.full((B, H, T, T), 1.0 / T)
    handle = attn.hook_pattern.register_forward_hook(lambda module, inputs, output: uniform)
    try:
        y, weights = attn(x, return_attn=True)
    finally:
        handle.remove()
    assert weights is uniform
    v = attn.project(x)[2]  # (B, H, T, d): the pattern above averages the values
    expected = attn.proj(v.mean(dim=2, keepdim=True).expand(-1, -1, T, -1).transpose(1, 2)
                         .reshape(B, T, C))
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)
    assert not attn.hook_pattern.active


class LectureBlock(TransformerBlock):
    """The lecture's subclass (demo 6): its own forward, the attention called positionally."""

    def forward(self, x: Tensor, pad_mask: Tensor | None = None,
                return_attn: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        a, weights = self.attn(self.ln1(x), pad_mask, return_attn=True)
        u = x + a
        z = u + self.ffn(self.ln2(u))
        return (z, weights) if return_attn else z


@pytest.mark.parametrize("pre_ln", [True, False])
def test_a_block_returns_its_attention_weights(pre_ln: bool) -> None:
    x, pad = padded_input(torch.float32)
    block = TransformerBlock(C, H, pre_ln=pre_ln).eval()
    z, weights = block(x, pad, return_attn=True)
    assert (z - block(x, pad, return_attn=False))[~pad].abs().max().item() <= 1e-6
    attn_input = block.ln1(x) if pre_ln else x
    expected = block.attn(attn_input, pad, return_attn=True)[1]
    assert weights.shape == (B, H, T, T)
    torch.testing.assert_close(weights, expected, atol=0, rtol=0)


def test_the_lectures_subclass_of_the_block_runs() -> None:
    x, pad = padded_input(torch.float32)
    block = TransformerBlock(C, H).eval()
    lecture = LectureBlock(C, H).eval()
    lecture.load_state_dict(block.state_dict())
    z, weights = lecture(x, pad, return_attn=True)
    z_block, w_block = block(x, pad, return_attn=True)
    real = ~pad
    assert (z - z_block)[real].abs().max().item() <= 1e-6
    torch.testing.assert_close(weights, w_block, atol=1e-7, rtol=0)
    assert torch.equal(lecture(x, pad), z)
    assert isinstance(lecture.attn, MultiHeadSelfAttention) and isinstance(lecture.ffn, nn.Module)
