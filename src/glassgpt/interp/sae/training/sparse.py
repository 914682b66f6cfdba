"""A TopK or BatchTopK training step, sparse in both directions.

The dense pre-activations pre (N, d_sae) are needed to rank the latents, but the loss reaches
the encoder only through the entries kept (k a row, or k * N a batch; AuxK's k_aux among the
dead latents likewise) and the decoder only through their rows. So the ranking runs without
autograd, and only the M kept entries carry a gradient:

    value_m  = sae_in[row_m] . W_enc[:, latent_m] + b_enc[latent_m]     (gathered from pre)
    x_hat_n  = sum over row n's entries of weight_m * W_dec[latent_m]

Their backward is a sum over the M entries, not over all N * d_sae: d W_enc[:, j] =
sum_{m: latent_m = j} g_m * sae_in[row_m], d W_dec[j] = sum_m weight_m * d x_hat[row_m]. Both
are a product S^T @ D of the sparse (N, d_sae) matrix S of the entries with a dense (N, d)
one, computed as an `embedding_bag` over the entries ordered by latent (`Kept.by_latent`,
one sort a step, shared by the encoder and the decoder). A 16x dictionary with k = 32 keeps 1
entry in 64: the dense backward's two (N, d_in) x (N, d_sae) products and its (N, d_sae)
temporaries are gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Kept:
    """The M entries a step keeps, in row order: entry m is latent cols[m] of row rows[m], row
    n's entries are offsets[n]:offsets[n + 1]. by_latent (M,) orders them by latent, latent j's
    being by_latent[latent_offsets[j]:latent_offsets[j + 1]]; rows_by_latent = rows[by_latent]."""

    rows: Tensor  # (M,)
    cols: Tensor  # (M,)
    offsets: Tensor  # (N + 1,)
    by_latent: Tensor  # (M,)
    latent_offsets: Tensor  # (d_sae + 1,)
    rows_by_latent: Tensor  # (M,)
    per_row: int = 0  # k when every row keeps k (TopK), else 0

    @property
    def n_rows(self) -> int:
        return self.offsets.numel() - 1


def kept_of_rows(indices: Tensor, d_sae: int) -> Kept:
    """indices (N, k): the k latents of each row (TopK)."""
    n, k = indices.shape
    rows = torch.arange(n, device=indices.device).repeat_interleave(k)  # (N * k,)
    offsets = torch.arange(0, n * k + 1, k, device=indices.device)
    return _kept(rows, indices.flatten(), offsets, d_sae, per_row=k)


def kept_of_flat(flat: Tensor, n_rows: int, d_sae: int) -> Kept:
    """flat (M,): indices into the flattened (N, d_sae) batch (BatchTopK), any order."""
    flat = flat.sort().values  # row order
    rows, cols = flat // d_sae, flat % d_sae
    counts = torch.bincount(rows, minlength=n_rows)  # (N,)
    return _kept(rows, cols, _offsets(counts), d_sae)


def _kept(rows: Tensor, cols: Tensor, offsets: Tensor, d_sae: int, per_row: int = 0) -> Kept:
    by_latent = _argsort(cols, d_sae)  # (M,)
    counts = torch.bincount(cols, minlength=d_sae)  # (d_sae,)
    return Kept(rows, cols, offsets, by_latent, _offsets(counts), rows[by_latent], per_row)


def _argsort(cols: Tensor, d_sae: int) -> Tensor:
    """The order that sorts cols (M,) of values below d_sae. On a CPU, numpy's stable sort: a
    radix sort of small integers; torch's sort of the same int64s took many times as long."""
    if cols.device.type != "cpu":
        return cols.argsort(stable=True)
    small = np.int16 if d_sae <= np.iinfo(np.int16).max else np.int32
    order = np.argsort(cols.numpy().astype(small), kind="stable")
    return torch.from_numpy(order).to(cols.dtype)


