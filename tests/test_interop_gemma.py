"""Hugging Face interop of Gemma 3 (`gemma3_text`): local layers beside global ones, each kind
with its rotary base, four 1 + w norms a block, scaled embeddings, GeGLU, QK-norm, the
attention scale and the final soft-cap; and of Gemma 2 (`gemma2`), the same block without
QK-norm, with one rotary and soft-capped attention scores. Tiny random models, read from a
save_pretrained directory as a user has one: logits equal transformers' in float32, greedy
tokens equal its `generate` over prompts longer than the window, the export loads back
through AutoModelForCausalLM; transformers 4's rotary fields read as transformers 5's table;
what would not be exact is refused by name; a bf16 checkpoint imports bit for bit."""

from __future__ import annotations

import json
import types

import pytest
import torch

from glassgpt import ConfigError, GPTConfig
from glassgpt.cli import main
from glassgpt.decoding.generate import generate
from glassgpt.formats.convert import import_run
from glassgpt.formats.interop import (
    MissingExtraError,
    config_from_hf,
    from_hf,
    hf_config_from_glassgpt,
)
from glassgpt.formats.rotary import layered_rope_kwargs
from glassgpt.rundir.checkpoint import load_model

transformers = pytest.importorskip("transformers")
from test_interop_families import check_import_and_export_exactly  # noqa: E402
from test_interop_modern import (  # noqa: E402
    check_run_samples_and_exports,
    logits_of,
    randomize,
    tokenizer_and_data,  # noqa: F401  (a fixture)
    tokens,
)

TOLERANCE = 1e-5
GENERATION_SCALE = 0.1  # small weights keep greedy decoding of a random model from looping
S, F = "sliding_attention", "full_attention"
# Heads of 16 beside a width of 32, a window of 4 or 5 tokens, distinct bases, a final cap.
SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_attention_heads=4,
             head_dim=16, max_position_embeddings=64, query_pre_attn_scalar=12,
             final_logit_softcapping=3.0)
