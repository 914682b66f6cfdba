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
Shapes: B = batch, H = heads, T = positions, d = head width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


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

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of every position's angles: two (T, d), in `dtype`."""
        wide = torch.promote_types(dtype, torch.float32)
        half = torch.arange(0, self.head_dim, 2, device=positions.device, dtype=wide)  # (d/2,)
        inv_freq = 1.0 / (self.theta ** (half / self.head_dim))  # theta_i, (d/2,)
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
        return f"head_dim={self.head_dim}, theta={self.theta}"
