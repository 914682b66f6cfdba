"""The two normalisations a block can use, written out: LayerNorm and RMSNorm.

Both take their statistics over the feature axis of each position on its own (never across
positions, which would let a later token change an earlier output).
    LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta    (GPT-2)
    RMSNorm:   y = x / sqrt(mean(x^2) + eps) * gamma                     (Llama, Qwen3, ...)
RMSNorm drops the centring and the shift: one statistic instead of two, and no bias. Gemma
stores its gain as an offset, gamma = 1 + w with w starting at 0 (`norm_offset`), so weight
decay pulls the gain towards 1 rather than 0.
The model uses `LayerNorm` (PyTorch's fused kernel) and `RMSNorm` below; `ManualLayerNorm` exists
for reading, and the tests hold each to its PyTorch sibling. Each has two hook points with
TransformerLens's names: `hook_scale`, the divisor (B, T, 1) (sqrt(var + eps), or
sqrt(mean(x^2) + eps)), and `hook_normalized`, x_hat: normalised, before the gain.
`norm="none"` (TransformerLens's normalization_type=None) builds no norm at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.config import GPTConfig
from glassgpt.hooks import HookPoint, add_hook_points


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
        add_hook_points(self, "hook_scale", "hook_normalized")

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm_steps(x, self.weight, self.bias, self.eps, self.hook_scale,
                                self.hook_normalized)


def layer_norm_steps(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
                     hook_scale: HookPoint, hook_normalized: HookPoint) -> Tensor:
    """LayerNorm step by step: centre, divide by the standard deviation, scale, shift."""
    mean = x.mean(dim=-1, keepdim=True)  # (B, T, 1)
    var = x.var(dim=-1, keepdim=True, unbiased=False)  # (B, T, 1)
    centred = x - mean  # (B, T, C)
    scale = hook_scale(torch.sqrt(var + eps))  # (B, T, 1): the divisor, TransformerLens's scale
    x_hat = hook_normalized(centred / scale)  # (B, T, C)
    y = x_hat * weight
    return y if bias is None else y + bias


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (one fused kernel) with a hook point at x_hat.

    The fused kernel never forms x_hat or the scale it divides by, so while a hook is attached
    to `hook_normalized` or `hook_scale` the same numbers are computed in steps
    (`layer_norm_steps`) and pass through the points.
    """

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__(dim, eps=eps, bias=bias)
        add_hook_points(self, "hook_scale", "hook_normalized", decides_path=True)

    def forward(self, x: Tensor) -> Tensor:
        if self.hook_normalized.active or self.hook_scale.active:  # watched
            return layer_norm_steps(x, self.weight, self.bias, self.eps, self.hook_scale,
                                    self.hook_normalized)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last axis, with a learnable scale and no bias.

    Half-precision inputs are normalised in float32 and cast back before the scale, exactly as
    Hugging Face's Llama and Qwen3 do (so imported weights give their numbers); float32 and
    float64 inputs stay in their own precision. With `offset` the scale is 1 + weight (weight
    starts at 0), applied before the cast back, as Gemma's norm does.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False,
                 point_transpose: tuple[int, int] | None = None):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        # `point_transpose`: how hooks see x_hat where the input is not TransformerLens's
        # layout (QK-norm's q and k arrive as (B, H, T, d); their point shows (B, T, H, d)).
        add_hook_points(self, "hook_scale", "hook_normalized", decides_path=True,
                        transpose=point_transpose)

    @property
    def gain(self) -> Tensor:
        """The scale each feature is multiplied by: weight, or 1 + weight with `offset`."""
        return 1.0 + self.weight if self.offset else self.weight

    def forward(self, x: Tensor) -> Tensor:
        watched = self.hook_normalized.active or self.hook_scale.active
        if watched or not self._fused_computes_the_same(x):
            return self.steps(x)  # watched (x_hat must exist to be seen), or half precision
        # under autocast the gain takes x's precision, as a matmul's weight would
        return F.rms_norm(x, self.weight.shape, self.gain.to(x.dtype), self.eps)

    def _fused_computes_the_same(self, x: Tensor) -> bool:
        """Whether PyTorch's one-kernel RMSNorm gives `steps`'s numbers (or, under autocast,
        the numbers autocast asks for: training in bf16 spends a fifth of a QK-norm step here
        otherwise). A bf16 model outside autocast keeps the steps, which round x_hat to bf16
        before the gain exactly as transformers' Llama and Qwen3 do."""
        return _FUSED_RMS_NORM and (x.dtype in (torch.float32, torch.float64)
                                    or autocast_enabled(x.device.type))

    def steps(self, x: Tensor) -> Tensor:
        """RMSNorm written out: the mean square in float32 at least, x_hat, then the gain."""
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16/fp16 -> fp32
        mean_square = wide.pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
        x_hat = self.hook_normalized(wide * self.inverse_scale(mean_square))  # (..., dim)
        if self.offset:  # Gemma: (1 + w) in the wide precision, then cast
            return (x_hat * (1.0 + self.weight.to(wide.dtype))).to(x.dtype)
        return self.weight * x_hat.to(x.dtype)

    def inverse_scale(self, mean_square: Tensor) -> Tensor:
        """1 / sqrt(mean_square + eps), as rsqrt computes it (Hugging Face's arithmetic); the
        scale itself, sqrt(...), passes `hook_scale` when watched, and only a replaced scale
        is divided by (so reading it changes no number)."""
        inverse = torch.rsqrt(mean_square + self.eps)  # (..., 1)
        if not self.hook_scale.active:
            return inverse
        scale = torch.sqrt(mean_square + self.eps)
        seen = self.hook_scale(scale)
        return inverse if seen is scale else 1.0 / seen

    def extra_repr(self) -> str:
        offset = ", offset (1 + w)" if self.offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}"


_FUSED_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for `device_type` (any torch glassgpt runs on)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # an older torch without the device argument
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def make_norm(config: GPTConfig, dim: int | None = None) -> nn.Module:
    """The normalisation `config.norm` ("layernorm" | "rmsnorm" | "none") over `dim` features
    (default the width C), with `config.norm_eps`.

    `config.bias` gives LayerNorm its shift beta; RMSNorm never has one (as in every model that
    uses it).
    """
    dim = config.n_embd if dim is None else dim
    if config.norm == "none":  # TransformerLens's normalization_type=None: no norm, no point
        return nn.Identity()
    if config.norm == "rmsnorm":
        return RMSNorm(dim, eps=config.norm_eps, offset=config.norm_offset)
    return LayerNorm(dim, eps=config.norm_eps, bias=config.bias)
