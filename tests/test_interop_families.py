"""Hugging Face interop of the families beside GPT-2, Llama and Qwen3's plain forms: Qwen3 with
heads of their own width, Llama 3's rotary scaling (and the linear one), Qwen2 (biases on q, k
and v only) and SmolLM3 (layers without rotary). Tiny random models of each family's details,
read from a save_pretrained directory as a user has one: logits equal transformers' in float32,
greedy tokens equal its `generate`, and the export loads back through AutoModelForCausalLM."""

from __future__ import annotations

import json

import pytest
import torch

from glassgpt import ConfigError, GPTConfig
from glassgpt.cli import main
from glassgpt.decoding.generate import generate
from glassgpt.formats.interop import config_from_hf, from_hf, hf_config_from_glassgpt, save_hf
from glassgpt.formats.rotary import rope_kwargs

transformers = pytest.importorskip("transformers")
from test_interop_modern import (  # noqa: E402
    check_greedy_tokens_equal,
    check_run_samples_and_exports,
    logits_of,
    randomize,
    tokenizer_and_data,  # noqa: F401  (a fixture)
    tokens,
)

TOLERANCE = 1e-5
GENERATION_SCALE = 0.05  # small weights keep greedy decoding of a random model from looping
SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
# Head width 8 and base 10,000: the wavelengths are 6.3, 63, 628 and 6283 positions, so with an
# original context of 64 and frequency factors 1 and 8 one pair is kept, one blended and two
# stretched.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 8.0, "original_max_position_embeddings": 64}
FAMILIES = {
    "qwen3-own-head-width": ("Qwen3Config", {**SMALL, "hidden_size": 16, "head_dim": 8,
                                             "tie_word_embeddings": True},
                             {"rope_type": "default", "rope_theta": 1e6}),
    "llama-llama3": ("LlamaConfig", SMALL, LLAMA3),
    "llama-linear": ("LlamaConfig", {**SMALL, "num_hidden_layers": 1},
                     {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}),
    "qwen2": ("Qwen2Config", {**SMALL, "tie_word_embeddings": True},
              {"rope_type": "default", "rope_theta": 1e6}),
    "smollm3": ("SmolLM3Config", {**SMALL, "num_hidden_layers": 4,
                                  "no_rope_layers": [1, 0, 1, 0]}, LLAMA3),
}


def hf_model(family: str, seed: int = 0, scale: float = 0.3, **changes) -> torch.nn.Module:
    config_class, shape, rope = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**shape, **changes},
                                                 rope_parameters=dict(rope),
                                                 bos_token_id=None, eos_token_id=None,
                                                 pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, seed, scale)
    return model.eval()


def saved(model: torch.nn.Module, path) -> str:
    model.save_pretrained(path)
    return str(path)


def check_import_and_export_exactly(theirs, tmp_path, prompt_tokens: int = 3) -> None:
    """transformers' model through config.json into glassgpt: the same logits; cached decoding
    equal to recomputing; exported back, the same class and logits, and the same config."""
    model = from_hf(saved(theirs, tmp_path / "hf"))  # through config.json, as a user has it
    idx = tokens(61, 16)
    torch.testing.assert_close(logits_of(model, idx), logits_of(theirs, idx), atol=TOLERANCE,
                               rtol=0)
    prompt = tokens(61, prompt_tokens, seed=4)
    assert torch.equal(generate(model, prompt, max_new_tokens=10, temperature=0.0),
                       generate(model, prompt, max_new_tokens=10, temperature=0.0,
                                use_cache=False))
    out = save_hf(model, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(theirs)
    torch.testing.assert_close(logits_of(back, idx), logits_of(model, idx), atol=TOLERANCE,
                               rtol=0)
    assert config_from_hf(back.config) == model.config


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_imports_and_exports_exactly(family, tmp_path) -> None:
    check_import_and_export_exactly(hf_model(family), tmp_path)


def test_a_smollm3_directory_goes_through_a_run_sample_and_back_out(
        tokenizer_and_data, tmp_path, capsys) -> None:  # noqa: F811
    """convert --from-hf; `sample --temperature 0` prints transformers' greedy text; --to-hf.
    SmolLM3 with Llama 3's scaling holds the most switches (NoPE layers, rope_scaling); every
    family takes the same path through the command line."""
    tokenizer, _ = tokenizer_and_data
    source = hf_model("smollm3", seed=9, scale=0.1, vocab_size=tokenizer.vocab_size)
    saved(source, tmp_path / "source")
    tokenizer.save(str(tmp_path / "source" / "tokenizer.json"))
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["convert", "--from-hf", str(tmp_path / "source"), "--out", str(run)]) == 0
    idx = tokens(tokenizer.vocab_size, 20)
    check_run_samples_and_exports(run, out, source, tokenizer, idx, capsys, TOLERANCE)


