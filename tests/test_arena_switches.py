"""ARENA's model as config switches, and the hook points TransformerLens's analysis reads
(issue 40).

`attn_only` (blocks of attention alone), `norm="none"` and `position="shortformer"` (a learned
table added to the queries' and keys' input, never to the stream) build the two-layer model of
ARENA's exercises; each is held to the same model written out by hand in float64. The norms'
`hook_scale`, the per-head `hook_result` and a hook point's `layer()` and `ctx` are what
TransformerLens's cache analysis and ARENA's hooks read.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glassgpt import generate
from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError, InputError
from glassgpt.interp import run_with_cache, run_with_hooks, zero_heads
from glassgpt.model import GPT

V, T, C, H = 23, 7, 16, 4
ARENA = dict(attn_only=True, norm="none", position="shortformer")


def model_of(dtype: torch.dtype = torch.float32, **switches) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=V, block_size=12, n_layer=2, n_head=H, n_embd=C,
                       dropout=0.0, **switches)
    return GPT(config).to(dtype).eval()


def ids_of(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(3))


def attention_by_hand(attn, q_in: torch.Tensor, v_in: torch.Tensor) -> torch.Tensor:
    """One causal attention layer written out: queries and keys from q_in, values from v_in."""
    d = attn.head_dim
    w_q, w_k, w_v = attn.qkv.weight.split(H * d)
    b_q, b_k, b_v = attn.qkv.bias.split(H * d)

    def heads(x):  # (B, T, H*d) -> (B, H, T, d)
        return x.view(x.shape[0], x.shape[1], H, d).transpose(1, 2)

    q, k = heads(q_in @ w_q.T + b_q), heads(q_in @ w_k.T + b_k)
    v = heads(v_in @ w_v.T + b_v)
    scores = q @ k.transpose(-1, -2) / d**0.5  # (B, H, T, T)
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    z = (weights @ v).transpose(1, 2).flatten(2)  # (B, T, H*d)
    return z @ attn.proj.weight.T + attn.proj.bias


def test_arena_model_equals_its_formula_written_out():
    """attn_only + no norm + shortformer: x = E[t]; each layer x += attn(q, k from x + P, v from
    x); logits = x W_U. Nothing else: no MLP, no norm, no position in the stream."""
    model = model_of(torch.float64, **ARENA)
    ids = ids_of()
    x = model.tok_emb.weight[ids]  # (B, T, C)
    pos = model.pos_emb.weight[:T]  # (T, C)
    for block in model.blocks:
        x = x + attention_by_hand(block.attn, x + pos, x)
    logits, _ = model(ids)
    torch.testing.assert_close(logits, x @ model.lm_head.weight.T, rtol=0, atol=1e-12)
    assert all(block.ffn is None and block.ln2 is None for block in model.blocks)
    assert all(isinstance(module, torch.nn.Identity)
               for name, module in model.named_modules() if name.startswith(("ln", "blocks.0.ln")))


def test_attention_only_pre_ln_block_is_x_plus_attention_of_its_norm():
    model = model_of(torch.float64, attn_only=True)
    ids = ids_of()
    x = model.tok_emb.weight[ids] + model.pos_emb.weight[:T]
    for block in model.blocks:
        normed = block.ln1(x)
        x = x + attention_by_hand(block.attn, normed, normed)
    logits, _ = model(ids)
    torch.testing.assert_close(logits, model.lm_head(model.ln_f(x)), rtol=0, atol=1e-12)
    per_layer = 2 * C + 3 * C * C + 3 * C + C * C + C  # ln1, qkv, proj
    assert sum(p.numel() for p in model.parameters()) == V * C + 12 * C + 2 * per_layer + 2 * C


def test_arena_model_has_transformer_lens_points_and_no_others():
    model = model_of(**ARENA)
    _, cache = run_with_cache(model, ids_of())
    assert set(cache) == {"hook_embed", "hook_pos_embed", *(
        f"blocks.{l}.{point}" for l in range(2) for point in (
            "hook_resid_pre", "hook_attn_out", "hook_resid_post", "attn.hook_q", "attn.hook_k",
            "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z",
            "attn.hook_result"))}
    # the stream holds no position: it starts as the token embeddings alone
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], cache["hook_embed"],
                               rtol=0, atol=0)


def test_a_patched_shortformer_position_reaches_every_layers_queries_and_keys():
    model = model_of(**ARENA)
    ids = ids_of()
    _, clean = run_with_cache(model, ids)
    _, moved = run_with_hooks_cache(model, ids, [("hook_pos_embed", lambda p, name: p * 0)])
    for layer in range(2):
        assert not torch.allclose(moved[f"blocks.{layer}.attn.hook_q"],
                                  clean[f"blocks.{layer}.attn.hook_q"])
    qkv = model.blocks[0].attn.qkv  # with no positions, layer 0's q reads the embedding alone
    q_alone = qkv.weight[:C] @ clean["hook_embed"][0, 0] + qkv.bias[:C]
    torch.testing.assert_close(moved["blocks.0.attn.hook_q"][0, 0].flatten(), q_alone)
    torch.testing.assert_close(moved["blocks.0.attn.hook_v"], clean["blocks.0.attn.hook_v"])


def run_with_hooks_cache(model, ids, hooks):
    store = {}

    def keep(tensor, name):
        store[name] = tensor.detach().clone()

    names = [n for n in run_with_cache(model, ids)[1]]
    logits = run_with_hooks(model, ids, [*hooks, *((n, keep) for n in names)])
    return logits, store


@pytest.mark.parametrize("switches", [ARENA, dict(attn_only=True, position="rope",
                                                  norm="rmsnorm", n_kv_head=2)],
                         ids=["arena", "attn-only llama"])
def test_kv_cache_decoding_equals_recomputing(switches):
    model = model_of(**switches)
    prompt = ids_of(1)[:, :3]
    cached = generate(model, prompt, max_new_tokens=6, temperature=0.0, use_cache=True)
    again = generate(model, prompt, max_new_tokens=6, temperature=0.0, use_cache=False)
    assert torch.equal(cached, again)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_hook_scale_is_the_divisor_and_a_replaced_one_is_divided_by(norm):
    model = model_of(norm=norm)
    ids = ids_of()
    _, cache = run_with_cache(model, ids)
    stream = cache["blocks.1.hook_resid_post"]
    centred = stream - stream.mean(-1, keepdim=True) if norm == "layernorm" else stream
    scale = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + model.config.norm_eps)
    torch.testing.assert_close(cache["ln_final.hook_scale"], scale, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(cache["ln_final.hook_normalized"], centred / scale,
                               rtol=1e-5, atol=1e-6)
    doubled = run_with_hooks(model, ids, [("ln_final.hook_scale", lambda s, name: 2 * s)])
    x_hat = centred / (2 * scale)
    gain = model.ln_f.weight
    expected = (x_hat * gain + (model.ln_f.bias if norm == "layernorm" else 0)) \
        @ model.lm_head.weight.T
    torch.testing.assert_close(doubled, expected, rtol=1e-5, atol=1e-5)


def test_hook_result_is_each_heads_share_and_sums_to_the_output():
    model = model_of()
    ids = ids_of()
    _, cache = run_with_cache(model, ids)
    attn = model.blocks[1].attn
    result = cache["blocks.1.attn.hook_result"]  # (B, T, H, C)
    z = cache["blocks.1.attn.hook_z"]  # (B, T, H, d)
    d = attn.head_dim
    for head in range(H):
        share = z[:, :, head] @ attn.proj.weight[:, head * d:(head + 1) * d].T
        torch.testing.assert_close(result[:, :, head], share, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.sum(2) + attn.proj.bias, cache["blocks.1.hook_attn_out"],
                               rtol=1e-5, atol=1e-6)

    def drop_head_2(result, name):
        result[:, :, 2] = 0.0

    torch.testing.assert_close(
        run_with_hooks(model, ids, [("blocks.1.attn.hook_result", drop_head_2)]),
        run_with_hooks(model, ids, [("blocks.1.attn.hook_z", zero_heads(2))]),
        rtol=1e-5, atol=1e-6)


def test_a_hook_point_knows_its_layer_and_keeps_its_context():
    model = model_of()
    points = {m.name: m for m in model.modules() if hasattr(m, "ctx")}
    assert points["blocks.1.attn.hook_pattern"].layer() == 1
    assert points["blocks.0.ln1.hook_scale"].layer() == 0
    with pytest.raises(InputError, match="hook_embed.*not inside a block"):
        points["hook_embed"].layer()

    def score(pattern, name):
        points[name].ctx["score"] = pattern[0, 0].diagonal().mean()

    run_with_hooks(model, ids_of(), [("blocks.1.attn.hook_pattern", score)])
    assert 0 < points["blocks.1.attn.hook_pattern"].ctx["score"] <= 1  # kept after the run


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_attention_only_model_exports_as_one_with_mlps_of_zeros(family):
    pytest.importorskip("transformers")
    from glassgpt.formats.interop import to_hf

    switches = dict(attn_only=True) if family == "gpt2" else dict(
        attn_only=True, position="rope", norm="rmsnorm", bias=False, n_kv_head=2,
        activation="swiglu")
    model = model_of(**switches)
    hf = to_hf(model)
    ids = ids_of()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids)[0], rtol=1e-5, atol=1e-5)
    assert model.config.attn_only and model.blocks[0].ffn is None  # the model left as it was


@pytest.mark.parametrize("switches, named", [
    (dict(norm="none"), "norm='none'"), (dict(position="shortformer"), "position='shortformer'")])
def test_what_no_family_holds_is_refused_by_name(switches, named):
    pytest.importorskip("transformers")
    from glassgpt.formats.interop import hf_config_from_glassgpt

    with pytest.raises(ConfigError, match=named):
        hf_config_from_glassgpt(model_of(**switches).config)


def test_switches_that_leave_nothing_to_act_on_are_refused():
    base = GPTConfig(vocab_size=V, block_size=12, n_layer=2, n_head=H, n_embd=C)
    with pytest.raises(ConfigError, match="mlp_hidden=40 sizes an MLP, but attn_only"):
        dataclasses.replace(base, attn_only=True, mlp_hidden=40)
    with pytest.raises(ConfigError, match="post_norms .* norm='none'"):
        dataclasses.replace(base, norm="none", post_norms=True, norm_offset=False)
    with pytest.raises(ConfigError, match="shortformer"):
        GPTConfig(position="shortformer", rope_scaling="linear", rope_factor=2.0)
    assert GPT(base).blocks[0].ffn is not None
