"""Rotary position embeddings (RoPE, Su et al. 2021): positions as rotations of q and k.

Instead of adding a learned vector per position to the input, rotary turns each pair of
features of a query or key by an angle proportional to its position p:
    pair i of head width d rotates by p * theta_i,   theta_i = rope_theta ** (-2i / d)
A dot product of two rotated vectors depends only on the difference of their angles, so the
attention score of query p and key s depends on the offset p - s, never on p or s alone (a
property test checks exactly that), and nothing limits p to the positions seen in training.

Layout: "rotate-half", the one Hugging Face Llama uses, so weights import without a permutation.
Pair i is features (i, i + d/2): the first half of a head holds the x's, the second the y's.
    rotate(x) = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1]
Scaling (`RopeScaling`) stretches the wavelengths 2 pi / theta_i, so that a model trained on
a short context reads a longer one: "linear" divides every theta_i by `factor` (positions
interpolated); "llama3" (Llama 3.1 and 3.2) divides only the slow pairs, those whose wavelength
exceeds original_context / low_freq_factor, keeps the fast ones, below original_context /
high_freq_factor, and blends the pairs between, so local detail keeps its resolution.
Shapes: B = batch, H = heads, T = positions, d = head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassgpt.config import AttentionKind, GPTConfig


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling: its kind ("linear" or "llama3") and settings (GPTConfig's rope_*)."""

    kind: str
    factor: float
    low_freq_factor: float | None = None  # llama3 only, like the two below
    high_freq_factor: float | None = None
    original_context: int | None = None

    @classmethod
    def from_config(cls, config: GPTConfig) -> RopeScaling | None:
        """The scaling `config` asks for (checked there), or None."""
        if config.rope_scaling is None:
            return None
        return cls(config.rope_scaling, config.rope_factor, config.rope_low_freq_factor,
                   config.rope_high_freq_factor, config.rope_original_context)

    def apply(self, inv_freq: Tensor) -> Tensor:
        """theta_i (d/2,) -> the scaled theta_i (d/2,)."""
        slowed = inv_freq / self.factor
        if self.kind == "linear":
            return slowed
        low, high, context = self.low_freq_factor, self.high_freq_factor, self.original_context
        wavelength = 2 * math.pi / inv_freq  # positions per turn of each pair
        # 0 for the slow pairs (wavelength >= context / low), 1 for the fast ones (<= context /
        # high), a straight line in context / wavelength between them.
        keep = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - keep) * slowed + keep * inv_freq


def rotary_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                       dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """theta_i = theta ** (-2i / d) for the d/2 pairs, scaled by `scaling`: (d/2,) in dtype."""
    half = torch.arange(0, head_dim, 2, device=device, dtype=dtype)  # (d/2,)
    inv_freq = 1.0 / (theta ** (half / head_dim))
    return inv_freq if scaling is None else scaling.apply(inv_freq)


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last axis (x1, x2 its halves): a quarter turn of each pair."""
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (..., d/2)
    return torch.cat((-x2, x1), dim=-1)  # (..., d)


class RotaryEmbedding(nn.Module):
    """Rotates q or k (B, H, T, d) by the angles of their absolute positions (T,).

    It holds no tensors: the angles are computed for the positions asked (at least in float32,
    as Hugging Face does, and in float64 for a float64 model), so a KV cache's offset, a model
    cast to bf16 and a sequence longer than any seen in training all get exact angles.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0,
                 scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    @classmethod
    def from_config(cls, config: GPTConfig) -> RotaryEmbedding:
        """The rotary of `config`'s global layers: its head width, base and scaling."""
        return cls(config.head_dim, config.rope_theta, RopeScaling.from_config(config))

    @classmethod
    def from_kind(cls, config: GPTConfig, kind: AttentionKind) -> RotaryEmbedding:
        """The rotary of a layer of that kind: its own base, and the scaling unless the kind
        leaves it out (Gemma 3's local layers)."""
        scaling = RopeScaling.from_config(config) if kind.rope_scaled else None
        return cls(config.head_dim, kind.rope_theta, scaling)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of every position's angles: two (T, d), in `dtype`."""
        wide = torch.promote_types(dtype, torch.float32)
        inv_freq = rotary_frequencies(self.head_dim, self.theta, self.scaling, wide,
                                      positions.device)  # theta_i, (d/2,)
        angles = positions.to(wide)[:, None] * inv_freq[None, :]  # (T, d/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, d): pair i is features i and i + d/2
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, T, d) at positions (T,) -> rotated x (B, H, T, d)."""
        return self.rotate(x, *self.cos_sin(positions, x.dtype))

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (B, H, T, d) turned by angles given as their cos and sin (T, d), broadcast over B
        and H: attention computes them once and turns both q and k with them."""
        return x * cos + rotate_half(x) * sin

    def extra_repr(self) -> str:
        scaled = "" if self.scaling is None else f", scaling={self.scaling.kind}"
        return f"head_dim={self.head_dim}, theta={self.theta}{scaled}"
