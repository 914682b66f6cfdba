"""Multi-head causal self-attention, with the heads as a batch dimension.

Notation used in every shape comment of this file:
    B = batch, T = query positions, S = key positions (T, or more when a KV cache holds the past),
    C = model width (d_model), H = heads, d = head width (C // H unless `head_dim` is set).

`MultiHeadSelfAttention` keeps two paths that compute the same numbers:
  * explicit: scores = q @ k^T / sqrt(d), mask, softmax, dropout, weights @ v  (you can see it all)
  * fused:    torch.nn.functional.scaled_dot_product_attention                  (fast kernels)
Its textbook references (one module per head; `nn.MultiheadAttention`) are in
`glassgpt.experiments.references`; the speed paths of decoding in `glassgpt.decoding`.

The modern switches (docs/modern.md) are steps added to the same path, each off by default:
  * grouped-query attention (`n_kv_head` < H): qkv makes H query heads but only n_kv_head
    key/value heads, each serving `groups` = H // n_kv_head query heads (repeated just before
    attention);
  * `qk_norm`: RMSNorm over the head width on q and k (Qwen3);
  * `rotary`: q and k rotated by their positions (`glassgpt.rotary`), in every layer but the
    config's `nope_layers` (the layer's `AttentionKind`);
  * `head_dim`: heads of width d apart from C (Qwen3), so q is H * d wide and `proj` maps
    H * d back to C;
  * `qkv_bias`: biases on q, k and v only (Qwen2), none on `proj`;
  * a local layer (`sliding_window`, `local_layers`, Gemma): each query sees itself and the
    W - 1 keys before it, a band under the diagonal; decoding past W reads only those keys;
  * `query_pre_attn_scalar` scales the scores by 1/sqrt(it) rather than 1/sqrt(d), and
    `attn_softcap` bounds them, cap * tanh(scores / cap), before the mask (Gemma).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassgpt.config import GPTConfig, check_heads_divide_width
from glassgpt.errors import ConfigError, InputError
from glassgpt.hooks import add_hook_points, recorded
from glassgpt.inputs import check_pad_mask, check_stream, float_dtype
from glassgpt.norms import RMSNorm
from glassgpt.rotary import RotaryEmbedding


class KVCache(nn.Module):
    """Preallocated keys and values of the positions decoded so far: allocated once at their
    largest size, `update` writes new positions in place and returns views up to the newest one,
    so decoding allocates nothing per step."""

    def __init__(self, batch_size: int, n_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        shape = (batch_size, n_heads, max_len, head_dim)
        # Not persistent: a cache is scratch space, never part of a checkpoint.
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_len(self) -> int:  # positions the buffers hold
        return self.k.shape[2]

    def update(self, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, H, T, d) at start_pos.. and return all keys and values (B, H, S, d)."""
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise InputError(f"KV cache holds {self.max_len} positions, asked to write up to {end}")
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def build_attention_mask(q_len: int, k_len: int, causal: bool, pad_mask: Tensor | None,
                         device: torch.device, window: int | None = None) -> Tensor | None:
    """Boolean mask (B or 1, 1, T, S), True where a query may attend to a key; None if all may.

    Queries are the last `q_len` of `k_len` positions (a KV cache holds the earlier ones), so with
    `causal` query i sits at absolute position k_len - q_len + i and sees keys up to there.
    `window` W (a causal local layer) hides the keys W or more positions before the query: a
    band of W keys under the diagonal.
    `pad_mask` is (B, S) with True on padding keys, the `key_padding_mask` convention.
    """
    mask = None
    offset = k_len - q_len
    banded = window is not None and k_len > window
    if causal and (q_len > 1 or banded):
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=offset)
        if banded:  # key j is visible from query i when i + offset - W < j
            mask = mask.triu(diagonal=offset - window + 1)
        mask = mask.view(1, 1, q_len, k_len)
    if pad_mask is not None:
        if pad_mask.shape[-1] != k_len:
            raise InputError(f"pad_mask covers {pad_mask.shape[-1]} positions, keys are {k_len}")
        keep = ~pad_mask.bool().view(pad_mask.shape[0], 1, 1, k_len)  # (B, 1, 1, S)
        mask = keep if mask is None else mask & keep
    return mask


