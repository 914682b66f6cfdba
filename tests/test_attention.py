"""Multi-head self-attention checked against three references.

1. The per-head loop (`PerHeadSelfAttention`), in float64, to 1e-12.
2. `F.scaled_dot_product_attention` and `nn.MultiheadAttention` with the same weights.
3. Its own other path: explicit and fused agree, and dropout acts only in training mode.
Shapes: B = batch, T = positions, C = width, H = heads, d = C // H.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import attention_with_weights
from glassgpt.attention import KVCache, MultiHeadSelfAttention
from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError, InputError
from glassgpt.experiments.references import PerHeadSelfAttention, to_torch_multihead

B, T, C, H = 3, 7, 24, 4
IMPLS = ("fused", "explicit")


def make_attention(causal: bool, impl: str = "fused", dtype: torch.dtype = torch.float64,
                   **kwargs) -> MultiHeadSelfAttention:
    return MultiHeadSelfAttention(C, H, causal=causal, impl=impl, **kwargs).to(dtype).eval()


def make_pad_mask() -> torch.Tensor:
    """(B, T) True on padding: row 0 none, row 1 right padding, row 2 left padding.

    With a causal mask, row 2's first queries see only padding keys: fully masked rows.
    """
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, -3:] = True
    pad[2, :2] = True
    return pad


def fully_masked_rows(pad_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """(B, T) True for the queries that may attend to no key at all."""
    if pad_mask is None:
        return torch.zeros(B, T, dtype=torch.bool)
    allowed = ~pad_mask[:, None, :].expand(B, T, T)  # (B, T query, T key)
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
    return ~allowed.any(dim=-1)


def query_rows(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The weights (B, H, T, S) of the query rows selected by a (B, T) mask: (rows, H, S)."""
    return weights.transpose(1, 2)[rows]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# --- 1. the per-head loop ------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-pad", "pad"])
def test_parallel_heads_equal_per_head_loop_float64(impl, causal, padded):
    attn = make_attention(causal, impl)
    ref = PerHeadSelfAttention.from_parallel(attn)
    x = torch.randn(B, T, C, dtype=torch.float64)
    pad = make_pad_mask() if padded else None

    y = attn(x, pad_mask=pad)
    y_attn, weights = attention_with_weights(attn, x, pad_mask=pad)
    y_ref, weights_ref = ref(x, pad_mask=pad)

    diffs = (max_diff(y, y_ref), max_diff(y_attn, y_ref), max_diff(weights, weights_ref))
    print(f"{impl} causal={causal} padded={padded}: max |parallel - per-head| "
          f"output={diffs[0]:.1e} output(explicit)={diffs[1]:.1e} weights={diffs[2]:.1e}")
    assert max(diffs) <= 1e-12
    assert weights.shape == (B, H, T, T)


def test_per_head_reference_holds_the_same_weights_slice_by_slice():
    attn = make_attention(causal=True)
    ref = PerHeadSelfAttention.from_parallel(attn)
    d = C // H
    # Head 1's key projection is rows [d, 2d) of the K block (rows [C, 2C)) of qkv.
    assert torch.equal(ref.heads[1].key.weight, attn.qkv.weight[C + d:C + 2 * d])
    assert torch.equal(ref.heads[H - 1].value.bias, attn.qkv.bias[3 * C - d:])
    assert torch.equal(ref.proj.weight, attn.proj.weight)


