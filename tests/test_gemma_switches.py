"""The switches of Gemma on the glass model: local layers with a sliding window (and a rotary
base of their own), the attention scale `query_pre_attn_scalar`, the attention soft-cap, norms
after attention and MLP, RMSNorm's `1 + w`, the embedding scale and GeGLU. Each against a
float64 reference written out here (or against transformers' own Gemma norm); the band is
masked in training and in every decoding path, and every engine gives the eager tokens."""

from __future__ import annotations

import math

import pytest
import torch

from glassgpt import ConfigError, GPTConfig
from glassgpt.attention import MultiHeadSelfAttention, build_attention_mask
from glassgpt.block import GeGLUFeedForward, TransformerBlock, sandwich_sublayers
from glassgpt.decoding.generate import generate
from glassgpt.interp import run_with_cache
from glassgpt.model import GPT, count_parameters, parameter_count
from glassgpt.norms import RMSNorm
from test_decoding import SAMPLING, eager_tokens, prompt, tiny_gpt
from test_model_families import check_every_engine_gives_the_eager_tokens, randomized

W = 3  # the window of the tiny models: a query sees itself and 2 keys before it
# Every Gemma switch at once: layers 0 and 2 local with their own base, layer 1 global (its
# rotary scaled), own head width, one K/V head, scale and both soft-caps.
GEMMA = dict(vocab_size=37, block_size=24, n_layer=3, n_head=2, n_kv_head=1, n_embd=24,
             head_dim=16, bias=False, position="rope", rope_theta=1e4, sliding_window=W,
             local_layers=[0, 2], rope_local_theta=100.0, rope_scaling="linear",
             rope_factor=2.0, query_pre_attn_scalar=10.0, attn_softcap=4.0, logit_softcap=5.0,
             post_norms=True, norm="rmsnorm", norm_offset=True, embed_scale=True,
             qk_norm=True, activation="geglu", mlp_hidden=40)


