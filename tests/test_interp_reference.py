"""glassgpt.interp against TransformerLens on the same weights (issue 29).

A tiny random Hugging Face GPT-2 and Llama (grouped KV heads, rotary) are imported into glassgpt;
TransformerLens 4.x's TransformerBridge boots over the very same transformers model object
(offline: the model and a tokenizer are passed in, no weight processing). Every activation both
caches under one name must agree in shape and within 1e-5 in float32, and the patching functions
must give TransformerLens's numbers.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")
os.environ.setdefault("WANDB_MODE", "disabled")

from transformer_lens import patching as lens_patching  # noqa: E402
from transformer_lens.model_bridge import TransformerBridge  # noqa: E402

from glassgpt.hf.interop import from_hf  # noqa: E402
from glassgpt.interp import patching, run_with_cache  # noqa: E402

TOL = 1e-5
SHAPES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_layer=2, n_head=2, n_embd=16, n_positions=16, vocab_size=50,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   hidden_size=32, intermediate_size=48, max_position_embeddings=16,
                   vocab_size=50, bos_token_id=None, eos_token_id=None, pad_token_id=None)),
}
# What the issue asks glassgpt to name; each must exist in glassgpt's cache and TransformerLens's.
EXPECTED = ["hook_embed", "blocks.{l}.hook_resid_pre", "blocks.{l}.ln1.hook_normalized",
            "blocks.{l}.attn.hook_q", "blocks.{l}.attn.hook_k", "blocks.{l}.attn.hook_v",
            "blocks.{l}.attn.hook_attn_scores", "blocks.{l}.attn.hook_pattern",
            "blocks.{l}.attn.hook_z", "blocks.{l}.hook_attn_out", "blocks.{l}.hook_resid_mid",
            "blocks.{l}.ln2.hook_normalized", "blocks.{l}.mlp.hook_pre",
            "blocks.{l}.mlp.hook_post", "blocks.{l}.hook_mlp_out", "blocks.{l}.hook_resid_post",
            "ln_final.hook_normalized"]
ONLY = {"gpt2": ["hook_pos_embed"],
        "llama": ["blocks.{l}.attn.hook_rot_q", "blocks.{l}.attn.hook_rot_k"]}


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    """(architecture, glassgpt model, TransformerLens bridge) over one random HF model."""
    config_class, model_class, shape = SHAPES[request.param]
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_class)(getattr(transformers, config_class)(**shape))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in hf_model.parameters():  # norm scales and biases too: nothing hides
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    hf_model.eval()
    ours = from_hf(hf_model).eval()  # first: the bridge wraps the HF modules in place
    path = tmp_path_factory.mktemp(request.param)
    hf_model.config.save_pretrained(path)
    bridge = TransformerBridge.boot_transformers(str(path), hf_model=hf_model, device="cpu",
                                                 tokenizer=tiny_tokenizer())
    return request.param, ours, bridge


def ids(batch: int = 2, length: int = 7, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))


def names_for(arch: str, n_layer: int) -> list[str]:
    names = []
    for template in EXPECTED + ONLY[arch]:
        layers = range(n_layer) if "{l}" in template else [0]
        names.extend(template.format(l=layer) for layer in layers)
    return names


def test_every_activation_equals_transformer_lens(pair) -> None:
    arch, model, bridge = pair
    tokens = ids()
    ours_logits, ours = run_with_cache(model, tokens)
    with torch.no_grad():
        lens_logits, lens = bridge.run_with_cache(tokens)
    torch.testing.assert_close(ours_logits, lens_logits, atol=TOL, rtol=0)
    wanted = names_for(arch, model.config.n_layer)
    assert set(wanted) <= set(ours), sorted(set(wanted) - set(ours))
    assert set(wanted) <= set(lens.keys()), sorted(set(wanted) - set(lens.keys()))
    for name in wanted:
        a, b = ours[name], lens[name]
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if name.endswith("hook_attn_scores"):  # masked cells: -inf here, finfo.min there
            causal = torch.ones(a.shape[-2:], dtype=torch.bool).tril()
            assert torch.all(a[..., ~causal] < -1e30) and torch.all(b[..., ~causal] < -1e30)
            a, b = a[..., causal], b[..., causal]
        torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("function", ["get_act_patch_resid_pre", "get_act_patch_attn_out",
                                      "get_act_patch_mlp_out",
                                      "get_act_patch_attn_head_out_all_pos"])
def test_patching_equals_transformer_lens(pair, function) -> None:
    arch, model, bridge = pair
    clean, corrupted = ids(seed=5), ids(seed=6)
    answer, wrong = 7, 11
    _, clean_cache = run_with_cache(model, clean)
    with torch.no_grad():
        clean_logits, lens_clean_cache = bridge.run_with_cache(clean)
        corrupted_logits = bridge(corrupted)
    metric = patching.normalized_logit_diff(clean_logits, corrupted_logits, answer, wrong)
    ours = getattr(patching, function)(model, corrupted, clean_cache, metric)
    theirs = getattr(lens_patching, function)(bridge, corrupted, lens_clean_cache, metric)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=TOL, rtol=0)
