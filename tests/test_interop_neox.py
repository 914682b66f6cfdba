"""Hugging Face GPT-NeoX (`GPTNeoXForCausalLM`) both ways: the sequential block with full rotary,
which is glassgpt's rotary LayerNorm GPT with a plain MLP. Tiny random models: logits equal
transformers' in float32, greedy tokens equal its `generate`, the export loads back through
AutoModelForCausalLM; what glassgpt would compute differently (Pythia's parallel residual, a
partial rotary) is one line naming the setting."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glassgpt import ConfigError, GPTConfig
from glassgpt.cli import main
from glassgpt.formats.interop import config_from_hf, from_hf, hf_config_from_glassgpt
from glassgpt.formats.rotary import neox_rope_kwargs
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import save_model
from glassgpt.tokenizers import CharTokenizer

transformers = pytest.importorskip("transformers")
from test_interop_families import check_import_and_export_exactly, saved  # noqa: E402
from test_interop_modern import check_greedy_tokens_equal, logits_of, randomize, tokens  # noqa: E402

TOLERANCE = 1e-5
VOCAB = 61  # check_import_and_export_exactly's prompts are drawn from 61 tokens
NEOX = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, use_parallel_residual=False,
            hidden_act="gelu")
FULL_ROTARY = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}
SHAPES = {
    "untied": ({}, FULL_ROTARY),
    "tied-gelu-new": ({"tie_word_embeddings": True, "hidden_act": "gelu_new"}, FULL_ROTARY),
    "linear-scaling": ({"num_hidden_layers": 1},
                       {**FULL_ROTARY, "rope_type": "linear", "factor": 2.0}),
}


def neox_model(shape: str = "untied", seed: int = 0, scale: float = 0.3,
               **changes) -> torch.nn.Module:
    settings, rope = SHAPES[shape]
    config = transformers.GPTNeoXConfig(**{**NEOX, **settings, **changes},
                                        rope_parameters=dict(rope), bos_token_id=None,
                                        eos_token_id=None, pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, seed, scale)
    return model.eval()


@pytest.mark.parametrize("shape", SHAPES)
def test_a_neox_model_imports_and_exports_exactly(shape, tmp_path) -> None:
    """Through config.json and model.safetensors (whose head transformers names `embed_out`)."""
    check_import_and_export_exactly(neox_model(shape), tmp_path)


def test_a_neox_model_generates_transformers_greedy_tokens() -> None:
    theirs = neox_model(seed=3, scale=0.05)
    check_greedy_tokens_equal(theirs, from_hf(theirs), VOCAB)  # a live model's head: lm_head


def test_query_key_value_is_each_heads_q_k_v_in_turn() -> None:
    """GPT-NeoX's fused projection holds [head 0's q, k, v, head 1's q, k, v, ...]; ours holds
    every head's q, then every k, then every v."""
    theirs = neox_model()
    d, C = 8, 32  # head width, model width
    fused = theirs.gpt_neox.layers[0].attention.query_key_value.weight
    qkv = from_hf(theirs).blocks[0].attn.qkv.weight
    for head in range(4):
        for part in range(3):  # q, k, v
            ours = qkv[part * C + head * d:part * C + (head + 1) * d]
            assert torch.equal(ours, fused[(3 * head + part) * d:(3 * head + part + 1) * d])