def attention_by_hand(attn: MultiHeadSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Attention head by head in float64 loops, position by position: query t sees key s when
    s <= t and (for a local layer) t - s < W; scores times `scale`, soft-capped."""
    B, T, _ = x.shape
    q, k, v = attn.project(x)  # (B, H, T, d), 2 x (B, H_kv, T, d): after QK-norm and rotary
    scale = attn.scale if attn.scale is not None else 1 / math.sqrt(attn.head_dim)
    out = torch.zeros(B, attn.n_heads, T, attn.head_dim, dtype=x.dtype)
    for h in range(attn.n_heads):
        g = attn.kv_head_of(h)
        for t in range(T):
            seen = [s for s in range(t + 1) if attn.window is None or t - s < attn.window]
            scores = torch.stack([(q[:, h, t] * k[:, g, s]).sum(-1) * scale for s in seen], -1)
            if attn.softcap is not None:
                scores = attn.softcap * torch.tanh(scores / attn.softcap)
            weights = torch.softmax(scores, dim=-1)  # (B, len(seen))
            out[:, h, t] = sum(weights[:, i, None] * v[:, g, s] for i, s in enumerate(seen))
    return attn.proj(out.transpose(1, 2).reshape(B, T, -1))


# --- each switch against its reference ------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1])  # a local layer and the global one
def test_local_and_global_attention_equal_a_per_position_loop_in_float64(layer):
    model = randomized(GPT(GPTConfig(**GEMMA)).double())
    attn = model.blocks[layer].attn
    assert attn.window == (W if layer != 1 else None)
    x = torch.randn(2, 8, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    expected = attention_by_hand(attn, x)
    for impl in ("fused", "explicit"):
        attn.impl = impl
        torch.testing.assert_close(attn(x), expected, rtol=1e-12, atol=1e-12)


def test_without_the_soft_cap_a_local_layer_takes_the_fused_kernel_and_agrees():
    model = randomized(GPT(GPTConfig(**{**GEMMA, "attn_softcap": None})).double())
    attn = model.blocks[0].attn
    x = torch.randn(1, 9, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(attn(x), attention_by_hand(attn, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("T", "S"), [(6, 6), (1, 9), (3, 9), (2, 2)])
def test_the_band_mask_is_the_window_rule_at_every_position(T, S):
    mask = build_attention_mask(T, S, True, None, torch.device("cpu"), window=W)
    expected = torch.tensor([[s <= t + S - T and t + S - T - s < W for s in range(S)]
                             for t in range(T)])
    if mask is None:  # every key visible: only when no key is out of the band or the future
        assert expected.all()
    else:
        assert torch.equal(mask[0, 0], expected)


def test_the_local_layers_rotate_with_their_own_base_unscaled_and_the_global_scaled():
    model = GPT(GPTConfig(**GEMMA))
    local, glob = model.blocks[0].attn.rotary, model.blocks[1].attn.rotary
    assert (local.theta, local.scaling) == (100.0, None)
    assert glob.theta == 1e4 and glob.scaling.kind == "linear"
    assert [model.config.is_local(i) for i in range(3)] == [True, False, True]


def test_the_offset_rmsnorm_is_transformers_gemma_norm():
    gemma = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    theirs = gemma.Gemma3RMSNorm(16, eps=1e-6)
    ours = RMSNorm(16, eps=1e-6, offset=True)
    assert torch.equal(ours.weight, torch.zeros(16))  # 1 + 0: the identity gain to start
    with torch.no_grad():
        theirs.weight.normal_(generator=torch.Generator().manual_seed(1))
        ours.weight.copy_(theirs.weight)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float32, torch.bfloat16):  # bf16: (1 + w) before the cast, as Gemma
        assert torch.equal(ours.to(dtype)(x.to(dtype)), theirs.to(dtype)(x.to(dtype)))
    torch.testing.assert_close(ours.gain, 1 + ours.weight)


def test_geglu_is_the_tanh_gelu_gate_times_up_then_down_in_float64():
    ffn = GeGLUFeedForward(8, 12).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    a = x @ ffn.gate.weight.T
    gelu = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))
    expected = (gelu * (x @ ffn.up.weight.T)) @ ffn.proj.weight.T
    torch.testing.assert_close(ffn(x), expected, rtol=1e-12, atol=1e-12)


def test_a_block_with_post_norms_normalises_each_output_before_adding_it():
    config = GPTConfig(**{**GEMMA, "sliding_window": None, "local_layers": None,
                          "rope_local_theta": None})
    block = randomized(TransformerBlock.from_config(config).double())
    assert block.sublayers is sandwich_sublayers  # chosen when built
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    u = x + block.ln1_post(block.attn(block.ln1(x)))
    z = u + block.ln2_post(block.ffn(block.ln2(u)))
    torch.testing.assert_close(block(x), z, rtol=1e-12, atol=1e-12)


def test_the_embedding_scale_is_sqrt_width_rounded_to_the_weights_dtype():
    model = GPT(GPTConfig(**{**GEMMA, "n_embd": 640, "head_dim": 16, "n_head": 2}))
    idx = torch.tensor([[1, 2]])
    _, cache = run_with_cache(model, idx)
    torch.testing.assert_close(cache["hook_embed"], model.tok_emb(idx) * math.sqrt(640))
    model = model.to(torch.bfloat16)
    _, cache = run_with_cache(model, idx)
    assert torch.equal(cache["hook_embed"], model.tok_emb(idx) * 25.25)  # bf16's sqrt(640)


def test_gpt2_counts_stay_and_the_switches_add_only_their_norms():
    plain = GPTConfig(**{**GEMMA, "post_norms": False})
    gemma = GPTConfig(**GEMMA)
    extra = 2 * GEMMA["n_layer"] * GEMMA["n_embd"]  # two norms a block, one gain each
    assert count_parameters(GPT(gemma)) == count_parameters(GPT(plain)) + extra
    assert parameter_count(gemma) == count_parameters(GPT(gemma))
    assert count_parameters(GPT(GPTConfig())) == 124_439_808


# --- the band in training and in every decoding path ------------------------------------------


def reach(config: GPTConfig, T: int = 12) -> list[int]:
    """The earlier positions whose token embedding moves the last position's loss."""
    model = GPT(config)
    idx = torch.arange(T)[None] % config.vocab_size
    x = model.tok_emb(idx).detach().requires_grad_(True)
    model.tok_emb.forward = lambda _: x  # the stream starts at x, so its gradient is the reach
    logits, _ = model(idx)
    logits[0, -1].sum().backward()
    return [t for t in range(T) if x.grad[0, t].abs().max() > 0]


def test_training_masks_the_band_a_stack_of_local_layers_reaches_back_layers_times_w():
    local = dict(GEMMA, local_layers=None, attn_softcap=None)  # every layer local
    assert reach(GPTConfig(**{**local, "n_layer": 1})) == [9, 10, 11]  # itself and W - 1
    assert reach(GPTConfig(**local)) == list(range(11 - 3 * (W - 1), 12))  # 3 layers
    assert reach(GPTConfig(**GEMMA)) == list(range(12))  # a global layer sees everything


@pytest.mark.parametrize("kind", SAMPLING)
def test_cached_decoding_past_the_window_equals_recomputing_everything(kind):
    model = tiny_gpt(**GEMMA)
    idx = prompt(2, 5)  # longer than the window; 26 new tokens run past block_size too
    cached = generate(model, idx, max_new_tokens=26, use_cache=True, **SAMPLING[kind])
    assert torch.equal(cached, generate(model, idx, max_new_tokens=26, use_cache=False,
                                        **SAMPLING[kind]))


def test_a_local_layer_decodes_from_w_cached_keys_not_all_of_them():
    model = tiny_gpt(**GEMMA)
    model.setup_kv_cache(1)
    seen = []
    for sign, block in ((1, model.blocks[0]), (-1, model.blocks[1])):
        block.attn.hook_attn_scores.register_forward_hook(
            lambda module, args, scores, sign=sign: seen.append(sign * scores.shape[-1]))
    with torch.no_grad():
        model(prompt(1, 7), start_pos=0)
        model(prompt(1, 1), start_pos=7)
    assert seen == [7, -7, W, -8]  # the prefill sees its 7; the step W locally, 8 globally


def test_every_engine_gives_exactly_the_eager_tokens_past_the_window(monkeypatch):
    check_every_engine_gives_the_eager_tokens(tiny_gpt(**GEMMA), monkeypatch)


@pytest.mark.slow  # a compilation: about 20 s on two shared cores
def test_the_compiled_engine_gives_exactly_the_eager_tokens_past_the_window():
    model, idx = tiny_gpt(**GEMMA), prompt(1, 5)
    assert torch.equal(generate(model, idx, max_new_tokens=12, compiled=True, temperature=0.0),
                       eager_tokens(model, idx, 12, temperature=0.0))


# --- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "message"), [
    (dict(local_layers=[0]), "local_layers is a setting of the local layers, which need "
                             "sliding_window"),
    (dict(rope_local_theta=10.0, position="rope"), "rope_local_theta .* need sliding_window"),
    (dict(sliding_window=0), "sliding_window must be positive"),
    (dict(sliding_window=4, local_layers=[5]), "local_layers holds 5"),
    (dict(sliding_window=4, rope_local_theta=1e4), "rope_local_theta is a rotary base, but "
                                                   "position='learned'"),
    (dict(query_pre_attn_scalar=0.0), "query_pre_attn_scalar must be positive"),
    (dict(attn_softcap=-1.0), "attn_softcap must be positive"),
    (dict(norm_offset=True), "norm_offset scales an RMSNorm .* norm='layernorm'"),
    (dict(post_norms=True, pre_ln=False), "post_norms normalises the sub-layers' outputs"),
])
def test_bad_settings_of_the_gemma_switches_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        GPT(GPTConfig(**{"n_layer": 2, "n_embd": 16, "n_head": 2, **settings}))


