"""The switches of published small models on the glass model: a head width apart from the
model's (`head_dim`, Qwen3), biases on q, k and v only (`qkv_bias`, Qwen2), layers without
rotary positions (`nope_layers`, SmolLM3) and Llama 3's rotary scaling. Each against a float64
reference; the KV cache and every decoding engine give the eager tokens; the presets of the
real models count the parameters transformers counts."""

from __future__ import annotations

import math

import pytest
import torch

from glassgpt import ConfigError, GPTConfig
from glassgpt.attention import MultiHeadSelfAttention
from glassgpt.decoding import EagerEngine
from glassgpt.decoding.generate import generate
from glassgpt.errors import InputError
from glassgpt.experiments.references import PerHeadSelfAttention, to_torch_multihead
from glassgpt.interp import run_with_cache
from glassgpt.machine.memory import activation_floats_per_token
from glassgpt.model import GPT, count_parameters, parameter_count
from glassgpt.rotary import RotaryEmbedding
from test_decoding import SAMPLING, StaticStepEngine, eager_tokens, prompt, tiny_gpt

# One config with all four: 3 query heads of width 16 beside a width of 24, one K/V head,
# q/k/v biases and no others, layer 1 without rotary, Llama 3's scaling over a short context.
ALL_FOUR = dict(vocab_size=37, block_size=24, n_layer=3, n_head=3, n_kv_head=1, n_embd=24,
                head_dim=16, bias=False, qkv_bias=True, position="rope", nope_layers=[1],
                rope_scaling="llama3", rope_factor=4.0, rope_low_freq_factor=1.0,
                rope_high_freq_factor=4.0, rope_original_context=16, norm="rmsnorm",
                activation="swiglu", mlp_hidden=40)


def attention_by_hand(attn: MultiHeadSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """Causal attention head by head, in float64 loops over the weights' own rows: head h's
    query rows are h*d..(h+1)*d of q, its key and value those of K/V head h // groups."""
    B, T, C = x.shape
    H, d, G = attn.n_heads, attn.head_dim, attn.groups
    W, b = attn.qkv.weight, attn.qkv.bias
    q_all, kv = H * d, attn.n_kv_head * d
    outputs = []
    for h in range(H):
        g = h // G
        rows = {"q": slice(h * d, (h + 1) * d), "k": slice(q_all + g * d, q_all + (g + 1) * d),
                "v": slice(q_all + kv + g * d, q_all + kv + (g + 1) * d)}
        q, k, v = (x @ W[r].T + b[r] for r in rows.values())  # 3 x (B, T, d)
        if attn.rotary is not None:
            cos, sin = attn.rotary.cos_sin(torch.arange(T), x.dtype)
            q, k = (attn.rotary.rotate(t[:, None], cos, sin)[:, 0] for t in (q, k))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, T, T)
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        outputs.append(torch.softmax(scores, dim=-1) @ v)
    z = torch.cat(outputs, dim=-1)  # (B, T, H * d)
    return z @ attn.proj.weight.T  # no bias on proj (qkv_bias alone)


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    return model