VARIANTS = {
    "mqa-2-to-1": ("Gemma3", dict(
        num_hidden_layers=3, num_key_value_heads=1, sliding_window=4, layer_types=[S, S, F],
        rope_parameters={F: {"rope_type": "default", "rope_theta": 1e6},
                         S: {"rope_type": "default", "rope_theta": 1e4}})),
    "gqa-linear-untied": ("Gemma3", dict(
        num_hidden_layers=4, num_key_value_heads=2, sliding_window=5, layer_types=[S, F, S, S],
        tie_word_embeddings=False,
        rope_parameters={F: {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
                         S: {"rope_type": "default", "rope_theta": 1e3}})),
    # Gemma 2: alternating layers (its default), scores capped at 2 so that the cap bites
    "gemma2-softcap": ("Gemma2", dict(
        num_hidden_layers=3, num_key_value_heads=2, sliding_window=4, attn_logit_softcapping=2.0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
}
CLASSES = {"Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
           "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}
PROMPT = "To be or not to be, that is the question"  # more tokens than the window


def hf_model(variant: str = "mqa-2-to-1", seed: int = 0, scale: float = 0.3,
             **changes) -> torch.nn.Module:
    family, shape = VARIANTS[variant]
    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    config = config_class(**{**SMALL, **shape, **changes}, bos_token_id=None, eos_token_id=None,
                          pad_token_id=None)
    model = model_class(config)
    randomize(model, seed, scale)
    return model.eval()


def saved(model: torch.nn.Module, path) -> str:
    model.save_pretrained(path)
    return str(path)


def edit_config(path, **changes) -> dict:
    settings = json.loads((path / "config.json").read_text())
    settings.update(changes)
    (path / "config.json").write_text(json.dumps(settings))
    return settings


@pytest.mark.parametrize("variant", VARIANTS)
def test_gemma_imports_and_exports_exactly(variant, tmp_path) -> None:
    # 16 tokens are three windows; the 6-token prompt decodes past the window
    check_import_and_export_exactly(hf_model(variant), tmp_path, prompt_tokens=6)


def test_gemma_maps_to_its_own_switches() -> None:
    plain, scaled, gemma2 = (from_hf(hf_model(variant)).config for variant in VARIANTS)
    assert (plain.sliding_window, plain.local_layers, plain.n_kv_head) == (4, (0, 1), 1)
    assert (plain.rope_theta, plain.rope_local_theta, plain.rope_scaling) == (1e6, 1e4, None)
    assert (plain.query_pre_attn_scalar, plain.logit_softcap, plain.head_dim) == (12.0, 3.0, 16)
    assert plain.post_norms and plain.norm_offset and plain.embed_scale and plain.qk_norm
    assert plain.activation == "geglu" and plain.tie_weights and not scaled.tie_weights
    assert (scaled.local_layers, scaled.rope_scaling, scaled.rope_factor) == ((0, 2, 3),
                                                                              "linear", 2.0)
    assert scaled.attention_kind(1).rope_scaled and not scaled.attention_kind(0).rope_scaled
    every = from_hf(hf_model(layer_types=[S, S, S])).config  # all local: None, as GPTConfig says
    assert every.local_layers is None and every.sliding_window == 4
    none = from_hf(hf_model(layer_types=[F, F, F])).config  # no local layer: no window
    assert none.sliding_window is None and none.rope_local_theta is None
    assert (gemma2.local_layers, gemma2.attn_softcap, gemma2.rope_local_theta) == ((0, 2), 2.0,
                                                                                 None)
    assert not gemma2.qk_norm and gemma2.post_norms and gemma2.logit_softcap == 3.0
    for config in (plain, scaled, every, none, gemma2):
        assert config_from_hf(hf_config_from_glassgpt(config)) == config


@pytest.mark.parametrize("variant", ["gqa-linear-untied", "gemma2-softcap"])
def test_gemma_generates_transformers_greedy_tokens(variant) -> None:
    theirs = hf_model(variant, seed=3, scale=GENERATION_SCALE)
    model = from_hf(theirs)
    prompt = tokens(61, 9, seed=4, batch=1)  # past the window of 5
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=14, min_new_tokens=14)
    ours = generate(model, prompt, max_new_tokens=14, temperature=0.0)
    assert torch.equal(ours, expected)
    assert len(set(ours[:, 9:].flatten().tolist())) > 3  # the tokens vary: a real comparison


def test_a_gemma3_directory_goes_through_a_run_sample_and_back_out(
        tokenizer_and_data, tmp_path, capsys) -> None:  # noqa: F811
    """convert --from-hf; `sample --temperature 0` prints transformers' greedy text over a
    prompt longer than the window; --to-hf loads back with the Auto classes."""
    tokenizer, _ = tokenizer_and_data
    assert len(tokenizer.encode(PROMPT)) > VARIANTS["mqa-2-to-1"][1]["sliding_window"]
    source = hf_model(seed=9, scale=GENERATION_SCALE, vocab_size=tokenizer.vocab_size)
    saved(source, tmp_path / "source")
    tokenizer.save(str(tmp_path / "source" / "tokenizer.json"))
    run, out = tmp_path / "run", tmp_path / "hf"
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(tmp_path / "source"), "--out", str(run)]) == 0
    summary = capsys.readouterr().out
    assert "qk_norm, " in summary and " layers local (window " in summary \
        and "post norms" in summary  # what makes it Gemma, said on the line
    idx = tokens(tokenizer.vocab_size, 20)
    check_run_samples_and_exports(run, out, source, tokenizer, idx, capsys, TOLERANCE)


def test_a_checkpoint_written_by_transformers_4_reads_as_the_same_model(tmp_path) -> None:
    """transformers 4 wrote rope_theta, rope_scaling (the global layers') and
    rope_local_base_freq, and at first sliding_window_pattern in place of layer_types."""
    theirs = hf_model("gqa-linear-untied", layer_types=[S, S, S, F])
    path = tmp_path / "hf"
    saved(theirs, path)
    settings = json.loads((path / "config.json").read_text())
    table = settings.pop("rope_parameters")
    del settings["layer_types"]
    full = table[F]
    settings.update(rope_theta=full.pop("rope_theta"), rope_scaling=full,
                    rope_local_base_freq=table[S]["rope_theta"], sliding_window_pattern=4)
    (path / "config.json").write_text(json.dumps(settings))
    model = from_hf(path)
    assert model.config == from_hf(theirs).config
    idx = tokens(61, 12)
    torch.testing.assert_close(logits_of(model, idx), logits_of(theirs, idx), atol=TOLERANCE,
                               rtol=0)
    # ... and transformers itself reads those fields as glassgpt does
    reread = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    torch.testing.assert_close(logits_of(reread, idx), logits_of(theirs, idx), atol=0, rtol=0)


def test_gemma2_caps_the_scores_and_reads_its_older_fields(tmp_path) -> None:
    """The cap bites (without it the logits move), and a config.json without layer_types
    (every second layer global) or rope_parameters (rope_theta) reads as the same model."""
    theirs = hf_model("gemma2-softcap")
    model, idx = from_hf(theirs), tokens(61, 12)
    uncapped = from_hf(hf_model("gemma2-softcap", attn_logit_softcapping=None))
    assert (logits_of(uncapped, idx) - logits_of(model, idx)).abs().max() > 1e-2
    path = tmp_path / "hf"
    saved(theirs, path)
    settings = json.loads((path / "config.json").read_text())
    del settings["layer_types"]
    settings["rope_theta"] = settings.pop("rope_parameters")["rope_theta"]
    (path / "config.json").write_text(json.dumps(settings))
    assert from_hf(path).config == model.config
    torch.testing.assert_close(logits_of(from_hf(path), idx), logits_of(theirs, idx),
                               atol=TOLERANCE, rtol=0)


def test_the_export_is_written_the_way_the_installed_transformers_takes_it() -> None:
    config = from_hf(hf_model("gqa-linear-untied")).config

    class OldConfig:  # a transformers 4 config class: no rope_parameters argument
        def __init__(self, rope_theta: float = 10000.0, rope_scaling: dict | None = None):
            pass

    assert layered_rope_kwargs(OldConfig, config) == {
        "rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_local_base_freq": 1e3}
    assert layered_rope_kwargs(transformers.Gemma3TextConfig, config) == {"rope_parameters": {
        F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
        S: {"rope_type": "default", "rope_theta": 1e3}}}


@pytest.mark.parametrize(("changes", "named"), [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(attention_bias=True), "attention_bias=True is not supported: Gemma 3 puts biases on"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu' is not supported"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1: glassgpt has one dropout rate"),
    (dict(rope_parameters={F: {"rope_type": "default", "rope_theta": 1e6},
                           S: {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}),
     "sliding_attention has rope_type='linear'"),
    (dict(rope_parameters={F: {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0},
                           S: {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_type='yarn', which glassgpt does not compute"),
    (dict(layer_types=[S, "chunked_attention", F]), "layer_types must name"),
    (dict(sliding_window=None), "sliding_window=None beside sliding_attention layers"),
])
def test_what_would_not_be_exact_is_refused_by_name(changes, named, tmp_path, capsys) -> None:
    path = tmp_path / "hf"
    path.mkdir()
    settings = hf_model().config.to_dict()
    (path / "config.json").write_text(json.dumps({**settings, **changes}))
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        from_hf(path)  # refused from config.json, before any weight is looked for
    assert main(["convert", "--from-hf", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and named.split(" ")[0] in err


GEMMA = dict(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32, position="rope",
             norm="rmsnorm", activation="geglu", bias=False, qk_norm=True, post_norms=True,
             norm_offset=True, embed_scale=True, sliding_window=4, local_layers=[0],
             rope_local_theta=1e4)


@pytest.mark.parametrize(("switches", "named"), [
    (dict(post_norms=False), "post_norms=False cannot be exported: Gemma 3"),
    (dict(qk_norm=False), "rope_local_theta=10000.0 cannot be exported: Gemma 2"),
    (dict(qk_norm=False, rope_local_theta=None, post_norms=False),
     "post_norms=False cannot be exported: Gemma 2"),
    (dict(activation="swiglu"), "activation='swiglu' cannot be exported: Gemma 3"),
    (dict(attn_softcap=50.0), "attn_softcap=50.0 cannot be exported: Gemma 3"),
    (dict(qkv_bias=True), "qkv_bias=True cannot be exported: Gemma 3"),
    (dict(query_pre_attn_scalar=12.5), "query_pre_attn_scalar=12.5 cannot be exported"),
    (dict(rope_local_theta=None, rope_scaling="linear", rope_factor=2.0),
     "rope_scaling='linear' on the local layers cannot be exported"),
    (dict(post_norms=False, norm_offset=False, embed_scale=False, activation="swiglu",
          qk_norm=False), "sliding_window=4 cannot be exported: Llama"),
])
def test_an_export_missing_a_gemma_switch_is_refused_by_name(switches, named) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        hf_config_from_glassgpt(GPTConfig(**{**GEMMA, **switches}))


def test_a_transformers_without_layer_types_is_named_not_trusted(monkeypatch) -> None:
    """Before 4.53 Gemma3TextConfig had no layer_types: it would keep the list and compute
    every sixth layer global whatever the run's layers are."""
    from glassgpt.formats import interop

    class Gemma3TextConfig:
        def __init__(self, sliding_window_pattern: int = 6, **kwargs):
            pass

    older = types.SimpleNamespace(__version__="4.50.0", Gemma3TextConfig=Gemma3TextConfig)
    monkeypatch.setattr(interop, "_transformers", lambda: older)
    with pytest.raises(MissingExtraError, match="transformers 4.50.0's Gemma3TextConfig does "
                                                "not take layer_types; upgrade it"):
        hf_config_from_glassgpt(GPTConfig(**GEMMA))


def test_a_bf16_checkpoint_imports_bit_for_bit(tokenizer_and_data, tmp_path) -> None:  # noqa: F811
    """Published in bfloat16: from_hf keeps bf16, the run import_run writes holds the same
    numbers in float32, and the norms' w stays w (no 1 + w is formed, so nothing rounds)."""
    tokenizer, _ = tokenizer_and_data
    theirs = hf_model(vocab_size=tokenizer.vocab_size).to(torch.bfloat16)
    saved(theirs, tmp_path / "hf")
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    stored = theirs.state_dict()
    ours = from_hf(tmp_path / "hf").state_dict()
    assert all(t.dtype == torch.bfloat16 for t in ours.values())
    for mine, hf_name in (("blocks.0.ln1_post.weight", "post_attention_layernorm"),
                          ("blocks.2.attn.k_norm.weight", "self_attn.k_norm"),
                          ("blocks.1.ln2.weight", "pre_feedforward_layernorm")):
        layer = mine.split(".")[1]
        assert torch.equal(ours[mine], stored[f"model.layers.{layer}.{hf_name}.weight"])
    assert torch.equal(ours["blocks.1.attn.qkv.weight"][:4 * 16],
                       stored["model.layers.1.self_attn.q_proj.weight"])
    import_run(tmp_path / "hf", tmp_path / "run")
    run_weights = load_model(tmp_path / "run")[0].state_dict()
    assert run_weights.keys() == ours.keys()
    for name, value in run_weights.items():
        assert value.dtype == torch.float32 and torch.equal(value, ours[name].float()), name
