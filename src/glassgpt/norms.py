"""The two normalisations a block can use, written out: LayerNorm and RMSNorm.

Both take their statistics over the feature axis of each position on its own (never across
positions, which would let a later token change an earlier output).
    LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta    (GPT-2)
    RMSNorm:   y = x / sqrt(mean(x^2) + eps) * gamma                     (Llama, Qwen3, ...)
RMSNorm drops the centring and the shift: one statistic instead of two, and no bias.
The model uses `nn.LayerNorm` for LayerNorm (its fused kernel) and `RMSNorm` below for RMSNorm;
`ManualLayerNorm` exists for reading, and the tests hold each to its PyTorch sibling.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glassgpt.config import NORMS, check_choice


class ManualLayerNorm(nn.Module):
    """LayerNorm written out, for reading; `nn.LayerNorm` is what the model uses.

    Population variance (divide by C), eps inside the square root, then a learnable scale gamma
    and shift beta.
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


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last axis, with a learnable scale and no bias.

    Half-precision inputs are normalised in float32 and cast back before the scale, exactly as
    Hugging Face's Llama and Qwen3 do (so imported weights give their numbers); float32 and
    float64 inputs stay in their own precision.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # gamma

    def forward(self, x: Tensor) -> Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16/fp16 -> fp32
        mean_square = wide.pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
        x_hat = wide * torch.rsqrt(mean_square + self.eps)  # (..., dim)
        return self.weight * x_hat.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, dim: int, eps: float, bias: bool) -> nn.Module:
    """The normalisation `kind` ("layernorm" | "rmsnorm") over `dim` features.

    `bias` gives LayerNorm its shift beta; RMSNorm never has one (as in every model that uses it).
    """
    check_choice("norm", kind, NORMS)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps, bias=bias)