def _open_empty_rows(mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Let fully masked query rows attend everywhere (a softmax over nothing but -inf is NaN), and
    return which rows those were: such a row (padding that sees only padding) is zeroed after."""
    if mask is None:
        return None, None
    empty_rows = ~mask.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
    return mask | empty_rows, empty_rows


def _unchanged(x: Tensor) -> Tensor:
    return x


Hook = Callable[[Tensor], Tensor]


def soft_cap(values: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(values / cap): every value kept within +-cap, small ones nearly unchanged (the
    attention scores' `attn_softcap`, the logits' `logit_softcap`); values as they are for None."""
    return values if cap is None else cap * torch.tanh(values / cap)


def score_scale(head_dim: int, scale: float | None) -> float:
    """q . k's factor: `scale` (Gemma's query_pre_attn_scalar ** -0.5), else 1/sqrt(d)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def scale_and_cap(products: Tensor, head_dim: int, scale: float | None,
                  softcap: float | None) -> Tensor:
    """q . k products (any layout) -> scores: times `score_scale`, then through the soft-cap (before
    the mask, as Gemma does). The one step every path applies to its own q . k products."""
    return soft_cap(products * score_scale(head_dim, scale), softcap)


def attention_scores(q: Tensor, k: Tensor, scale: float | None = None,
                     softcap: float | None = None, mask: Tensor | None = None) -> Tensor:
    """The scores the softmax takes, q (B, H, T, d) and k (B, H, S, d) -> (B, H, T, S): q . k
    scaled and soft-capped (`scale_and_cap`), -inf where `mask` (True: seen) hides a key."""
    return hide_keys(scale_and_cap(q @ k.transpose(-2, -1), q.shape[-1], scale, softcap), mask)


def hide_keys(scores: Tensor, mask: Tensor | None) -> Tensor:  # (B, H, T, S), -inf: hidden
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                       dropout: nn.Module, hook_attn_scores: Hook = _unchanged,
                       hook_pattern: Hook = _unchanged, scale: float | None = None,
                       softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """softmax(q k^T / sqrt(d)) v, written out. Returns (output (B,H,T,d), weights (B,H,T,S)):
    the weights multiplied into v (after dropout). `hook_attn_scores` sees the masked scores
    (-inf where a key is hidden), `hook_pattern` the weights before dropout."""
    scores = attention_scores(q, k, scale, softcap)  # (B, H, T, S); masked in the softmax
    weights = dropout(hook_pattern(masked_softmax(scores, mask, hook_attn_scores)))
    return weights @ v, weights  # (B, H, T, d), (B, H, T, S)


def masked_softmax(scores: Tensor, mask: Tensor | None,
                   hook_attn_scores: Hook = _unchanged) -> Tensor:
    """Softmax over the last axis of scores, over allowed keys only; all-masked rows give 0."""
    mask, empty_rows = _open_empty_rows(mask)
    weights = torch.softmax(hook_attn_scores(hide_keys(scores, mask)), dim=-1)
    return weights if empty_rows is None else weights.masked_fill(empty_rows, 0.0)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                    dropout_p: float, scale: float | None = None) -> Tensor:
    """The same computation through PyTorch's fused kernel. Returns (B, H, T, d)."""
    mask, empty_rows = _open_empty_rows(mask)  # is_causal only ever comes without a mask
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                       is_causal=is_causal, scale=scale)
    return y if empty_rows is None else y.masked_fill(empty_rows, 0.0)