def _offsets(counts: Tensor) -> Tensor:
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # (len + 1,)


def row_sums(kept: Kept, weights: Tensor, table: Tensor) -> Tensor:
    """S @ table: sum over row n's entries of weights[m] * table[cols[m]] -> (N, d)."""
    return F.embedding_bag(kept.cols, table, kept.offsets, mode="sum",
                           per_sample_weights=weights, include_last_offset=True)


def latent_sums(kept: Kept, weights: Tensor, dense: Tensor) -> Tensor:
    """S^T @ dense: sum over latent j's entries of weights[m] * dense[rows[m]] -> (d_sae, d)."""
    return F.embedding_bag(kept.rows_by_latent, dense, kept.latent_offsets, mode="sum",
                           per_sample_weights=weights[kept.by_latent], include_last_offset=True)


class _KeptPre(torch.autograd.Function):
    """pre's kept entries (M,), gathered from pre * scale computed without a graph; the
    gradient reaches sae_in, W_enc and b_enc through those entries alone."""

    @staticmethod
    def forward(ctx: Any, sae_in: Tensor, w_enc: Tensor, b_enc: Tensor, scaled: Tensor,
                kept: Kept, scale: Tensor) -> Tensor:
        ctx.save_for_backward(sae_in, w_enc)
        ctx.kept = kept
        if kept.per_row:
            return scaled.gather(1, kept.cols.view(kept.n_rows, -1)).flatten() / scale
        return scaled[kept.rows, kept.cols] / scale

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        sae_in, w_enc = ctx.saved_tensors
        kept: Kept = ctx.kept
        d_sae = w_enc.shape[1]
        grad_in = row_sums(kept, grad, w_enc.T.contiguous()) \
            if ctx.needs_input_grad[0] else None  # (N, d_in)
        grad_w = latent_sums(kept, grad, sae_in).T.contiguous()  # (d_in, d_sae)
        grad_b = grad.new_zeros(d_sae).index_add_(0, kept.cols, grad)  # (d_sae,)
        return grad_in, grad_w, grad_b, None, None, None


class _Decode(torch.autograd.Function):
    """x_hat (N, d_out) = sum over each row's entries of weights[m] * W_dec[cols[m]]."""

    @staticmethod
    def forward(ctx: Any, weights: Tensor, w_dec: Tensor, kept: Kept) -> Tensor:
        ctx.save_for_backward(weights, w_dec)
        ctx.kept = kept
        return row_sums(kept, weights, w_dec)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        weights, w_dec = ctx.saved_tensors
        kept: Kept = ctx.kept
        grad = grad.contiguous()
        grad_weights = None
        if ctx.needs_input_grad[0]:  # embedding_bag's own (N, k, d)-free product, W_dec fixed
            with torch.enable_grad():
                tracked = weights.detach().requires_grad_()
                grad_weights, = torch.autograd.grad(row_sums(kept, tracked, w_dec), tracked, grad)
        grad_w = latent_sums(kept, weights, grad) if ctx.needs_input_grad[1] else None
        return grad_weights, grad_w, None


def kept_pre(sae_in: Tensor, w_enc: Tensor, b_enc: Tensor, scaled: Tensor, kept: Kept,
             scale: Tensor) -> Tensor:
    """The kept entries of pre = sae_in @ W_enc + b_enc (N, d_sae), read from `scaled`, pre
    times a latent's scale, computed without a graph, at the kept entries divided by their
    scale (M,); with their gradient to sae_in, W_enc and b_enc -> (M,)."""
    return _KeptPre.apply(sae_in, w_enc, b_enc, scaled.detach(), kept, scale.detach())


def decode_kept(weights: Tensor, w_dec: Tensor, kept: Kept) -> Tensor:
    """sum over each row's kept entries of weights[m] * W_dec[cols[m]] -> (N, d_out), with its
    gradient to the weights and W_dec through those entries alone."""
    return _Decode.apply(weights, w_dec, kept)