# --- the switches against their references ----------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1])  # a rotary layer and the NoPE one
def test_own_head_width_grouped_qkv_biases_and_nope_equal_a_per_head_loop_in_float64(layer):
    model = randomized(GPT(GPTConfig(**ALL_FOUR)).double())
    attn = model.blocks[layer].attn
    assert attn.qkv.weight.shape == (3 * 16 + 2 * 16, 24) and attn.proj.weight.shape == (24, 48)
    assert attn.proj.bias is None and attn.qkv.bias is not None
    assert (attn.rotary is None) == (layer == 1)
    x = torch.randn(2, 9, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for impl in ("fused", "explicit"):
        attn.impl = impl
        torch.testing.assert_close(attn(x), attention_by_hand(attn, x), rtol=1e-12, atol=1e-12)


def test_a_nope_layer_computes_what_an_attention_without_positions_computes():
    config = GPTConfig(**ALL_FOUR)
    model = randomized(GPT(config).double())
    plain = MultiHeadSelfAttention.from_config(GPTConfig(**{**ALL_FOUR, "nope_layers": None,
                                                            "position": "none",
                                                            "rope_scaling": None,
                                                            "rope_factor": None,
                                                            "rope_low_freq_factor": None,
                                                            "rope_high_freq_factor": None,
                                                            "rope_original_context": None}))
    plain.double().load_state_dict(model.blocks[1].attn.state_dict())
    x = torch.randn(1, 7, 24, dtype=torch.float64)
    assert torch.equal(model.blocks[1].attn(x), plain(x))
    assert not torch.allclose(model.blocks[0].attn(x), plain(x))  # the rotary layer differs
    assert [config.attention_kind(i).rotary for i in range(3)] == [True, False, True]


def test_qkv_bias_adds_biases_to_q_k_and_v_and_nowhere_else():
    names = GPT(GPTConfig(**ALL_FOUR)).state_dict().keys()
    assert {n for n in names if n.endswith(".bias")} == {f"blocks.{i}.attn.qkv.bias"
                                                         for i in range(3)}
    assert GPTConfig().has_qkv_bias and not GPTConfig(bias=False).has_qkv_bias
    assert not GPTConfig(qkv_bias=False).has_qkv_bias  # biases elsewhere, none on q, k, v


def test_hook_points_see_heads_of_their_own_width():
    model = GPT(GPTConfig(**ALL_FOUR)).eval()
    _, cache = run_with_cache(model, torch.randint(0, 37, (2, 5)))
    for name in ("q", "z"):
        assert cache[f"blocks.0.attn.hook_{name}"].shape == (2, 5, 3, 16)
    assert cache["blocks.0.attn.hook_k"].shape == (2, 5, 1, 16)
    assert "blocks.0.attn.hook_rot_q" in cache and "blocks.1.attn.hook_rot_q" not in cache


def test_the_classic_references_refuse_an_own_head_width_or_qkv_only_biases():
    for settings in (dict(head_dim=16), dict(bias=False, qkv_bias=True)):
        attn = MultiHeadSelfAttention.from_config(GPTConfig(n_embd=24, n_head=3, **settings))
        assert not attn.is_classic()
        with pytest.raises(InputError, match="own head width or q/k/v-only biases"):
            PerHeadSelfAttention.from_parallel(attn)
        with pytest.raises(InputError, match="own head width or q/k/v-only biases"):
            to_torch_multihead(attn)


# --- the config ---------------------------------------------------------------------------------


def test_gpt2_and_every_saved_config_stay_as_they_were():
    config = GPTConfig()
    with torch.device("meta"):
        assert count_parameters(GPT(config)) == 124_439_808 == parameter_count(config)
    values = config.to_dict()
    assert values["head_dim"] is None and values["qkv_bias"] is None  # as before the switches
    old = {k: v for k, v in values.items() if k not in ("head_dim", "qkv_bias", "rope_scaling",
                                                         "rope_factor", "rope_low_freq_factor",
                                                         "rope_high_freq_factor",
                                                         "rope_original_context",
                                                         "nope_layers")}
    assert GPTConfig.from_dict(old) == config and config.head_dim == 64


def test_a_derived_head_width_follows_the_width_and_an_own_one_stays():
    config = GPTConfig(n_embd=64, n_head=4)
    config.n_embd = 128
    assert config.head_dim == 32 and config.to_dict()["head_dim"] is None
    config.head_dim = 8  # from now on its own
    config.n_embd = 256
    assert config.head_dim == 8 and config.q_width == 32 and config.to_dict()["head_dim"] == 8
    assert GPTConfig.from_dict(config.to_dict()) == config
    rotary = GPTConfig(n_embd=64, n_head=4, position="rope")
    with pytest.raises(ConfigError, match="must be even"):
        rotary.n_embd = 36  # heads of 9 features
    assert (rotary.n_embd, rotary.head_dim) == (64, 16)  # both as they were


def test_nope_layers_round_trip_as_a_list_and_per_layer_configs_shrink():
    config = GPTConfig(**ALL_FOUR)
    assert config.nope_layers == (1,) and config.to_dict()["nope_layers"] == [1]
    assert GPTConfig.from_dict(config.to_dict()) == config
    assert config.with_layers(1).nope_layers is None and config.with_layers(2).nope_layers == (1,)
    assert parameter_count(config) == count_parameters(GPT(config))


@pytest.mark.parametrize(("settings", "message"), [
    (dict(head_dim=0), "head_dim must be positive"),
    (dict(head_dim=7, position="rope"), "head_dim = 7 must be even"),
    (dict(nope_layers=[1]), "position='learned' has none to leave out"),
    (dict(nope_layers=[12], position="rope"), "nope_layers holds 12, not a layer of n_layer=12"),
    (dict(nope_layers=[3, 3], position="rope"), "distinct layers in order"),
    (dict(nope_layers=[True], position="rope"), "nope_layers must be a list of integers"),
    (dict(nope_layers="3", position="rope"), "nope_layers must be a list of integers"),
    (dict(qkv_bias="yes"), "qkv_bias must be bool"),
])
def test_bad_settings_of_the_new_switches_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**settings)