def test_a_window_needs_a_causal_attention():
    with pytest.raises(ConfigError, match="only a causal attention"):
        MultiHeadSelfAttention.from_config(GPTConfig(sliding_window=4), causal=False)


def test_the_gemma_switches_have_flags_and_round_trip_through_json(capsys):
    from glassgpt.cli import main
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--sliding-window", "--local-layers", "--rope-local-theta",
                 "--query-pre-attn-scalar", "--attn-softcap", "--post-norms", "--norm-offset",
                 "--embed-scale"):
        assert flag in text
    config = GPTConfig(**GEMMA)
    assert GPTConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["local_layers"] == [0, 2]


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_attribution_through_post_norms_adds_up_to_the_logit(norm):
    from glassgpt.interp.methods.attribution import logit_attribution
    settings = {**GEMMA, "norm": norm, "norm_offset": norm == "rmsnorm", "bias": True,
                "logit_softcap": None}
    model = randomized(GPT(GPTConfig(**settings)).double().eval())
    idx = prompt(1, 9)
    found = logit_attribution(model, idx, 4, pos=6)
    with torch.no_grad():
        logits, _ = model(idx)
    assert found.values.sum().item() == pytest.approx(float(logits[0, 6, 4]), abs=1e-9)
    assert found.logit == pytest.approx(float(logits[0, 6, 4]), abs=1e-9)
    if norm == "layernorm":  # the post-norm's shift is a part of its own
        assert "L0 attn norm bias" in found.labels


def test_every_panel_of_the_view_answers_for_a_model_with_every_gemma_switch():
    from glassgpt.tokenizers import CharTokenizer
    from glassgpt.view.inspector import RunView
    tokenizer = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .,;:!?'-ABCDE"[:37])
    view = RunView(randomized(GPT(GPTConfig(**GEMMA))).eval(), tokenizer)
    text = "abc def ghi jkl"
    T = len(view.encode(text).ids)
    assert view.attention(text, 0)["window"] == W and view.attention(text, 1)["window"] is None
    predictions = view.predictions(text, 5)
    assert len(predictions["layers"]) == GEMMA["n_layer"] + 1
    view.overview(text)
    head = view.head(text, 2, 1, T - 1)
    assert head["window"] == W
    assert view.mlp(text, 1, T - 1)["gated"]
    view.ablate(text, 5, heads=[[1, 0]])
    found = view.attribution(text, T - 1)
    assert found["sum"] == pytest.approx(found["logit"], abs=1e-4)  # through the post norms
