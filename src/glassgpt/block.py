"""The stackable Transformer block: LayerNorm, attention, feed-forward and two residuals.

Shapes: B = batch, T = positions, C = width. A block maps (B, T, C) -> (B, T, C), which is what
makes blocks stackable.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glassgpt.attention import MultiHeadSelfAttention
from glassgpt.config import ACTIVATIONS, check_choice, check_dropout


def make_activation(name: str) -> nn.Module:
    """The activation module called `name`; unknown names are a ConfigError listing the choices."""
    check_choice("activation", name, ACTIVATIONS)
    if name == "relu":
        return nn.ReLU()
    # "gelu" is exact (with erf); "gelu_tanh" is GPT-2's original approximation ("gelu_new").
    return nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


class ManualLayerNorm(nn.Module):
    """LayerNorm written out, for reading; `nn.LayerNorm` is what the model uses.

    Statistics are taken over the feature axis of each position on its own (never across
    positions, which would let a later token change an earlier output): population variance
    (divide by C), eps inside the square root, then a learnable scale gamma and shift beta.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))  # gamma
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None  # beta

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(dim=-1, keepdim=True)  # (B, T, 1)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # (B, T, 1)
        x_hat = (x - mean) / torch.sqrt(var + self.eps)  # (B, T, C)
        y = x_hat * self.weight
        return y if self.bias is None else y + self.bias


class FeedForward(nn.Module):
    """Position-wise MLP C -> 4C -> C, with dropout after the second layer."""

    def __init__(self, d_model: int, activation: str = "gelu", dropout: float = 0.0,
                 bias: bool = True, hidden_mult: int = 4):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden_mult * d_model, bias=bias)
        self.act = make_activation(activation)
        self.proj = nn.Linear(hidden_mult * d_model, d_model, bias=bias)
        check_dropout(dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))  # (B, T, 4C) inside


class TransformerBlock(nn.Module):
    """One block, Pre-LN (default) or Post-LN.

    Pre-LN:  u = x + attn(ln1(x));  z = u + ffn(ln2(u))
    Post-LN: u = ln1(x + attn(x));  z = ln2(u + ffn(u))
    `residual=False` drops both skip connections (only the "why residuals" experiment wants that).
    With bias and the 4x MLP a block holds exactly 12C^2 + 13C parameters.
    """

    def __init__(self, d_model: int, n_heads: int, pre_ln: bool = True, dropout: float = 0.0,
                 activation: str = "gelu", bias: bool = True, causal: bool = True,
                 attn_impl: str = "fused", ln_eps: float = 1e-5, residual: bool = True):
        super().__init__()
        self.pre_ln, self.residual = pre_ln, residual
        self.ln1 = nn.LayerNorm(d_model, eps=ln_eps, bias=bias)
        self.attn = MultiHeadSelfAttention(d_model, n_heads, causal=causal, dropout=dropout,
                                           bias=bias, impl=attn_impl)
        self.ln2 = nn.LayerNorm(d_model, eps=ln_eps, bias=bias)
        self.ffn = FeedForward(d_model, activation=activation, dropout=dropout, bias=bias)

    def forward(self, x: Tensor, pad_mask: Tensor | None = None, return_attn: bool = False,
                start_pos: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T, C) -> z (B, T, C), plus attention weights (B, H, T, S) when `return_attn`."""
        weights = None
        attn_in = self.ln1(x) if self.pre_ln else x
        a = self.attn(attn_in, pad_mask=pad_mask, return_attn=return_attn, start_pos=start_pos)
        if return_attn:
            a, weights = a
        u = x + a if self.residual else a
        if not self.pre_ln:
            u = self.ln1(u)

        f = self.ffn(self.ln2(u) if self.pre_ln else u)
        z = u + f if self.residual else f  # the second residual adds to u, not to x
        if not self.pre_ln:
            z = self.ln2(z)
        return (z, weights) if return_attn else z
