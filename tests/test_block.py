"""The block and its parts: LayerNorm, the feed-forward network, and both residual layouts.

Shapes: B = batch, T = positions, C = width.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

from conftest import tiny_config
from glassgpt.block import (
    FeedForward,
    TransformerBlock,
    make_activation,
    post_ln_sublayers,
    pre_ln_sublayers,
    sandwich_sublayers,
)
from glassgpt.errors import ConfigError
from glassgpt.hooks import recorded
from glassgpt.model import count_parameters
from glassgpt.norms import ManualLayerNorm

B, T, C, H = 2, 6, 16, 4


def randomise_norm(norm: nn.Module) -> None:
    """Give gamma/beta values far from their 1/0 start, so a test sees them used."""
    with torch.no_grad():
        norm.weight.normal_()
        if norm.bias is not None:
            norm.bias.normal_()


# --- LayerNorm -----------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_manual_layernorm_equals_torch_layernorm(bias):
    manual = ManualLayerNorm(C, bias=bias).double()
    reference = nn.LayerNorm(C, bias=bias).double()
    randomise_norm(manual)
    reference.load_state_dict(manual.state_dict())
    x = torch.randn(B, T, C, dtype=torch.float64) * 3 + 1
    diff = (manual(x) - reference(x)).abs().max().item()
    print(f"bias={bias}: max |ManualLayerNorm - nn.LayerNorm| = {diff:.1e}")
    assert diff <= 1e-12
    assert (manual.bias is None) == (not bias)


def test_manual_layernorm_uses_population_variance_and_eps_inside_the_root():
    norm = ManualLayerNorm(4, eps=0.5).double()
    x = torch.tensor([[1.0, 2.0, 3.0, 6.0]], dtype=torch.float64)
    mean, var = 3.0, (4 + 1 + 0 + 9) / 4  # divide by C, not C - 1
    expected = (x - mean) / math.sqrt(var + 0.5)
    assert torch.allclose(norm(x), expected, atol=1e-15)


def test_layernorm_statistics_are_per_position():
    norm = ManualLayerNorm(C).double()
    x = torch.randn(1, T, C, dtype=torch.float64)
    y = norm(x)
    x_changed = x.clone()
    x_changed[0, -1] *= 50  # only the last position changes
    assert torch.equal(norm(x_changed)[0, :-1], y[0, :-1])
    assert torch.allclose(y.mean(-1), torch.zeros(1, T, dtype=torch.float64), atol=1e-12)


# --- feed-forward --------------------------------------------------------------------------

@pytest.mark.parametrize("name, reference", [
    ("gelu", lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))),
    ("gelu_tanh", lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                                      * (x + 0.044715 * x**3)))),
    ("relu", lambda x: x.clamp(min=0)),
])
def test_activations_are_what_they_say(name, reference):
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    assert torch.allclose(make_activation(name)(x), reference(x), atol=1e-12)
    ffn = FeedForward(C, activation=name).double()
    h = torch.randn(B, T, C, dtype=torch.float64)
    expected = ffn.proj(reference(ffn.fc(h)))
    assert torch.allclose(ffn(h), expected, atol=1e-12)


def test_gelu_and_gelu_tanh_differ():
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    assert (make_activation("gelu")(x) - make_activation("gelu_tanh")(x)).abs().max() > 1e-5


def test_feed_forward_is_c_to_4c_to_c_with_dropout_after_the_second_layer():
    ffn = FeedForward(C, dropout=0.5)
    assert ffn.fc.weight.shape == (4 * C, C) and ffn.proj.weight.shape == (C, 4 * C)
    h = torch.randn(B, T, C)
    ffn.train()
    y = ffn(h)
    undropped = ffn.proj(ffn.act(ffn.fc(h)))
    kept = y != 0
    assert (~kept).any()  # some outputs of the second layer were dropped ...
    assert torch.allclose(y[kept], 2 * undropped[kept])  # ... the rest scaled by 1 / (1 - p)
    ffn.eval()
    assert torch.equal(ffn(h), undropped)


def test_unknown_activation_is_an_error():
    with pytest.raises(ConfigError, match=r"'swish'.*gelu.*gelu_tanh.*relu"):
        make_activation("swish")
    with pytest.raises(ConfigError, match="'swish'"):
        TransformerBlock(C, H, activation="swish")


# --- the block -----------------------------------------------------------------------------

def make_block(**kwargs) -> TransformerBlock:
    block = TransformerBlock(C, H, **kwargs).double().eval()
    randomise_norm(block.ln1)
    randomise_norm(block.ln2)
    return block


def test_pre_ln_block_is_the_spec_formula():
    block = make_block(pre_ln=True)
    x = torch.randn(B, T, C, dtype=torch.float64)
    u = x + block.attn(block.ln1(x))
    z = u + block.ffn(block.ln2(u))  # the second residual adds to u, not to x
    assert (block(x) - z).abs().max() <= 1e-12


def test_post_ln_block_is_the_spec_formula():
    block = make_block(pre_ln=False)
    x = torch.randn(B, T, C, dtype=torch.float64)
    u = block.ln1(x + block.attn(x))
    z = block.ln2(u + block.ffn(u))
    assert (block(x) - z).abs().max() <= 1e-12


def test_pre_ln_or_post_ln_is_decided_once_when_the_block_is_built():
    """Each variant is its formula in a few straight lines, no branch per call, chosen when the
    block is built; `forward` calls it, so a subclass's own forward is never overridden."""
    pre, post = make_block(pre_ln=True), make_block(pre_ln=False)
    assert pre.sublayers is pre_ln_sublayers and post.sublayers is post_ln_sublayers
    assert "forward" not in vars(pre) and "forward" not in vars(post)
    for variant in (pre_ln_sublayers, sandwich_sublayers, post_ln_sublayers):
        body = inspect.getsource(variant).split('"""')[-1]  # the code after the docstring
        assert " if " not in body
        assert len(body.strip().splitlines()) <= 4  # 4 formula lines, the last one returns
    assert "residual" not in inspect.signature(TransformerBlock).parameters


