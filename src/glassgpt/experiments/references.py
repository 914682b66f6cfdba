"""The textbook forms of multi-head attention that `MultiHeadSelfAttention` is checked against.

`PerHeadSelfAttention` is "one module per head, then concatenate" (`AttentionHead` is one such
head), and `to_torch_multihead` copies a classic attention into PyTorch's own
`nn.MultiheadAttention`. They exist so that tests can prove that treating the heads as a batch
dimension changes nothing; the model never uses them.
Shapes: B = batch, T = positions, C = width, H = heads, d = head width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from glassgpt.attention import MultiHeadSelfAttention, build_attention_mask, masked_softmax
from glassgpt.config import check_heads_divide_width
from glassgpt.errors import InputError


def to_torch_multihead(attn: MultiHeadSelfAttention) -> nn.MultiheadAttention:
    """An `nn.MultiheadAttention` (batch_first) computing the same: qkv -> in_proj, proj ->
    out_proj, copied 1:1 because both keep Q, K, V stacked in that order."""
    if not attn.is_classic():
        raise InputError("nn.MultiheadAttention has no grouped K/V, QK-norm, rotary "
                         "positions, own head width or q/k/v-only biases; only a classic "
                         "attention module converts")
    bias = attn.qkv.bias is not None
    weight = attn.qkv.weight
    mha = nn.MultiheadAttention(attn.d_model, attn.n_heads, dropout=attn.dropout_p,
                                bias=bias, batch_first=True, device=weight.device,
                                dtype=weight.dtype)
    with torch.no_grad():
        mha.in_proj_weight.copy_(weight)
        mha.out_proj.weight.copy_(attn.proj.weight)
        if bias:
            mha.in_proj_bias.copy_(attn.qkv.bias)
            mha.out_proj.bias.copy_(attn.proj.bias)
    return mha.train(attn.training)


class AttentionHead(nn.Module):
    """One head on its own: its own Q, K, V projections to width d. Reference only."""

    def __init__(self, d_model: int, head_dim: int, bias: bool = True):
        super().__init__()
        self.query = nn.Linear(d_model, head_dim, bias=bias)
        self.key = nn.Linear(d_model, head_dim, bias=bias)
        self.value = nn.Linear(d_model, head_dim, bias=bias)

    def forward(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """x (B, T, C) -> (output (B, T, d), weights (B, T, T))."""
        q, k, v = self.query(x), self.key(x), self.value(x)  # 3 x (B, T, d)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, T, T)
        weights = masked_softmax(scores, mask)
        return weights @ v, weights


class PerHeadSelfAttention(nn.Module):
    """The "ModuleList of heads, then concatenate" form of multi-head attention (no dropout).

    Slow and plain on purpose: it is the reference that `MultiHeadSelfAttention` is checked against.
    Build it from a `MultiHeadSelfAttention` with `from_parallel` to share the same weights.
    """

    def __init__(self, d_model: int, n_heads: int, causal: bool = True, bias: bool = True):
        super().__init__()
        head_dim = check_heads_divide_width(d_model, n_heads)
        self.causal = causal
        self.heads = nn.ModuleList(AttentionHead(d_model, head_dim, bias) for _ in range(n_heads))
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    @classmethod
    def from_parallel(cls, attn: MultiHeadSelfAttention) -> PerHeadSelfAttention:
        """A per-head module holding exactly the weights of `attn`, sliced head by head."""
        if not attn.is_classic():
            raise InputError("the per-head reference is the classic form: no grouped K/V, "
                             "QK-norm, rotary positions, own head width or q/k/v-only biases")
        bias = attn.qkv.bias is not None
        ref = cls(attn.d_model, attn.n_heads, attn.causal, bias).to(attn.qkv.weight)
        C, d = attn.d_model, attn.head_dim
        with torch.no_grad():
            for h, head in enumerate(ref.heads):
                rows = slice(h * d, (h + 1) * d)
                for i, linear in enumerate((head.query, head.key, head.value)):
                    linear.weight.copy_(attn.qkv.weight[i * C:(i + 1) * C][rows])
                    if bias:
                        linear.bias.copy_(attn.qkv.bias[i * C:(i + 1) * C][rows])
            ref.proj.load_state_dict(attn.proj.state_dict())
        return ref

    def forward(self, x: Tensor, pad_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x (B, T, C) -> (y (B, T, C), weights (B, H, T, T))."""
        T = x.shape[1]
        mask = build_attention_mask(T, T, self.causal, pad_mask, x.device)
        mask = None if mask is None else mask[:, 0]  # (B or 1, T, T): one head at a time
        outputs, weights = zip(*(head(x, mask) for head in self.heads), strict=True)
        y = torch.cat(outputs, dim=-1)  # H x (B, T, d) -> (B, T, C)
        return self.proj(y), torch.stack(weights, dim=1)  # (B, T, C), (B, H, T, T)