def repeat_kv(x: Tensor, groups: int) -> Tensor:  # query head h reads K/V head h // groups
    """(B, H_kv, S, d) -> (B, H_kv * groups, S, d)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention: one `qkv` projection, heads as a batch dimension, one `proj`.

    `qkv` is Linear(C, 3C) producing Q, K, V in that order along the last axis, and `proj` is
    W_O; both copy 1:1 into `nn.MultiheadAttention` (`experiments.references.to_torch_multihead`).
    `impl="fused"` uses scaled_dot_product_attention; the explicit path runs when the scores or
    pattern are watched (a hook on `hook_attn_scores`/`hook_pattern`, or `return_attn`), with a
    soft-cap, or with `impl="explicit"`. With `n_kv_head` < n_heads, `qkv`'s rows are [Q (H * d),
    K (n_kv_head * d), V (n_kv_head * d)]: each K/V head serves `groups` query heads in a row
    (`kv_head_of`). `qk_norm` adds `q_norm`, `k_norm` (RMSNorm over d); `rotary` rotates q and k
    by their positions. Built from a GPTConfig passed whole (`from_config`, what `GPT` does),
    or standalone from sizes and switches by name.
    """

    def __init__(self, d_model: int, n_heads: int, causal: bool = True, dropout: float = 0.0,
                 bias: bool = True, impl: str = "fused", *, n_kv_head: int | None = None,
                 qk_norm: bool = False, rotary: bool = False, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-6):
        super().__init__()
        check_heads_divide_width(d_model, n_heads)  # named as the caller named them
        self._build(GPTConfig(n_embd=d_model, n_head=n_heads, dropout=dropout, bias=bias,
                              attn_impl=impl, n_kv_head=n_kv_head, qk_norm=qk_norm,
                              position="rope" if rotary else "learned", rope_theta=rope_theta,
                              norm_eps=norm_eps), causal)

    @classmethod
    def from_config(cls, config: GPTConfig, causal: bool = True,
                    layer: int = 0) -> MultiHeadSelfAttention:
        """The attention of block `layer` of `config`: the config passed whole, no field
        unpacked (the layer picks its per-layer kind, `config.attention_kind(layer)`)."""
        attn = cls.__new__(cls)
        nn.Module.__init__(attn)
        attn._build(config, causal, layer)
        return attn

    def _build(self, config: GPTConfig, causal: bool, layer: int = 0) -> None:
        C, H, d = config.n_embd, config.n_head, config.head_dim
        self.d_model, self.n_heads, self.head_dim, self.causal = C, H, d, causal
        self.q_width = H * d  # C unless head_dim is set
        self.n_kv_head = config.n_kv_head or H  # None: every query head has its own K and V
        self.groups = H // self.n_kv_head  # query heads per K/V head
        self.impl, self.dropout_p = config.attn_impl, config.dropout
        kv_width = self.n_kv_head * d  # C when every head has its own K and V
        self.qkv = nn.Linear(C, self.q_width + 2 * kv_width, bias=config.has_qkv_bias)
        self.proj = nn.Linear(self.q_width, C, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)  # on the attention weights
        self.resid_dropout = nn.Dropout(config.dropout)  # on the output, before the residual
        offset = config.norm_offset  # Gemma's 1 + w, on q and k as everywhere
        heads_second = (1, 2)  # q, k (B, H, T, d): their norms' points show (B, T, H, d)
        self.q_norm = RMSNorm(d, config.norm_eps, offset, heads_second) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.norm_eps, offset, heads_second) if config.qk_norm else None
        kind = config.attention_kind(layer)
        if kind.local and not causal:
            raise ConfigError("a sliding window hides the keys long before a query, which "
                              "only a causal attention has")
        self.window = kind.window  # None, or W: this layer is local
        rotary = kind.rotary
        self.rotary = RotaryEmbedding.from_kind(config, kind) if rotary else None
        # None: 1/sqrt(d), SDPA's own scale
        self.scale = (None if config.query_pre_attn_scalar is None
                      else config.query_pre_attn_scalar ** -0.5)
        self.softcap = config.attn_softcap
        self.kv_cache: KVCache | None = None
        # Hook points (glassgpt.hooks), TransformerLens's names; q, k, v and z as
        # (B, T, heads, d), scores and pattern as (B, H, T, S).
        add_hook_points(self, "hook_q", "hook_k", "hook_v")
        if rotary:
            add_hook_points(self, "hook_rot_q", "hook_rot_k", transpose=(1, 2))
        add_hook_points(self, "hook_attn_scores", "hook_pattern", decides_path=True)
        add_hook_points(self, "hook_z")
        add_hook_points(self, "hook_result", decides_path=True)  # (B, T, H, C): per head

    def kv_head_of(self, head: int) -> int:
        """The K/V head that query head `head` reads: each serves `groups` heads in a row."""
        return head // self.groups

    def is_classic(self) -> bool:
        """Whether this is the attention of "Attention is all you need": one K and V per head,
        heads splitting C, no QK-norm or rotary, biases on all projections or none."""
        return (self.n_kv_head == self.n_heads and self.q_width == self.d_model
                and self.q_norm is None and self.rotary is None and self.window is None
                and self.scale is None and self.softcap is None
                and (self.qkv.bias is None) == (self.proj.bias is None))

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, T, n * d) -> (B, n, T, d): each head becomes a batch entry of its own."""
        B, T, _ = x.shape
        return x.view(B, T, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, pad_mask: Tensor | None = None, return_attn: bool = False,
                start_pos: int | None = None,
                qk_pos: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, T, C) -> y (B, T, C), or (y, weights (B, H, T, S)) with `return_attn`: the
        very tensor `hook_pattern` sees (one softmax, before dropout). `start_pos` (a KV cache
        set up): x holds positions start_pos.. of a sequence whose earlier keys and values are
        cached; an int, one symbolic size to the compiled CPU step (a replayed CUDA graph reads
        it from a device tensor: `decoding.cuda.StaticAttention`). Switching a head off is a
        hook on `hook_z`. `qk_pos` (B, T, C): shortformer positions (`project`)."""
        if return_attn:
            with recorded(self.hook_pattern) as seen:
                y = self.forward(x, pad_mask, start_pos=start_pos, qk_pos=qk_pos)
            return y, seen[0]
        check_stream(x, self.d_model, float_dtype(self.qkv), "attention")
        check_pad_mask(pad_mask, x)
        q, k, v = self.project(x, start_pos, qk_pos)  # (B, H, T, d), 2 x (B, H_kv, T, d)
        window = self.window
        if start_pos is not None:
            if self.kv_cache is None:
                raise InputError("start_pos given but no KV cache is set up on this module")
            k, v, pad_mask, window = self.read_cache(k, v, pad_mask, start_pos, x.shape[1])
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)  # 2 x (B, H, S, d)
        y = self.attend(q, k, v, pad_mask, window)  # (B, H, T, d)
        z = self.hook_z(y.transpose(1, 2))  # (B, T, H, d): each head's output, side by side
        return self.resid_dropout(self.output(z))  # (B, T, C)

    def output(self, z: Tensor) -> Tensor:
        """z (B, T, H, d) -> (B, T, C) through W_O (`proj`). Watched, each head's share z_h W_O[h]
        passes `hook_result` (B, T, H, C), TransformerLens's; the output is their sum + bias."""
        if not self.hook_result.active:
            return self.proj(z.flatten(2))  # (B, T, H*d) -> (B, T, C): one product
        result = self.hook_result(self.head_shares(z))  # (B, T, H, C)
        summed = result.sum(dim=2)  # (B, T, C)
        return summed if self.proj.bias is None else summed + self.proj.bias

    def head_shares(self, z: Tensor) -> Tensor:
        """z (B, T, H, d) -> each head's share of the output without the bias (B, T, H, C). A
        plain `proj` is one product with W_O's columns of each head; a wrapped one (LoRA
        adapters, linear in their input too) is asked itself, a head at a time, so nothing it
        adds to W_O is skipped."""
        if type(self.proj) is nn.Linear:
            w_o = self.proj.weight.view(self.d_model, self.n_heads, self.head_dim)  # (C, H, d)
            return torch.einsum("bthd,chd->bthc", z, w_o)
        eye = torch.eye(self.n_heads, dtype=z.dtype, device=z.device)[..., None]  # (H, H, 1)
        alone = (z.unsqueeze(-2) * eye).flatten(-2)  # (B, T, H, H*d): head h's z, zeros elsewhere
        shares = self.proj(alone)  # (B, T, H, C)
        return shares if self.proj.bias is None else shares - self.proj.bias

    def read_cache(self, k: Tensor, v: Tensor, pad_mask: Tensor | None, start_pos: int,
                   T: int) -> tuple[Tensor, Tensor, Tensor | None, int | None]:
        """Write the T new keys and values at start_pos.. and return the keys the new queries
        may see (B, H_kv, S, d), their padding, and the window still to mask as a band. A local
        layer reads from W - 1 keys before its first query on: decoding costs W keys, not S."""
        k, v = self.kv_cache.update(start_pos, k, v)  # 2 x (B, H_kv, S, d)
        lo = 0 if self.window is None else max(0, k.shape[2] - T - self.window + 1)
        if lo == 0:
            return k, v, pad_mask, self.window
        pad_mask = None if pad_mask is None else pad_mask[:, lo:]
        return k[:, :, lo:], v[:, :, lo:], pad_mask, self.window  # 2 x (B, H_kv, S - lo, d)

    def token_positions(self, start_pos: int | None, T: int, device: torch.device) -> Tensor:
        """The absolute positions (T,) of T new tokens that follow `start_pos` cached ones."""
        start = 0 if start_pos is None else start_pos
        return torch.arange(start, start + T, device=device)

    def project(self, x: Tensor, start_pos: int | None = None,
                qk_pos: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, C) -> q (B, H, T, d), k and v (B, H_kv, T, d): exactly the ones `forward`
        attends with (after QK-norm and rotary), before the cache and the K/V repeat.

        `start_pos` places x at positions start_pos.. (it matters only to rotary positions);
        `qk_pos` (shortformer) is added to the queries' and keys' input, not the values'."""
        B, T, _ = x.shape
        kv_width = self.n_kv_head * self.head_dim
        if qk_pos is None:
            q, k, v = self.qkv(x).split([self.q_width, kv_width, kv_width], dim=2)  # (B, T, .)
        else:
            q, k, v = self.shortformer_qkv(x, qk_pos, kv_width)
        q = self.hook_q(q.view(B, T, -1, self.head_dim)).transpose(1, 2)  # (B, H, T, d)
        k = self.hook_k(k.view(B, T, -1, self.head_dim)).transpose(1, 2)  # (B, H_kv, T, d)
        v = self.hook_v(v.view(B, T, -1, self.head_dim)).transpose(1, 2)  # (B, H_kv, T, d)
        if self.q_norm is not None:  # QK-norm: each head's q and k to unit RMS, times a gain
            q, k = self.q_norm(q), self.k_norm(k)  # shapes unchanged
        if self.rotary is not None:  # rotary: turn q and k by the angles of their positions
            positions = self.token_positions(start_pos, T, x.device)  # (T,)
            cos, sin = self.rotary.cos_sin(positions, q.dtype)  # 2 x (T, d), for q and k alike
            q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)  # unchanged
            q, k = self.hook_rot_q(q), self.hook_rot_k(k)  # seen as (B, T, heads, d)
        return q, k, v

    def shortformer_qkv(self, x: Tensor, qk_pos: Tensor,
                        kv_width: int) -> tuple[Tensor, Tensor, Tensor]:
        """Shortformer (Press et al. 2021): the rows of `qkv` for Q and K read x + qk_pos, the
        rows for V read x, so positions steer where heads look but never enter the stream."""
        rows, bias = self.q_width + kv_width, self.qkv.bias
        qk = F.linear(x + qk_pos, self.qkv.weight[:rows], None if bias is None else bias[:rows])
        v = F.linear(x, self.qkv.weight[rows:], None if bias is None else bias[rows:])
        return (*qk.split([self.q_width, kv_width], dim=2), v)  # (B, T, H*d), 2 x (B, T, H_kv*d)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, pad_mask: Tensor | None,
               window: int | None = None) -> Tensor:
        """softmax(q k^T / sqrt(d)) v for q (B, H, T, d) over keys k, v (B, H, S, d), the
        queries the last T of the S positions; `window` (a local layer's) masks the band.
        Returns the output (B, H, T, d)."""
        T, S = q.shape[2], k.shape[2]
        # The fused kernel never forms the scores: a hook on them, or a soft-cap of them, takes
        # the explicit path.
        looked_at = self.hook_attn_scores.active or self.hook_pattern.active
        if self.impl == "explicit" or looked_at or self.softcap is not None:
            mask = build_attention_mask(T, S, self.causal, pad_mask, q.device, window)
            return explicit_attention(q, k, v, mask, self.attn_dropout, self.hook_attn_scores,
                                      self.hook_pattern, self.scale, self.softcap)[0]
        dropout_p = self.dropout_p if self.training else 0.0  # never drop at eval time
        # With no padding, no band and T == S, is_causal=True lets SDPA pick its flash kernel.
        banded = window is not None and window < S
        plain_causal = self.causal and pad_mask is None and T == S and not banded
        mask = None if plain_causal else build_attention_mask(T, S, self.causal, pad_mask,
                                                              q.device, window)
        return fused_attention(q, k, v, mask, T > 1 and plain_causal, dropout_p, self.scale)

    def scored(self, products: Tensor) -> Tensor:
        """q . k products (any layout) -> this layer's scores before the mask: its scale and
        soft-cap (`scale_and_cap`), the step a fused path (the compiled CPU step) applies to
        its own products."""
        return scale_and_cap(products, self.head_dim, self.scale, self.softcap)

    def scores(self, q: Tensor, k: Tensor, pad_mask: Tensor | None = None) -> Tensor:
        """What this layer's softmax takes (`hook_attn_scores`), (B, H, T, S), for q (B, H, T, d)
        over keys k (B, H or H_kv, S, d): its scale, soft-cap, causal mask and window."""
        k = repeat_kv(k, q.shape[1] // k.shape[1])  # (B, H, S, d)
        mask = build_attention_mask(q.shape[2], k.shape[2], self.causal, pad_mask, q.device,
                                    self.window)
        return attention_scores(q, k, self.scale, self.softcap, mask)