# --- 2. PyTorch's own attention ------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-pad", "pad"])
def test_heads_match_scaled_dot_product_attention(causal, padded):
    attn = make_attention(causal, "explicit")
    x = torch.randn(B, T, C, dtype=torch.float64)
    pad = make_pad_mask() if padded else None
    _, weights = attention_with_weights(attn, x, pad_mask=pad)

    q, k, v = attn.qkv(x).split(C, dim=2)
    q, k, v = attn.split_heads(q), attn.split_heads(k), attn.split_heads(v)  # (B, H, T, d)
    hidden = torch.zeros(B, 1, T, T, dtype=torch.bool)  # True = may not attend
    if causal:
        hidden = hidden | torch.ones(T, T, dtype=torch.bool).triu(1)
    if padded:
        hidden = hidden | pad[:, None, None, :]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden)  # (B, H, T, d)
    expected = attn.proj(expected.transpose(1, 2).reshape(B, T, C))
    scores = q @ k.transpose(-2, -1) / math.sqrt(C // H)  # (B, H, T, T)
    expected_weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)

    valid = ~fully_masked_rows(pad, causal)  # (B, T): rows with at least one key
    for impl in IMPLS:
        attn.impl = impl
        assert max_diff(attn(x, pad_mask=pad)[valid], expected[valid]) <= 1e-12
    assert max_diff(query_rows(weights, valid), query_rows(expected_weights, valid)) <= 1e-12


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_parallel_heads_equal_per_head_loop_without_bias(causal):
    attn = make_attention(causal, "explicit", bias=False)
    ref = PerHeadSelfAttention.from_parallel(attn)
    x = torch.randn(B, T, C, dtype=torch.float64)
    y, weights = attention_with_weights(attn, x)
    y_ref, weights_ref = ref(x)
    assert max(max_diff(y, y_ref), max_diff(weights, weights_ref)) <= 1e-12


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-pad", "pad"])
def test_matches_torch_multihead_attention(impl, causal, padded):
    attn = make_attention(causal, impl)
    mha = to_torch_multihead(attn).eval()
    x = torch.randn(B, T, C, dtype=torch.float64)
    pad = make_pad_mask() if padded else None
    causal_mask = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None  # True = hide

    expected, expected_weights = mha(x, x, x, attn_mask=causal_mask, key_padding_mask=pad,
                                     need_weights=True, average_attn_weights=False)
    y = attn(x, pad_mask=pad)
    _, weights = attention_with_weights(attn, x, pad_mask=pad)

    # Rows with no key to attend to are NaN in nn.MultiheadAttention; ours are tested below.
    valid = ~fully_masked_rows(pad, causal)  # (B, T)
    output_diff = max_diff(y[valid], expected[valid])
    weights_diff = max_diff(query_rows(weights, valid), query_rows(expected_weights, valid))
    print(f"{impl} causal={causal} padded={padded}: max |ours - nn.MultiheadAttention| "
          f"output={output_diff:.1e} weights={weights_diff:.1e}")
    assert output_diff <= 1e-12 and weights_diff <= 1e-12


def test_torch_multihead_copy_without_bias_computes_the_same():
    attn = MultiHeadSelfAttention(C, H, causal=True, bias=False).double().eval()
    mha = to_torch_multihead(attn)
    assert mha.in_proj_bias is None and mha.batch_first and not mha.training
    x = torch.randn(B, T, C, dtype=torch.float64)
    causal_mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    expected, _ = mha(x, x, x, attn_mask=causal_mask, need_weights=False)
    assert max_diff(attn(x), expected) <= 1e-12


# --- fully masked rows: zero, never NaN --------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_rows_with_every_key_masked_are_zero_not_nan(impl, causal):
    attn = make_attention(causal, impl)
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    pad = make_pad_mask()
    if not causal:
        pad[2] = True  # bidirectional: a whole row of padding leaves its queries no key
    empty = fully_masked_rows(pad, causal)
    assert empty.any()

    y = attn(x, pad_mask=pad)
    y_attn, weights = attention_with_weights(attn, x, pad_mask=pad)
    (y.sum() + y_attn.sum()).backward()

    assert not y.isnan().any() and not weights.isnan().any() and not x.grad.isnan().any()
    # Attention contributes 0 before the output projection, so only its bias is left.
    bias = attn.proj.bias.expand(int(empty.sum()), C)
    assert torch.equal(y[empty], bias) and torch.equal(y_attn[empty], bias)
    assert torch.all(query_rows(weights, empty) == 0)
    # The other rows are proper distributions over the keys they may see.
    sums = query_rows(weights, ~empty).sum(-1)  # (rows, H)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-12)


def test_padding_keys_get_no_weight_and_do_not_change_other_outputs():
    attn = make_attention(causal=False, impl="explicit")
    x = torch.randn(B, T, C, dtype=torch.float64)
    pad = make_pad_mask()
    y, weights = attention_with_weights(attn, x, pad_mask=pad)
    assert torch.all(weights.masked_select(pad[:, None, None, :].expand_as(weights)) == 0)

    x_changed = x.clone()
    x_changed[pad] += 10.0  # rewrite only the padded positions
    y_changed = attn(x_changed, pad_mask=pad)
    assert max_diff(y[~pad], y_changed[~pad]) <= 1e-12


