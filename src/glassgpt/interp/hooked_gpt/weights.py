"""A glassgpt model's weights laid out as TransformerLens lays them out: `LensWeights`, the
`W_E`, `W_Q`, `W_O`, `QK`, ... of a HookedGPT.

Notation: L = layers, H = heads, H_kv = key/value heads, d = head width, C = width, F = MLP
width, V = vocabulary, n_ctx = block size. TransformerLens multiplies activations on the left,
`x @ W`, so every matrix is glassgpt's `Linear.weight` transposed:

    W_E (V, C)   W_pos (n_ctx, C)   W_Q, W_K, W_V (L, H, C, d)   W_O (L, H, d, C)
    b_Q, b_K, b_V (L, H, d)   b_O (L, C)   W_in, W_gate (L, C, F)   W_out (L, F, C)
    b_in (L, F)   b_out (L, C)   W_U (C, V)   b_U (V,)

A glassgpt attention's `qkv` holds its rows as [Q (H d), K (H_kv d), V (H_kv d)]; with grouped
heads each K/V head is repeated for the query heads it serves (query head h reads K/V head
h // (H / H_kv)), as TransformerLens's W_K and W_V are. A bias the model does not have reads as
zeros, as TransformerLens's do. W_E, W_pos and W_U are the parameters themselves (W_U a
transposed view); the stacked ones are new tensors, computed on each read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.formats.transformer_lens import bias_or_zeros, output_weight, qkv_rows
from glassgpt.interp.hooked_gpt.factored import FactoredMatrix


def head_weight(attn: nn.Module, which: str) -> Tensor:
    """W_Q, W_K or W_V of one attention, (H, C, d), K and V repeated to H heads."""
    rows = attn.qkv.weight[qkv_rows(attn, which)]  # (heads * d, C)
    per_head = rows.reshape(-1, attn.head_dim, attn.d_model).transpose(1, 2)  # (heads, C, d)
    return per_head if which == "q" else per_head.repeat_interleave(attn.groups, dim=0)


def head_bias(attn: nn.Module, which: str) -> Tensor:
    """b_Q, b_K or b_V of one attention, (H, d), zeros where qkv has no bias."""
    bias = attn.qkv.bias
    rows = qkv_rows(attn, which)
    if bias is None:
        return attn.qkv.weight.new_zeros(attn.n_heads, attn.head_dim)
    per_head = bias[rows].reshape(-1, attn.head_dim)  # (heads, d)
    return per_head if which == "q" else per_head.repeat_interleave(attn.groups, dim=0)


def mlp_input_linear(mlp: nn.Module, which: str) -> nn.Linear:
    """The MLP's Linear TransformerLens calls W_in ("in": GPT-2's fc, a gated MLP's up) or
    W_gate ("gate": a gated MLP's gate)."""
    if which == "gate":
        if not hasattr(mlp, "gate"):
            raise InputError("W_gate belongs to a gated MLP (swiglu, geglu); this model's MLP "
                             "has no gate")
        return mlp.gate
    return mlp.up if hasattr(mlp, "up") else mlp.fc


class LensWeights:
    """TransformerLens's weight attributes, for a class whose `glass` is a glassgpt GPT."""

    glass: nn.Module

    def _stacked(self, per_block: Callable[[nn.Module], Tensor]) -> Tensor:
        return torch.stack([per_block(block) for block in self.glass.blocks])  # (L, ...)

    def _stacked_mlp(self, per_mlp: Callable[[nn.Module], Tensor]) -> Tensor:
        if self.glass.config.attn_only:
            raise InputError("this model is attn_only: its blocks have no MLP, so no W_in, "
                             "W_out, b_in or b_out")
        return self._stacked(lambda block: per_mlp(block.ffn))

    @property
    def W_E(self) -> Tensor:  # noqa: N802 (TransformerLens's names)
        return self.glass.tok_emb.weight  # (V, C)

    @property
    def W_pos(self) -> Tensor:  # noqa: N802
        if self.glass.pos_emb is None:
            raise InputError(f"this model's positions are {self.glass.config.position!r}: no "
                             "learned position table, so no W_pos")
        return self.glass.pos_emb.weight  # (n_ctx, C)

    @property
    def W_Q(self) -> Tensor:  # noqa: N802
        return self._stacked(lambda block: head_weight(block.attn, "q"))  # (L, H, C, d)

    @property
    def W_K(self) -> Tensor:  # noqa: N802
        return self._stacked(lambda block: head_weight(block.attn, "k"))  # (L, H, C, d)

    @property
    def W_V(self) -> Tensor:  # noqa: N802
        return self._stacked(lambda block: head_weight(block.attn, "v"))  # (L, H, C, d)

    @property
    def W_O(self) -> Tensor:  # noqa: N802
        return self._stacked(lambda block: output_weight(block.attn))  # (L, H, d, C)

    @property
    def b_Q(self) -> Tensor:  # noqa: N802
        return self._stacked(lambda block: head_bias(block.attn, "q"))  # (L, H, d)

    @property
    def b_K(self) -> Tensor:  # noqa: N802
        return self._stacked(lambda block: head_bias(block.attn, "k"))  # (L, H, d)

    @property
    def b_V(self) -> Tensor:  # noqa: N802
        return self._stacked(lambda block: head_bias(block.attn, "v"))  # (L, H, d)

    @property
    def b_O(self) -> Tensor:  # noqa: N802
        return self._stacked(lambda block: bias_or_zeros(block.attn.proj))  # (L, C)

    @property
    def W_in(self) -> Tensor:  # noqa: N802
        return self._stacked_mlp(lambda mlp: mlp_input_linear(mlp, "in").weight.T)  # (L, C, F)

    @property
    def W_gate(self) -> Tensor:  # noqa: N802
        return self._stacked_mlp(lambda mlp: mlp_input_linear(mlp, "gate").weight.T)

    @property
    def b_in(self) -> Tensor:
        return self._stacked_mlp(lambda mlp: bias_or_zeros(mlp_input_linear(mlp, "in")))

    @property
    def W_out(self) -> Tensor:  # noqa: N802
        return self._stacked_mlp(lambda mlp: mlp.proj.weight.T)  # (L, F, C)

    @property
    def b_out(self) -> Tensor:
        return self._stacked_mlp(lambda mlp: bias_or_zeros(mlp.proj))  # (L, C)

    @property
    def W_U(self) -> Tensor:  # noqa: N802
        return self.glass.lm_head.weight.T  # (C, V): a view of the head

    @property
    def b_U(self) -> Tensor:  # noqa: N802
        return bias_or_zeros(self.glass.lm_head)  # (V,)

    @property
    def QK(self) -> FactoredMatrix:  # noqa: N802
        """Every head's QK circuit W_Q[l, h] @ W_K[l, h].T, factored: (L, H, C, C)."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:  # noqa: N802
        """Every head's OV circuit W_V[l, h] @ W_O[l, h], factored: (L, H, C, C)."""
        return FactoredMatrix(self.W_V, self.W_O)