@pytest.mark.parametrize("family", ["qwen3-own-head-width", "llama-llama3", "qwen2", "smollm3"])
def test_each_family_generates_transformers_greedy_tokens(family) -> None:
    theirs = hf_model(family, seed=3, scale=GENERATION_SCALE)
    check_greedy_tokens_equal(theirs, from_hf(theirs), 61)


def test_each_family_maps_to_its_own_switches() -> None:
    configs = {family: from_hf(hf_model(family)).config for family in FAMILIES}
    assert configs["qwen3-own-head-width"].head_dim == 8 and \
        configs["qwen3-own-head-width"].q_width == 32
    assert configs["llama-llama3"].rope_scaling == "llama3" and \
        configs["llama-llama3"].rope_original_context == 64
    assert (configs["llama-linear"].rope_scaling, configs["llama-linear"].rope_factor) == \
        ("linear", 2.0)
    assert (configs["qwen2"].bias, configs["qwen2"].qkv_bias) == (False, True)
    assert configs["smollm3"].nope_layers == (1, 3)
    for config in configs.values():  # and each goes back to its own family
        assert config_from_hf(hf_config_from_glassgpt(config)) == config


def test_a_checkpoint_written_by_transformers_4_reads_as_the_same_model(tmp_path) -> None:
    """transformers 4 wrote `rope_theta` beside `rope_scaling` (and called the kind "type")."""
    theirs = hf_model("smollm3")
    path = saved(theirs, tmp_path / "hf")
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    table = settings.pop("rope_parameters")
    settings["rope_theta"] = table.pop("rope_theta")
    settings["rope_scaling"] = {"type": table.pop("rope_type"), **table}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    model = from_hf(path)
    assert model.config == from_hf(theirs).config
    idx = tokens(61, 9)
    torch.testing.assert_close(logits_of(model, idx), logits_of(theirs, idx), atol=TOLERANCE,
                               rtol=0)


def test_the_export_is_written_the_way_the_installed_transformers_takes_it() -> None:
    config = from_hf(hf_model("llama-llama3")).config

    class OldConfig:  # a transformers 4 config class: no rope_parameters argument
        def __init__(self, rope_theta: float = 10000.0, rope_scaling: dict | None = None):
            pass

    assert rope_kwargs(OldConfig, config) == {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 64}}
    assert rope_kwargs(transformers.LlamaConfig, config)["rope_parameters"] == LLAMA3


ROTARY = dict(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32, position="rope",
              norm="rmsnorm", activation="swiglu", bias=False)


@pytest.mark.parametrize(("switches", "named"), [
    (dict(qk_norm=True, nope_layers=[1]), "nope_layers=(1,) cannot be exported: Qwen3"),
    (dict(nope_layers=[1], qkv_bias=True), "qkv_bias=True beside bias=False cannot be exported "
                                           "as SmolLM3"),
    (dict(qk_norm=True, qkv_bias=True), "cannot be exported as Qwen3"),
    (dict(qkv_bias=True, logit_softcap=3.0), "logit_softcap=3.0 cannot be exported: Qwen2"),
    (dict(bias=True, qkv_bias=False), "qkv_bias=False beside bias=True cannot be exported as "
                                      "Llama"),
])
def test_what_no_family_computes_is_refused_by_name(switches, named) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        hf_config_from_glassgpt(GPTConfig(**{**ROTARY, **switches}))