# --- 3. explicit vs fused, and dropout -----------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_explicit_and_fused_paths_agree_in_eval(dtype, tol, causal):
    attn = make_attention(causal, "fused", dtype=dtype, dropout=0.3)
    x = torch.randn(B, T, C, dtype=dtype)
    pad = make_pad_mask()
    for pad_mask in (None, pad):
        fused = attn(x, pad_mask=pad_mask)
        attn.impl = "explicit"
        explicit = attn(x, pad_mask=pad_mask)
        attn.impl = "fused"
        assert max_diff(fused, explicit) <= tol


def test_dropout_acts_in_training_only():
    torch.manual_seed(1)
    x = torch.randn(B, T, C)
    for impl in IMPLS:
        attn = MultiHeadSelfAttention(C, H, dropout=0.5, impl=impl)
        attn.train()
        assert not torch.equal(attn(x), attn(x)), f"{impl}: training must drop"
        attn.eval()
        assert torch.equal(attn(x), attn(x)), f"{impl}: eval must never drop"


def test_fused_path_passes_dropout_only_when_training(monkeypatch):
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("dropout_p", 0.0))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    attn = MultiHeadSelfAttention(C, H, dropout=0.25, impl="fused")
    x = torch.randn(B, T, C)
    attn.train()(x)
    attn.eval()(x)
    attn.train()(x, pad_mask=make_pad_mask())
    assert seen == [0.25, 0.0, 0.25]


def test_train_mode_weights_rows_no_longer_sum_to_one():
    attn = MultiHeadSelfAttention(C, H, dropout=0.5, impl="explicit").double()
    x = torch.randn(B, T, C, dtype=torch.float64)
    attn.train()
    _, weights = attention_with_weights(attn, x)
    row_sums = weights.sum(-1)  # (B, H, T)
    assert (row_sums - 1).abs().max() > 0.1
    assert (weights == 0).any()  # some weights dropped outright ...
    assert weights.max() > 1.0  # ... and the kept ones scaled by 1 / (1 - p)
    attn.eval()
    _, weights = attention_with_weights(attn, x)
    assert torch.allclose(weights.sum(-1), torch.ones(B, H, T, dtype=torch.float64), atol=1e-12)


# --- the worked example of the spec: B=2, T=5, C=24, H=3 ----------------------------------

def test_worked_example_shapes():
    attn = MultiHeadSelfAttention(24, 3).eval()
    x = torch.randn(2, 5, 24)
    q, k, v = attn.qkv(x).split(24, dim=2)
    assert q.shape == k.shape == v.shape == (2, 5, 24)
    q_heads, k_heads = attn.split_heads(q), attn.split_heads(k)
    assert q_heads.shape == k_heads.shape == (2, 3, 5, 8)
    # Head 1 holds features 8..15 of Q: splitting reshapes the width and mixes nothing.
    assert torch.equal(q_heads[:, 1], q[..., 8:16])

    y, weights = attention_with_weights(attn, x)
    assert weights.shape == (2, 3, 5, 5)
    assert y.shape == (2, 5, 24)
    merged = (weights @ attn.split_heads(v)).transpose(1, 2).reshape(2, 5, 24)  # (2, 5, 24)
    assert torch.allclose(attn.proj(merged), y, atol=1e-6)


def test_scores_are_scaled_by_one_over_sqrt_head_width():
    attn = make_attention(causal=False, impl="explicit")
    with torch.no_grad():
        attn.qkv.weight.zero_()
        attn.qkv.bias.zero_()
        # q = k = the first two features of x for every head, in head 0 only.
        attn.qkv.weight[0, 0] = attn.qkv.weight[C, 0] = 1.0
    x = torch.zeros(1, 2, C, dtype=torch.float64)
    x[0, 0, 0], x[0, 1, 0] = 1.0, 2.0
    _, weights = attention_with_weights(attn, x)
    d = C // H
    # Query 1 has q = 2; its scores are 2*1/sqrt(d) and 2*2/sqrt(d).
    expected = torch.tensor([2.0, 4.0], dtype=torch.float64).div(math.sqrt(d)).softmax(-1)
    assert max_diff(weights[0, 0, 1], expected) <= 1e-15