def test_the_new_switches_have_flags(capsys):
    from glassgpt.cli.common import _int_list
    assert _int_list("3,7,11") == (3, 7, 11)
    from glassgpt.cli import main
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = capsys.readouterr().out
    for flag in ("--head-dim", "--qkv-bias", "--no-qkv-bias", "--rope-scaling", "--nope-layers"):
        assert flag in shown


def test_the_activation_estimate_counts_the_heads_width():
    base = dict(n_layer=1, n_head=4, n_embd=32, bias=False, position="none")
    narrow, wide = (activation_floats_per_token(GPTConfig(**base, head_dim=d)) for d in (8, 16))
    assert wide - narrow == 4 * (16 - 8) * 4  # q, k, v and the heads' output, 4 heads each


# --- decoding: the cache and every engine give the eager tokens -------------------------------


@pytest.mark.parametrize("kind", SAMPLING)
def test_cached_decoding_equals_recomputing_everything(kind):
    model = tiny_gpt(**ALL_FOUR)
    idx = prompt(2, 4)
    cached = generate(model, idx, max_new_tokens=26, use_cache=True, **SAMPLING[kind])
    assert torch.equal(cached, generate(model, idx, max_new_tokens=26, use_cache=False,
                                        **SAMPLING[kind]))


def check_every_engine_gives_the_eager_tokens(model, monkeypatch) -> None:
    """The threaded CPU engine and the CUDA engine's static step (run here without a graph)
    give exactly the eager tokens, greedy and sampled, and past block_size."""
    for (B, T, new), kind in (((1, 5, 12), "greedy"), ((2, 3, 8), "top_k+top_p"),
                              ((1, 4, 28), "greedy")):  # the last runs past block_size
        idx, sampling = prompt(B, T), SAMPLING[kind]
        expected = eager_tokens(model, idx, new, **sampling)
        before = torch.get_num_threads()
        torch.set_num_threads(2)  # the threaded one-row path runs with two threads or more
        try:
            threaded = generate(model, idx, max_new_tokens=new, engine="cpu", **sampling)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(threaded, expected)
        with monkeypatch.context() as patch:
            patch.setattr("glassgpt.decoding.generate.engine_for", lambda m, name, compiled:
                          StaticStepEngine(m) if name == "cuda-graph" else EagerEngine(m))
            static = generate(model, idx, max_new_tokens=new, engine="cuda-graph", **sampling)
        assert torch.equal(static, expected)


def test_every_engine_gives_exactly_the_eager_tokens(monkeypatch):
    check_every_engine_gives_the_eager_tokens(tiny_gpt(**ALL_FOUR), monkeypatch)


@pytest.mark.slow  # a compilation: about 20 s on two shared cores
def test_the_compiled_engine_gives_exactly_the_eager_tokens():
    model, idx = tiny_gpt(**ALL_FOUR), prompt(1, 5)
    assert torch.equal(generate(model, idx, max_new_tokens=12, compiled=True, temperature=0.0),
                       eager_tokens(model, idx, 12, temperature=0.0))


# --- presets of the real models -------------------------------------------------------------------

# Each model's published config.json (the values that make its shape).
PUBLISHED = {
    "qwen3-0.6b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=1e6)),
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=32.0,
                                               low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=8192))),
    "smollm3-3b": ("SmolLM3Config", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=5e6,
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)])),
    "qwen2.5-0.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6)),
    "gemma-3-270m": ("Gemma3TextConfig", dict(  # as transformers 4.55 wrote it
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        query_pre_attn_scalar=256, sliding_window=512, rope_theta=1e6,
        rope_local_base_freq=1e4, layer_types=["full_attention" if (i + 1) % 6 == 0 else
                                                "sliding_attention" for i in range(18)])),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_of_the_real_models_count_what_transformers_counts(name):
    transformers = pytest.importorskip("transformers")
    from glassgpt.formats.interop import config_from_hf
    class_name, published = PUBLISHED[name]
    hf_config = getattr(transformers, class_name)(**published)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
            hf_config).parameters())
        ours = count_parameters(GPT(GPTConfig.from_preset(name)))
    assert ours == theirs == parameter_count(GPTConfig.from_preset(name))
    assert config_from_hf(hf_config) == GPTConfig.from_preset(name)  # the same model, read


def test_the_real_models_rotate_as_they_were_trained():
    rotary = RotaryEmbedding.from_config(GPTConfig.from_preset("llama-3.2-1b"))
    assert rotary.scaling.kind == "llama3" and rotary.head_dim == 64
    smollm3 = GPTConfig.from_preset("smollm3-3b")
    assert [i for i in range(36) if not smollm3.attention_kind(i).rotary] == list(range(3, 36, 4))
