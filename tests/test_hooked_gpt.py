"""HookedGPT (glassgpt.interp.hooked_gpt): a glassgpt GPT with TransformerLens's face.

Every method against glassgpt's own numbers (the glass model, glassgpt.interp's free functions)
on tiny random models with every parameter drawn (norm gains and biases too), and every
refusal by name. ARENA's and TransformerLens's own code against TransformerLens itself:
tests/test_arena_unchanged.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tokenizers import processors

from glassgpt.config import GPTConfig
from glassgpt.errors import InputError, ModelError
from glassgpt.hooks import HookPoint
from glassgpt.interp import HookedGPT, hook_points, run_with_cache, run_with_hooks
from glassgpt.interp.methods.attribution import logit_attribution
from glassgpt.interp.methods.patching import get_act_patch_resid_pre
from glassgpt.interp.methods.scores import head_scores
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import load_model, save_model
from glassgpt.tokenizers import BPETokenizer, CharTokenizer

TEXT = "the cat sat on the mat. the dog ran to the cat. " * 20
LLAMA = dict(norm="rmsnorm", position="rope", activation="swiglu", n_kv_head=1, bias=False,
             mlp_hidden=48, tie_weights=False)


def gpt(seed: int = 0, **overrides) -> GPT:
    """A tiny GPT, every parameter drawn: gains near 1, the rest small."""
    settings = dict(vocab_size=300, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**settings, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            gain = name.endswith("weight") and param.dim() == 1 \
                and not overrides.get("norm_offset")  # Gemma's gain is 1 + weight
            param.copy_((1.0 if gain else 0.0) + 0.2 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(TEXT, 270)  # <|endoftext|> is id 0


@pytest.fixture
def model(bpe):
    return HookedGPT(gpt(), bpe)


def ids(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 270, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- building -----------------------------------------------------------------------------

def test_the_glass_model_is_a_submodule_and_to_moves_cfg(bpe):
    glass = gpt()
    model = HookedGPT(glass, bpe)
    assert model.glass is glass and list(model.parameters()) == list(glass.parameters())
    model.to(torch.float64)
    assert model.cfg.dtype == torch.float64 and glass.tok_emb.weight.dtype == torch.float64
    assert model.train().glass.training and not model.eval().glass.training


def test_from_run_opens_a_run_as_sample_does(tmp_path, bpe):
    save_model(tmp_path / "run", gpt(), bpe)
    model = HookedGPT.from_run(tmp_path / "run")
    glass, _ = load_model(tmp_path / "run")
    torch.testing.assert_close(model(ids()), glass(ids())[0], atol=1e-5, rtol=0)
    assert model.cfg.model_name == "run" and model.tokenizer.bos_token_id == 0


def test_what_is_no_glassgpt_model_or_a_too_large_tokenizer_is_refused(bpe):
    with pytest.raises(ModelError, match="wraps a glassgpt GPT"):
        HookedGPT(torch.nn.Linear(2, 2), bpe)
    with pytest.raises(ModelError, match="more than the model's vocab_size=40"):
        HookedGPT(gpt(vocab_size=40), bpe)


def test_cfg_has_transformer_lens_names():
    cfg = HookedGPT(gpt()).cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_model, cfg.d_mlp, cfg.d_vocab,
            cfg.n_ctx) == (2, 2, 16, 32, 128, 300, 16)
    assert (cfg.act_fn, cfg.normalization_type, cfg.positional_embedding_type,
            cfg.n_key_value_heads, cfg.attn_only) == ("gelu_new", "LN", "standard", None, False)
    llama = HookedGPT(gpt(**LLAMA)).cfg
    assert (llama.act_fn, llama.gated_mlp, llama.normalization_type, llama.d_mlp,
            llama.positional_embedding_type, llama.n_key_value_heads) == \
        ("silu", True, "RMS", 48, "rotary", 1)
    arena = HookedGPT(gpt(attn_only=True, norm="none", position="shortformer")).cfg
    assert (arena.attn_only, arena.d_mlp, arena.normalization_type,
            arena.positional_embedding_type) == (True, None, None, "shortformer")


# --- running ------------------------------------------------------------------------------

def test_forward_takes_text_texts_and_ids_as_glassgpt_runs_them(model):
    tokens = ids()
    assert torch.equal(model(tokens), run_with_hooks(model.glass, tokens))
    torch.testing.assert_close(model(tokens), model.glass(tokens)[0], atol=1e-5, rtol=0)
    assert torch.equal(model(tokens[0]), model(tokens[:1]))
    text = model(["the cat", "the dog"])
    torch.testing.assert_close(text, model(model.to_tokens(["the cat", "the dog"])))


def test_return_types_and_the_loss_are_transformer_lens_s(model):
    tokens = ids()
    logits, loss = model(tokens, return_type="both")
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, 300), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, by_hand, atol=1e-6, rtol=0)
    assert torch.equal(model(tokens, return_type="loss"), loss)
    assert model(tokens, return_type="loss", loss_per_token=True).shape == (2, 6)
    assert model(tokens, return_type=None) is None
    loss.backward()  # gradients flow as in TransformerLens (ARENA part 1 trains through it)
    assert model.glass.tok_emb.weight.grad.abs().sum() > 0
    with pytest.raises(InputError, match="return_type must be"):
        model(tokens, return_type="logit")


def test_a_padded_batch_of_texts_leaves_the_padding_out_of_the_loss(model):
    short, long = model.to_tokens("the cat"), model.to_tokens("the cat sat on the mat")
    batch_loss = model(["the cat sat on the mat", "the cat"], return_type="loss")
    per_token = [model(t, return_type="loss", loss_per_token=True) for t in (long, short)]
    torch.testing.assert_close(batch_loss, torch.cat(per_token, 1).mean(), atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="on the right"):
        model(["the cat sat on the mat", "the cat"], padding_side="left")


def test_stop_at_layer_returns_the_stream_negative_from_the_end(model):
    _, cache = model.run_with_cache(ids())
    torch.testing.assert_close(model(ids(), stop_at_layer=-1), cache["resid_pre", 1])
    torch.testing.assert_close(model(ids(), stop_at_layer=0, return_type="loss"),
                               cache["resid_pre", 0])
    with pytest.raises(InputError, match="stop_at_layer"):
        model(ids(), stop_at_layer=3)


def test_run_with_cache_is_glassgpt_s_cache_with_transformer_lens_options(model):
    logits, cache = model.run_with_cache(ids())
    theirs_logits, theirs = run_with_cache(model.glass, ids())
    assert list(cache) == list(theirs) and cache.model is model
    assert torch.equal(logits, theirs_logits)
    for name in theirs:
        assert torch.equal(cache[name], theirs[name])
    _, one = model.run_with_cache(ids(1), names_filter=lambda n: n.endswith("pattern"),
                                  remove_batch_dim=True)
    assert list(one) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    assert one["pattern", 1].shape == (2, 7, 7)
    _, named = model.run_with_cache(ids(), names_filter="hook_embed")
    assert list(named) == ["hook_embed"]
    loss, _ = model.run_with_cache(ids(), names_filter=[], return_type="loss")
    assert loss.dim() == 0
    with pytest.raises(InputError, match="remove_batch_dim takes one prompt"):
        model.run_with_cache(ids(2), remove_batch_dim=True)
    with pytest.raises(InputError, match="hook_embd"):
        model.run_with_cache(ids(), names_filter=["hook_embd"])


# --- hooks --------------------------------------------------------------------------------

def test_a_hook_gets_the_point_edits_in_place_and_is_removed_after(model):
    seen = []

    def ablate(z, hook):
        seen.append((hook.name, hook.layer(), isinstance(hook, HookPoint)))
        z[:, :, 0] = 0.0  # in place, returning None: TransformerLens keeps the edited tensor

    clean = model(ids())
    ablated = model.run_with_hooks(ids(), fwd_hooks=[(lambda n: n.endswith("hook_z"), ablate)])
    assert seen == [("blocks.0.attn.hook_z", 0, True), ("blocks.1.attn.hook_z", 1, True)]
    by_glassgpt = run_with_hooks(model.glass, ids(), [
        (f"blocks.{layer}.attn.hook_z", lambda z, name: z.index_fill(2, torch.tensor([0]), 0.0))
        for layer in range(2)])
    assert torch.equal(ablated, by_glassgpt)
    assert torch.equal(model(ids()), clean)  # the hook is gone


def test_ctx_stays_on_the_point_until_reset_hooks_clears_it(model):
    def remember(pattern, hook):
        hook.ctx["max"] = pattern.max().item()

    model.run_with_hooks(ids(), fwd_hooks=[("blocks.1.attn.hook_pattern", remember)])
    assert model.blocks[1].attn.hook_pattern.ctx["max"] > 0  # ARENA reads it after the run
    model.run_with_hooks(ids(), fwd_hooks=[], clear_contexts=True)
    assert model.blocks[1].attn.hook_pattern.ctx == {}
    model.run_with_hooks(ids(), fwd_hooks=[("blocks.1.attn.hook_pattern", remember)])
    model.reset_hooks()
    assert model.hook_dict["blocks.1.attn.hook_pattern"].ctx == {}


def test_hooks_kept_with_reset_hooks_end_false_run_until_reset(model):
    clean = model(ids())
    zero_embed = ("hook_embed", lambda x, hook: torch.zeros_like(x))
    first = model.run_with_hooks(ids(), fwd_hooks=[zero_embed], reset_hooks_end=False)
    assert torch.equal(model(ids()), first)
    model.reset_hooks()
    assert torch.equal(model(ids()), clean)


def test_add_hook_permanent_and_nested_hook_contexts(model):
    clean = model(ids())
    calls = []
    model.add_hook("hook_embed", lambda x, hook: calls.append("perm"), is_permanent=True)
    model.add_hook(lambda n: n == "hook_embed", lambda x, hook: calls.append("temp"))
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: calls.append("outer"))]):
        with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: calls.append("inner"))]):
            model(ids())
        model(ids())
    assert calls == ["perm", "temp", "outer", "inner", "perm", "temp", "outer"]
    model.reset_hooks()
    calls.clear()
    model(ids())
    assert calls == ["perm"]
    model.reset_hooks(including_permanent=True)
    calls.clear()
    assert torch.equal(model(ids()), clean)
    assert calls == []


def test_the_cache_holds_what_the_attached_hooks_left(model):
    model.add_hook("blocks.0.attn.hook_z", lambda z, hook: torch.zeros_like(z))
    _, cache = model.run_with_cache(ids())
    assert cache["z", 0].abs().max() == 0
    model.reset_hooks()


@pytest.mark.parametrize("hooks, message", [
    ([("hook_embd", lambda x, hook: None)], "did you mean hook_embed"),
    ([("hook_embed", lambda x: None)], r"fn\(tensor, hook=point\)"),
    ([("hook_embed", lambda x, *, point: None)], r"fn\(tensor, hook=point\)"),
    ([(lambda n: False, lambda x, hook: None)], "selects no hook point"),
    ([("hook_embed",)], "a hook is a"), ("hook_embed", "hooks must be a list")])
def test_bad_hooks_are_refused_before_the_run(model, hooks, message):
    with pytest.raises(InputError, match=message):
        model.run_with_hooks(ids(), fwd_hooks=hooks)
    assert model._attached == []


def test_a_failing_hook_leaves_no_hook_behind(model):
    clean = model(ids())

    def broken(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks(ids(), fwd_hooks=[("hook_embed", broken)])
    assert torch.equal(model(ids()), clean)


def test_hook_dict_and_mod_dict_use_transformer_lens_names(model):
    assert list(model.hook_dict) == list(hook_points(model.glass))
    assert model.mod_dict["blocks.0.mlp"] is model.glass.blocks[0].ffn
    assert model.mod_dict["ln_final"] is model.glass.ln_f


def test_glassgpt_interp_functions_take_a_hooked_gpt(model):
    assert torch.equal(run_with_cache(model, ids())[0], run_with_cache(model.glass, ids())[0])
    _, clean_cache = run_with_cache(model, ids(seed=2))
    def metric(logits):
        return logits.sum()

    torch.testing.assert_close(get_act_patch_resid_pre(model, ids(), clean_cache, metric),
                               get_act_patch_resid_pre(model.glass, ids(), clean_cache, metric))
    torch.testing.assert_close(head_scores(model, half=4).induction,
                               head_scores(model.glass, half=4).induction)
    torch.testing.assert_close(logit_attribution(model, ids(), 3).values,
                               logit_attribution(model.glass, ids(), 3).values)


def test_loss_fn_refuses_what_is_no_logits_and_tokens(model):
    logits = model(ids())
    torch.testing.assert_close(model.loss_fn(logits, ids()), model(ids(), return_type="loss"))
    with pytest.raises(InputError, match="loss_fn takes logits"):
        model.loss_fn(logits, ids()[:, :3])


# --- text ---------------------------------------------------------------------------------

def test_bos_is_end_of_text_and_texts_pad_with_it(model, bpe):
    tokenizer = model.tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 0, 0)
    assert tokenizer.bos_token == "<|endoftext|>" and len(tokenizer) == 270
    assert model.cfg.default_prepend_bos
    assert model.to_tokens("the cat")[0].tolist() == [0, *bpe.encode("the cat")]
    assert model.to_tokens("the cat", prepend_bos=False)[0].tolist() == bpe.encode("the cat")
    right = model.to_tokens(["the cat sat", "the"])
    left = model.to_tokens(["the cat sat", "the"], padding_side="left")
    n = len(bpe.encode("the"))
    assert right[1, 1 + n:].eq(0).all() and left[1, :-1 - n].eq(0).all()
    assert right[1, :1 + n].tolist() == left[1, -1 - n:].tolist()
    assert model.to_tokens(TEXT).shape == (1, 16)  # truncated to n_ctx
    assert model.to_tokens(TEXT, truncate=False).shape[1] > 16
    with pytest.raises(InputError, match="padding_side"):
        model.to_tokens(["a", "bb"], padding_side="middle")


def test_token_strings_and_positions(model, bpe):
    pieces = [bpe.decode([token]) for token in bpe.encode(" the cat")]  # " the", " cat"
    assert model.to_str_tokens(" the cat") == ["<|endoftext|>", *pieces]
    assert model.to_str_tokens(model.to_tokens(" the cat")) == ["<|endoftext|>", *pieces]
    assert model.to_str_tokens([" the", " cat"], prepend_bos=False) == [[" the"], [" cat"]]
    assert model.to_string(model.to_tokens("the cat")[0]) == "<|endoftext|>the cat"
    assert model.to_string(model.to_tokens(["the cat", "a dog"], prepend_bos=False)) == \
        ["the cat", "a dog"]
    cat = model.to_single_token(" cat")
    assert cat == bpe.encode(" cat")[0] and model.to_single_str_token(cat) == " cat"
    text = " the cat sat on the cat"
    where = [1 + i for i, token in enumerate(bpe.encode(text)) if token == cat]  # after BOS
    assert len(where) == 2
    assert model.get_token_position(" cat", text) == where[0]
    assert model.get_token_position(cat, text, mode="last") == where[-1]
    assert model.get_token_position(cat, model.to_tokens(text), mode="last") == where[-1]
    with pytest.raises(InputError, match="is not a single token"):
        model.to_single_token("the cat")
    with pytest.raises(InputError, match="does not occur"):
        model.get_token_position(" the", "the cat")
    with pytest.raises(InputError, match="one text"):
        model.to_str_tokens(ids(2))


def test_the_tokenizer_face_transformer_lens_code_reads(model, bpe):
    tokenizer = model.tokenizer
    assert tokenizer.encode("the cat") == bpe.encode("the cat")
    assert tokenizer.decode(torch.tensor(bpe.encode("the cat"))) == "the cat"
    assert tokenizer("the cat")["input_ids"] == bpe.encode("the cat")
    batch = tokenizer([" the cat", " the"], return_tensors="pt", padding=True)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (2, 2)
    assert batch["attention_mask"].tolist() == [[1, 1], [1, 0]]
    assert batch["input_ids"][1].tolist() == [*bpe.encode(" the"), 0]


def test_a_character_tokenizer_has_no_bos():
    chars = CharTokenizer.from_text(TEXT)
    model = HookedGPT(gpt(vocab_size=chars.vocab_size), chars)
    assert model.tokenizer.bos_token_id is None and not model.cfg.default_prepend_bos
    assert model.to_tokens("cat")[0].tolist() == chars.encode("cat")
    with pytest.raises(InputError, match="no BOS token"):
        model.to_tokens("cat", prepend_bos=True)
    with pytest.raises(InputError, match="padding token"):
        model(["cat", "the cat"])


def test_a_text_of_one_token_plays_bos_where_the_tokenizer_has_none(tmp_path, bpe):
    """ARENA reads model.tokenizer.bos_token_id: a character run names its line break."""
    chars = CharTokenizer.from_text(TEXT + "\n")
    save_model(tmp_path / "run", gpt(vocab_size=chars.vocab_size), chars)
    model = HookedGPT.from_run(tmp_path / "run", bos="\n")
    newline = chars.encode("\n")[0]
    assert (model.tokenizer.bos_token_id, model.tokenizer.bos_token) == (newline, "\n")
    assert model.cfg.default_prepend_bos and model.tokenizer.pad_token_id == newline
    assert model.to_tokens("cat")[0].tolist() == [newline, *chars.encode("cat")]
    assert model.to_tokens("cat", prepend_bos=False)[0].tolist() == chars.encode("cat")
    assert model.to_tokens(["cat", "a"])[1].tolist() == [newline, *chars.encode("a"), newline,
                                                         newline]  # padded with it, too
    assert HookedGPT(gpt(), bpe, bos=" the").tokenizer.bos_token_id == bpe.encode(" the")[0]
    again = HookedGPT(model.glass, model.tokenizer, bos="a")  # a HookedGPT's tokenizer, rewrapped
    assert again.tokenizer.bos_token_id == chars.encode("a")[0]
    for not_one_token in ["ca", "", "\u20ac", 10]:  # two, none, not in the vocabulary, no text
        with pytest.raises(InputError, match="is not one token of this char tokenizer"):
            HookedGPT.from_run(tmp_path / "run", bos=not_one_token)
    with pytest.raises(InputError, match="needs a tokenizer"):
        HookedGPT(gpt(), bos="\n")


def test_a_tokenizer_that_starts_texts_with_a_special_token_makes_it_bos(bpe):
    inner = BPETokenizer.from_json(bpe.to_json())
    inner.tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    model = HookedGPT(gpt(), BPETokenizer(inner.tokenizer))
    assert model.tokenizer.bos_token_id == 0
    assert model.tokenizer.encode("the") == [0, *bpe.encode("the")]
    assert model.to_tokens("the")[0].tolist() == [0, *bpe.encode("the")]  # BOS once


def test_text_without_a_tokenizer_or_of_the_wrong_type_is_refused():
    model = HookedGPT(gpt())
    with pytest.raises(InputError, match="has no tokenizer"):
        model("the cat")
    with pytest.raises(InputError, match="input must be"):
        model([1, 2, 3])


# --- weights ------------------------------------------------------------------------------

def test_weights_in_transformer_lens_layout_compute_the_cached_activations(model):
    _, cache = model.run_with_cache(ids())
    for layer in range(2):
        x = cache["normalized", layer, "ln1"] * model.blocks[layer].ln1.weight \
            + model.blocks[layer].ln1.bias  # (B, T, C)
        for act, W, b in (("q", model.W_Q, model.b_Q), ("k", model.W_K, model.b_K),
                          ("v", model.W_V, model.b_V)):
            computed = torch.einsum("btc,hcd->bthd", x, W[layer]) + b[layer]
            torch.testing.assert_close(computed, cache[act, layer], atol=1e-5, rtol=0)
        out = torch.einsum("bthd,hdc->btc", cache["z", layer], model.W_O[layer]) + \
            model.b_O[layer]
        torch.testing.assert_close(out, cache["attn_out", layer], atol=1e-5, rtol=0)
        pre = cache["normalized", layer, "ln2"] * model.blocks[layer].ln2.weight + \
            model.blocks[layer].ln2.bias
        torch.testing.assert_close(pre @ model.W_in[layer] + model.b_in[layer],
                                   cache["pre", layer], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache["post", layer] @ model.W_out[layer] + model.b_out[layer],
                                   cache["mlp_out", layer], atol=1e-5, rtol=0)
    final = cache["ln_final.hook_normalized"] * model.ln_f.weight + model.ln_f.bias
    torch.testing.assert_close(final @ model.W_U + model.b_U, model(ids()), atol=1e-5, rtol=0)
    assert model.W_E is model.glass.tok_emb.weight and model.W_pos is model.glass.pos_emb.weight
    torch.testing.assert_close(model.QK.AB, model.W_Q @ model.W_K.transpose(-2, -1))
    torch.testing.assert_close(model.OV.AB, model.W_V @ model.W_O)


def test_grouped_keys_repeat_for_the_query_heads_they_serve():
    model = HookedGPT(gpt(**{**LLAMA, "n_head": 4, "n_kv_head": 2, "position": "learned"}))
    _, cache = model.run_with_cache(ids())
    x = cache["normalized", 0, "ln1"] * model.blocks[0].ln1.weight  # (B, T, C)
    keys = torch.einsum("btc,hcd->bthd", x, model.W_K[0])  # (B, T, 4, d)
    torch.testing.assert_close(keys, cache["k", 0].repeat_interleave(2, dim=2), atol=1e-5,
                               rtol=0)
    assert model.b_K.shape == (2, 4, 8) and not model.b_K.any()  # no bias reads as zeros
    up = torch.einsum("btc,cf->btf", cache["normalized", 0, "ln2"] * model.blocks[0].ln2.weight,
                      model.W_in[0])
    torch.testing.assert_close(up, cache["pre_linear", 0], atol=1e-5, rtol=0)
    assert model.W_gate.shape == (2, 32, 48)


def test_weights_a_model_lacks_are_refused_by_name():
    for settings, weight, message in (({"attn_only": True}, "W_in", "attn_only"),
                                      ({"position": "rope"}, "W_pos", "no W_pos"),
                                      ({}, "W_gate", "gated MLP")):
        with pytest.raises(InputError, match=message):
            getattr(HookedGPT(gpt(**settings)), weight)


# --- processing the weights ---------------------------------------------------------------

@pytest.mark.parametrize("settings", [{}, LLAMA, {**LLAMA, "norm_offset": True}],
                         ids=["gpt2", "llama", "gemma-offset"])
def test_fold_ln_keeps_the_logits_and_the_callers_model(bpe, settings):
    glass = gpt(**settings)
    before = {name: p.clone() for name, p in glass.state_dict().items()}
    folded = HookedGPT(glass, fold_ln=True)
    torch.testing.assert_close(folded(ids()), HookedGPT(glass)(ids()), atol=1e-5, rtol=0)
    assert all(torch.equal(before[name], p) for name, p in glass.state_dict().items())
    gain = folded.ln_f.gain if settings.get("norm_offset") else folded.ln_f.weight
    assert torch.equal(gain, torch.ones(32)) and folded.glass is not glass
    assert folded.cfg.normalization_type == ("LNPre" if not settings else "RMSPre")


def test_centring_keeps_the_logits_or_the_log_probs():
    glass = gpt()
    plain = HookedGPT(glass)(ids())
    centred = HookedGPT(glass, fold_ln=True, center_writing_weights=True)
    torch.testing.assert_close(centred(ids()), plain, atol=1e-5, rtol=0)
    assert centred.W_E.mean(-1).abs().max() < 1e-6 and centred.W_O.mean(-1).abs().max() < 1e-6
    unembedded = HookedGPT(glass)
    unembedded.center_unembed()
    logits = unembedded(ids())
    torch.testing.assert_close(logits.log_softmax(-1), plain.log_softmax(-1), atol=1e-5, rtol=0)
    assert not torch.allclose(logits, plain) and unembedded.W_U.mean(-1).abs().max() < 1e-6


@pytest.mark.parametrize("settings, process, message", [
    ({"pre_ln": False}, "fold_layer_norm", "Pre-LN"),
    ({"norm": "none"}, "fold_layer_norm", "no norms"),
    ({"position": "shortformer"}, "fold_layer_norm", "shortformer"),
    (LLAMA, "center_writing_weights", "needs LayerNorm"),
    ({"logit_softcap": 30.0}, "center_unembed", "soft-caps")])
def test_processing_that_would_change_the_output_is_refused(settings, process, message):
    model = HookedGPT(gpt(**settings))
    with pytest.raises(ModelError, match=message):
        getattr(model, process)()