# --- KV cache ------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_cached_chunks_equal_one_full_pass(impl):
    attn = make_attention(causal=True, impl=impl)
    x = torch.randn(B, T, C, dtype=torch.float64)
    full = attn(x)
    attn.kv_cache = KVCache(B, H, T, C // H, dtype=torch.float64)
    # A prefill of 3 positions, then 1, then 3: queries T < keys S with a causal offset.
    pieces = [attn(x[:, a:b], start_pos=a) for a, b in ((0, 3), (3, 4), (4, 7))]
    assert max_diff(torch.cat(pieces, dim=1), full) <= 1e-12


def test_kv_cache_refuses_to_overflow():
    cache = KVCache(1, H, 4, C // H)
    k = torch.zeros(1, H, 3, C // H)
    cache.update(0, k, k)
    with pytest.raises(InputError, match=r"4 positions.*up to 6"):
        cache.update(3, k, k)


def test_start_pos_without_cache_is_an_error():
    attn = MultiHeadSelfAttention(C, H)
    with pytest.raises(InputError, match="no KV cache"):
        attn(torch.randn(1, 2, C), start_pos=0)


# --- errors --------------------------------------------------------------------------------

def test_heads_must_divide_width():
    with pytest.raises(ConfigError, match=r"d_model=30.*n_heads=4"):
        MultiHeadSelfAttention(30, 4)
    with pytest.raises(ValueError, match=r"30.*4"):  # a ValueError, as the spec says
        PerHeadSelfAttention(30, 4)


@pytest.mark.parametrize("d_model, n_heads", [(0, 4), (24, 0), (-8, 2)])
def test_sizes_must_be_positive(d_model, n_heads):
    with pytest.raises(ConfigError, match=rf"d_model={d_model}, n_heads={n_heads}"):
        MultiHeadSelfAttention(d_model, n_heads)


def test_unknown_impl_and_bad_dropout():
    with pytest.raises(ConfigError, match=r"'flash'.*fused.*explicit"):
        MultiHeadSelfAttention(C, H, impl="flash")
    with pytest.raises(ConfigError, match=r"\[0, 1\), got 1.5"):
        MultiHeadSelfAttention(C, H, dropout=1.5)


def test_pad_mask_length_must_match():
    attn = MultiHeadSelfAttention(C, H, impl="explicit")
    with pytest.raises(InputError, match=r"covers 3 positions, keys are 7"):
        attn(torch.randn(B, T, C), pad_mask=torch.zeros(B, 3, dtype=torch.bool))


# --- built from the config ------------------------------------------------------------------

def test_attention_from_the_config_is_the_standalone_module():
    config = GPTConfig(n_embd=C, n_head=H, n_kv_head=2, qk_norm=True, position="rope",
                       rope_theta=500.0, norm_eps=1e-6, bias=False, attn_impl="explicit")
    torch.manual_seed(0)
    built = MultiHeadSelfAttention.from_config(config).double()
    torch.manual_seed(0)
    standalone = MultiHeadSelfAttention(C, H, bias=False, impl="explicit", n_kv_head=2,
                                        qk_norm=True, rotary=True, rope_theta=500.0).double()
    assert built.state_dict().keys() == standalone.state_dict().keys()
    assert (built.rotary.theta, built.q_norm.eps, built.impl, built.causal) == \
        (500.0, 1e-6, "explicit", True)
    x = torch.randn(B, T, C, dtype=torch.float64)
    assert torch.equal(built(x), standalone(x))


@pytest.mark.parametrize("n_kv_head, reads", [(None, [0, 1, 2, 3]), (4, [0, 1, 2, 3]),
                                              (2, [0, 0, 1, 1]), (1, [0, 0, 0, 0])])
def test_attention_knows_its_groups_and_which_kv_head_each_query_head_reads(n_kv_head, reads):
    attn = MultiHeadSelfAttention(C, H, n_kv_head=n_kv_head)
    assert attn.n_kv_head == max(reads) + 1 and attn.groups == H // attn.n_kv_head
    assert [attn.kv_head_of(h) for h in range(H)] == reads
