"""The stackable Transformer block: normalisation, attention, feed-forward and two residuals.

Shapes: B = batch, T = positions, C = width, F = the MLP's hidden width (4C by default).
A block maps (B, T, C) -> (B, T, C), which is what makes blocks stackable.
The MLPs: `FeedForward` (C -> F -> C with one activation, GPT-2's) and beside it `SwiGLUFeedForward`
(a gated MLP, Llama's and Qwen3's). The norms live in `glassgpt.norms`.
"""

from __future__ import annotations

from torch import Tensor, nn

from glassgpt.attention import MultiHeadSelfAttention, check_stream
from glassgpt.config import (
    ACTIVATIONS,
    check_choice,
    check_dropout,
    check_heads_divide_width,
    check_size,
)
from glassgpt.errors import ConfigError
from glassgpt.norms import ManualLayerNorm, make_norm

__all__ = ["FeedForward", "ManualLayerNorm", "ReLUSquared", "SwiGLUFeedForward",
           "TransformerBlock", "make_activation", "make_mlp"]


class ReLUSquared(nn.Module):
    """relu(x)^2: as sparse as ReLU, but smooth at 0 (Primer, So et al. 2021; the speedruns)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.relu().square()


def make_activation(name: str) -> nn.Module:
    """The activation module called `name`; unknown names are a ConfigError listing the choices."""
    check_choice("activation", name, ACTIVATIONS)
    if name == "swiglu":
        raise ConfigError("swiglu is a whole MLP (SwiGLUFeedForward), not an activation")
    if name == "relu":
        return nn.ReLU()
    if name == "relu2":
        return ReLUSquared()
    # "gelu" is exact (with erf); "gelu_tanh" is GPT-2's original approximation ("gelu_new").
    return nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


class FeedForward(nn.Module):
    """Position-wise MLP C -> F -> C (F = hidden_mult * C unless `hidden` is given), with
    dropout after the second layer."""

    def __init__(self, d_model: int, activation: str = "gelu", dropout: float = 0.0,
                 bias: bool = True, hidden_mult: int = 4, hidden: int | None = None):
        super().__init__()
        hidden = hidden_mult * d_model if hidden is None else hidden
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.act = make_activation(activation)
        self.proj = nn.Linear(hidden, d_model, bias=bias)
        check_dropout(dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))  # (B, T, F) inside


class SwiGLUFeedForward(nn.Module):
    """The gated MLP of Llama and Qwen3: proj(silu(gate(x)) * up(x)), C -> 2 x F -> C.

    One branch (gate, through SiLU) decides how much of the other (up) passes, feature by
    feature. Three matrices instead of two, so the hidden width F is usually ~8C/3 rather than 4C
    to keep the parameter count.
    """

    def __init__(self, d_model: int, hidden: int, dropout: float = 0.0, bias: bool = False):
        super().__init__()
        check_size("mlp_hidden", hidden, 4 * 2**18)
        self.gate = nn.Linear(d_model, hidden, bias=bias)
        self.up = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)  # `down_proj` in Hugging Face
        self.act = nn.SiLU()
        check_dropout(dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        gated = self.act(self.gate(x)) * self.up(x)  # (B, T, F)
        return self.dropout(self.proj(gated))  # (B, T, C)


def make_mlp(d_model: int, activation: str, dropout: float, bias: bool,
             hidden: int | None = None) -> nn.Module:
    """The block's MLP: `SwiGLUFeedForward` for "swiglu", else `FeedForward` with `activation`."""
    check_choice("activation", activation, ACTIVATIONS)
    if activation == "swiglu":
        return SwiGLUFeedForward(d_model, 4 * d_model if hidden is None else hidden, dropout, bias)
    return FeedForward(d_model, activation=activation, dropout=dropout, bias=bias, hidden=hidden)


class TransformerBlock(nn.Module):
    """One block, Pre-LN (default) or Post-LN.

    Pre-LN:  u = x + attn(ln1(x));  z = u + ffn(ln2(u))
    Post-LN: u = ln1(x + attn(x));  z = ln2(u + ffn(u))
    `residual=False` drops both skip connections (only the "why residuals" experiment wants that).
    With bias and the 4x MLP a block holds exactly 12C^2 + 13C parameters.
    `norm` picks `ln1`/`ln2` (layernorm | rmsnorm); `n_kv_heads`, `qk_norm`, `rotary` and
    `rope_theta` go to the attention, `mlp_hidden` to the MLP.
    """

    def __init__(self, d_model: int, n_heads: int, pre_ln: bool = True, dropout: float = 0.0,
                 activation: str = "gelu", bias: bool = True, causal: bool = True,
                 attn_impl: str = "fused", norm_eps: float = 1e-5, residual: bool = True, *,
                 norm: str = "layernorm", mlp_hidden: int | None = None,
                 n_kv_heads: int | None = None, qk_norm: bool = False, rotary: bool = False,
                 rope_theta: float = 10000.0):
        super().__init__()
        check_heads_divide_width(d_model, n_heads)  # before any layer is sized by them
        self.pre_ln, self.residual, self.d_model = pre_ln, residual, d_model
        self.ln1 = make_norm(norm, d_model, norm_eps, bias)
        self.attn = MultiHeadSelfAttention(d_model, n_heads, causal=causal, dropout=dropout,
                                           bias=bias, impl=attn_impl, n_kv_heads=n_kv_heads,
                                           qk_norm=qk_norm, rotary=rotary,
                                           rope_theta=rope_theta, norm_eps=norm_eps)
        self.ln2 = make_norm(norm, d_model, norm_eps, bias)
        self.ffn = make_mlp(d_model, activation, dropout, bias, mlp_hidden)

    def forward(self, x: Tensor, pad_mask: Tensor | None = None, return_attn: bool = False,
                start_pos: int | Tensor | None = None,
                head_mask: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T, C) -> z (B, T, C), plus attention weights (B, H, T, S) when `return_attn`.

        `head_mask` (H,) scales each attention head's output (zeros switch heads off)."""
        check_stream(x, self.d_model, self.attn.qkv.weight, "block")
        weights = None
        attn_in = self.ln1(x) if self.pre_ln else x
        a = self.attn(attn_in, pad_mask=pad_mask, return_attn=return_attn, start_pos=start_pos,
                      head_mask=head_mask)
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