def test_a_transformers_4_directory_reads_as_the_same_model(tmp_path) -> None:
    """transformers 4 wrote the base and the rotated fraction as `rotary_emb_base` and
    `rotary_pct`, and older checkpoints (Pythia's) kept the causal mask and the rotary
    frequencies beside the weights: skipped, as transformers skips them."""
    theirs = neox_model()
    path = saved(theirs, tmp_path / "hf")
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    table = settings.pop("rope_parameters")
    settings.update(rotary_emb_base=table["rope_theta"], rotary_pct=1.0)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 64, 64)
    weights["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    weights["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    model = from_hf(path)
    assert model.config == from_hf(theirs).config
    idx = tokens(VOCAB, 9)
    torch.testing.assert_close(logits_of(model, idx), logits_of(theirs, idx), atol=TOLERANCE,
                               rtol=0)


def test_the_export_rotates_every_feature_in_either_transformers() -> None:
    """GPT-NeoX rotates a quarter of each head unless told: the export always says 1.0."""
    config = from_hf(neox_model("linear-scaling")).config

    class OldConfig:  # a transformers 4 config class: no rope_parameters argument
        def __init__(self, rotary_emb_base: float = 10000.0, rotary_pct: float = 0.25,
                     rope_scaling: dict | None = None):
            pass

    assert neox_rope_kwargs(OldConfig, config) == {
        "rotary_emb_base": 500.0, "rotary_pct": 1.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert neox_rope_kwargs(transformers.GPTNeoXConfig, config) == {
        "rope_parameters": SHAPES["linear-scaling"][1]}


RUN = dict(vocab_size=30, block_size=16, n_layer=2, n_head=4, n_embd=32, position="rope",
           norm="layernorm", mlp_hidden=24, rope_theta=500.0)


@pytest.mark.parametrize(("activation", "hidden_act", "tied"),
                         [("gelu", "gelu", False), ("gelu_tanh", "gelu_new", True)])
def test_a_rotary_layernorm_run_exports_as_gpt_neox(activation, hidden_act, tied, tmp_path,
                                                    capsys) -> None:
    """`convert --to-hf` refused a run with rotary positions and LayerNorm (neither GPT-2 nor
    Llama); it is GPT-NeoX's sequential block."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**RUN, activation=activation, tie_weights=tied)).eval()
    randomize(model, seed=5)
    run, out = tmp_path / "run", tmp_path / "hf"
    save_model(run, model, CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .,\n"))
    assert main(["convert", str(run), "--to-hf", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "GPTNeoXForCausalLM"
    assert (exported.config.hidden_act, exported.config.use_parallel_residual,
            exported.config.tie_word_embeddings) == (hidden_act, False, tied)
    idx = tokens(30, 16)
    torch.testing.assert_close(logits_of(exported, idx), logits_of(model, idx), atol=TOLERANCE,
                               rtol=0)
    assert config_from_hf(exported.config) == model.config


@pytest.mark.parametrize(("changes", "named"), [
    (dict(use_parallel_residual=True), "use_parallel_residual=True is not supported"),
    (dict(rope_parameters={**FULL_ROTARY, "partial_rotary_factor": 0.25}),
     "partial_rotary_factor=0.25 is not supported"),
    (dict(rope_parameters={**FULL_ROTARY, "rope_type": "dynamic", "factor": 2.0}),
     "rope_type='dynamic'"),
    (dict(attention_bias=False), "attention_bias=False is not supported"),
    (dict(hidden_act="gelu_fast"), "hidden_act='gelu_fast' has no glassgpt equivalent"),
    (dict(hidden_dropout=0.1), "glassgpt has one dropout rate"),
])
def test_import_refuses_what_glassgpt_computes_differently(changes, named, tmp_path) -> None:
    path = saved(neox_model(), tmp_path / "hf")
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**settings, **changes}))
    with pytest.raises(ConfigError, match=named) as raised:
        from_hf(path)
    assert "\n" not in str(raised.value)


def test_a_config_without_rotary_settings_is_pythias_quarter_rotary(tmp_path) -> None:
    """transformers rotates 25% of each head where config.json names no fraction."""
    path = saved(neox_model(), tmp_path / "hf")
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    del settings["rope_parameters"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match="rotary_pct=0.25 is not supported"):
        from_hf(path)


@pytest.mark.parametrize(("switches", "named"), [
    (dict(bias=False), "bias=False cannot be exported: GPT-NeoX"),
    (dict(pre_ln=False), "pre_ln=False cannot be exported: GPT-NeoX"),
    (dict(n_kv_head=2), "n_kv_head=2 cannot be exported: GPT-NeoX"),
    (dict(qk_norm=True), "qk_norm=True cannot be exported: GPT-NeoX"),
    (dict(qkv_bias=False), "qkv_bias=False beside bias=True cannot be exported as GPT-NeoX"),
    (dict(head_dim=16), "head_dim=16 cannot be exported: GPT-NeoX"),
    (dict(activation="relu2"), "activation='relu2' cannot be exported as GPT-NeoX"),
])
def test_export_refuses_what_gpt_neox_lacks(switches, named) -> None:
    with pytest.raises(ConfigError, match=named):
        hf_config_from_glassgpt(GPTConfig(**{**RUN, "activation": "gelu", **switches}))