def test_a_subclass_forward_runs_whatever_variant_the_config_picks():
    """An experiment's block overrides `forward`; the variant chosen at build time must not
    replace it (it did when the variant was bound to `forward` itself)."""
    class Doubled(TransformerBlock):
        def forward(self, x, pad_mask=None, start_pos=None):
            return 2 * x

    for switches in (dict(pre_ln=False), dict(post_norms=True)):
        block = Doubled.from_config(tiny_config(n_embd=C, n_head=H, **switches))
        x = torch.randn(B, T, C)
        assert torch.equal(block(x), 2 * x)


@pytest.mark.parametrize("pre_ln", [True, False])
def test_a_block_from_the_config_is_the_standalone_block(pre_ln):
    config = tiny_config(n_embd=C, n_head=H, pre_ln=pre_ln, activation="gelu", dropout=0.0)
    torch.manual_seed(0)
    standalone = TransformerBlock(C, H, pre_ln=pre_ln)
    torch.manual_seed(0)
    built = TransformerBlock.from_config(config)
    assert {k: v.shape for k, v in built.state_dict().items()} == \
        {k: v.shape for k, v in standalone.state_dict().items()}
    for a, b in zip(built.state_dict().values(), standalone.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the same parts, built in the same order
    x = torch.randn(B, T, C)
    assert torch.equal(built(x), standalone(x)) and built.pre_ln == pre_ln


@pytest.mark.parametrize("pre_ln", [True, False])
def test_block_passes_padding_and_returns_attention_weights(pre_ln):
    block = make_block(pre_ln=pre_ln)
    x = torch.randn(B, T, C, dtype=torch.float64)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, -2:] = True
    with recorded(block.attn.hook_pattern) as seen:  # the weights, at their hook point
        z = block(x, pad_mask=pad)
    weights = seen[0]
    assert z.shape == (B, T, C) and weights.shape == (B, H, T, T)
    assert torch.all(weights[1, :, :, -2:] == 0)
    assert (z - block(x, pad_mask=pad)).abs().max() <= 1e-12


@pytest.mark.parametrize("d_model, n_heads", [(8, 2), (24, 3), (64, 4), (100, 5), (256, 8)])
def test_block_has_12c2_plus_13c_parameters(d_model, n_heads):
    block = TransformerBlock(d_model, n_heads)
    assert count_parameters(block) == 12 * d_model**2 + 13 * d_model


def test_block_without_bias_has_12c2_parameters():
    block = TransformerBlock(32, 4, bias=False)
    assert count_parameters(block) == 12 * 32**2 + 2 * 32  # only the two LayerNorm gains remain


def test_standalone_block_keeps_pytorch_default_init():
    block = TransformerBlock(64, 4)
    # nn.Linear's default is uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), not GPT-2's N(0, 0.02).
    bound = 1 / math.sqrt(64)
    assert block.attn.qkv.weight.abs().max() <= bound
    assert block.attn.qkv.weight.abs().max() > 0.9 * bound
    assert torch.equal(block.ln1.weight, torch.ones(64))

