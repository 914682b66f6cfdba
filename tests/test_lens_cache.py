"""The cache TransformerLens users index and analyse (issue 40): `glassgpt.interp.core.utils`'s
get_act_name and to_numpy, ActivationCache's TransformerLens keys, its batch axis, and its
analysis (accumulated_resid, decompose_resid, stack_head_results, ..., logit_attrs).

The analysis is held three ways: equal to TransformerLens 4.3's ActivationCache on its
TransformerBridge over the same weights (GPT-2 and Llama, `test_interp_reference.boot`); every
decomposition adding up to the cached stream on every block family glassgpt builds (learned or
rotary positions, LayerNorm, RMSNorm or no norm, attn_only, shortformer); and the logit
attributions of the full decomposition adding up to the logit difference where the final norm
has no gain (TransformerLens's folded-weights assumption made true).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_gpt
from glassgpt.errors import InputError
from glassgpt.interp import run_with_cache
from glassgpt.interp.core.cache import ActivationCache, MissingActivationError
from glassgpt.interp.core.utils import get_act_name, to_numpy

TOL = 1e-5
SHAPE = dict(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32)
FAMILIES = {
    "gpt2": {},
    "llama": dict(norm="rmsnorm", position="rope", activation="swiglu", n_kv_head=2,
                  bias=False),
    "attn_only": dict(attn_only=True),
    "no_norm": dict(norm="none"),
    "shortformer": dict(position="shortformer"),
}


def random_model(**overrides) -> torch.nn.Module:
    """A tiny glassgpt GPT with every parameter drawn (gains and biases too: nothing hides);
    smaller without norms, whose stream would otherwise grow to hundreds."""
    model = tiny_gpt(**{**SHAPE, **overrides}).eval()
    generator = torch.Generator().manual_seed(1)
    spread = 0.1 if overrides.get("norm") == "none" else 0.3
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * spread)
    return model


def tokens(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def gpt2_run():
    torch.manual_seed(0)
    model = random_model()
    logits, cache = run_with_cache(model, tokens())
    return model, logits, cache


# -- get_act_name and to_numpy ---------------------------------------------------------------

ACT_NAME_CASES = [("embed",), ("pos_embed",), ("k6",), ("scale4ln1",), ("pre5",), ("k", 6, "a"),
                  ("pre", 2), ("normalized", 27, "ln2"), ("normalized",), ("scale",),
                  ("pattern", 3), ("attn", 3), ("pattern3",), ("result", 0), ("q0a",),
                  ("resid_pre", 1), ("resid_mid", 0), ("attn_out", 1, "b"), ("z", 0, "attention"),
                  ("mlp_out", 1, "block"), ("v", 1, "m"), ("scale", 1, "ln1"), ("scale", 1, "ln2"),
                  ("attn_scores", 0), ("attn_logits", 0), ("query", 0), ("key", 1), ("value", 1),
                  ("mlp_pre", 1), ("mlp_post", 1), ("pre_linear", 1), ("rot_q", 1), ("rot_k", 0),
                  ("mlp_in", 0), ("post", 0, "mlp"), ("resid_post", 1, None), ("hook_embed",),
                  ("blocks.0.attn.hook_q",), ("ln_final.hook_scale",)]


def test_get_act_name_is_transformer_lens_s():
    lens_utils = pytest.importorskip("transformer_lens.utilities")
    for case in ACT_NAME_CASES:
        assert get_act_name(*case) == lens_utils.get_act_name(*case), case
    assert get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"
    assert get_act_name("scale4ln1") == "blocks.4.ln1.hook_scale"


def test_get_act_name_reads_what_transformer_lens_garbles():
    assert get_act_name("resid_pre5") == "blocks.5.hook_resid_pre"  # TL: hook_resid_pre5
    assert get_act_name("scale", None, "ln_final") == "ln_final.hook_scale"


@pytest.mark.parametrize("args, message", [
    (("nonsense",), "unknown activation name 'nonsense'.*resid_pre"),
    (("resid_pre", 0, "ln3"), "unknown layer type 'ln3'"),
    (("resid_pre", -1), "negative layer"),
    (("resid_pre", True), "a layer is a block index"),
    ((3,), "an activation name is a string"),
])
def test_get_act_name_refuses_by_name(args, message):
    with pytest.raises(InputError, match=message):
        get_act_name(*args)


def test_to_numpy():
    assert np.array_equal(to_numpy(torch.arange(3)), np.arange(3))
    half = to_numpy(torch.ones(2, dtype=torch.bfloat16, requires_grad=True))
    assert half.dtype == np.float32 and np.array_equal(half, np.ones(2))
    assert np.array_equal(to_numpy([1, 2]), np.array([1, 2])) and to_numpy(2.5) == 2.5
    array = np.zeros(2)
    assert to_numpy(array) is array
    with pytest.raises(InputError, match="to_numpy takes"):
        to_numpy({"a": 1})


# -- indexing ---------------------------------------------------------------------------------

def test_every_key_form_reads_the_activation(gpt2_run):
    _, _, cache = gpt2_run
    raw = dict(cache.items())
    assert cache["pattern", 0] is raw["blocks.0.attn.hook_pattern"]
    assert cache["pattern", 0, "attn"] is raw["blocks.0.attn.hook_pattern"]
    assert cache["pattern1"] is raw["blocks.1.attn.hook_pattern"]
    assert cache["embed"] is raw["hook_embed"] and cache[("pos_embed",)] is raw["hook_pos_embed"]
    assert cache[("k", -1, None)] is raw["blocks.1.attn.hook_k"]
    assert cache["resid_pre", -2] is raw["blocks.0.hook_resid_pre"]
    assert cache["result", 1] is raw["blocks.1.attn.hook_result"]
    assert cache["scale", 0, "ln1"] is raw["blocks.0.ln1.hook_scale"]
    assert cache["scale", 1, "ln2"] is raw["blocks.1.ln2.hook_scale"]
    assert cache["scale"] is raw["ln_final.hook_scale"]
    assert cache["post", 0] is raw["blocks.0.mlp.hook_post"]
    assert ("z", -1) in cache and "embed" in cache and "blocks.0.hook_mlp_in" in cache
    assert ("z", 5) not in cache and "nonsense" not in cache and 3 not in cache
    assert cache.get("nonsense") is None and cache.get(("pattern", 9)) is None
    assert list(cache.keys()) == list(raw) and len(cache.values()) == len(raw)


@pytest.mark.parametrize("key, message", [
    (("pattern", 5), "no hook point 'blocks.5.attn.hook_pattern'.*did you mean"),
    ("blocks.1.hook_resid_pr", "did you mean blocks.1.hook_resid_pre"),
    ("nonsense", "unknown activation name 'nonsense'"),
    (("resid_pre", 0, "ln3"), "unknown layer type"),
    (3, "a cache key is a hook name or"),
])
def test_a_missing_key_names_itself(gpt2_run, key, message):
    _, _, cache = gpt2_run
    with pytest.raises(MissingActivationError, match=message):
        cache[key]


def test_remove_batch_dim_in_place_for_one_prompt():
    model = random_model()
    _, cache = run_with_cache(model, tokens(batch=1))
    pattern = cache["pattern", 0]
    assert cache.has_batch_dim and cache.remove_batch_dim() is cache and not cache.has_batch_dim
    assert torch.equal(cache["pattern", 0], pattern[0]) and cache["resid_post", 1].shape == (7, 32)
    assert cache.remove_batch_dim() is cache and cache["embed"].shape == (7, 32)  # once only
    _, two = run_with_cache(model, tokens(batch=2))
    with pytest.raises(InputError, match="a batch of 2"):
        two.remove_batch_dim()
    assert two.has_batch_dim and two["embed"].shape == (2, 7, 32)


def test_batch_slices_and_devices(gpt2_run):
    model, _, cache = gpt2_run
    second = cache.apply_slice_to_batch_dim(1)
    assert not second.has_batch_dim and torch.equal(second["z", 0], cache["z", 0][1])
    assert second.model is model and torch.equal(second.ids, cache.ids[1])
    kept = cache.apply_slice_to_batch_dim([1])
    assert kept.has_batch_dim and kept["z", 0].shape[0] == 1
    moved = ActivationCache(dict(cache.items()), cache.ids, model)
    assert moved.to("meta") is moved and moved["embed"].device.type == "meta"
    assert moved.ids.device.type == "meta" and cache["embed"].device.type == "cpu"


# -- the analysis against TransformerLens's ---------------------------------------------------

@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lens_pair(request, tmp_path_factory):
    """(glassgpt cache, TransformerLens cache) of one run on the same weights."""
    pytest.importorskip("transformer_lens")
    from test_interp_reference import boot
    _, model, bridge = boot(request.param, tmp_path_factory.mktemp(request.param))
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(3))
    _, ours = run_with_cache(model, ids)
    with torch.no_grad():
        _, lens = bridge.run_with_cache(ids)
    return model, ours, lens  # the model: the cache holds it weakly


def same(ours, lens) -> None:
    if isinstance(ours, tuple):
        assert ours[1] == list(lens[1])
        ours, lens = ours[0], lens[0]
    assert ours.shape == lens.shape
    torch.testing.assert_close(ours, lens, atol=TOL, rtol=0)


METHOD_CALLS = [
    ("accumulated_resid", dict(return_labels=True)),
    ("accumulated_resid", dict(layer=1, incl_mid=True, return_labels=True)),
    ("accumulated_resid", dict(apply_ln=True, pos_slice=[1, 3])),
    ("accumulated_resid", dict(layer=1, apply_ln=True, mlp_input=True, return_labels=True)),
    ("decompose_resid", dict(return_labels=True)),
    ("decompose_resid", dict(layer=1, mlp_input=True, apply_ln=True, return_labels=True)),
    ("decompose_resid", dict(mode="attn", apply_ln=True, pos_slice=2, return_labels=True)),
    ("decompose_resid", dict(mode="mlp", incl_embeds=False, return_labels=True)),
    ("stack_head_results", dict(return_labels=True)),
    ("stack_head_results", dict(layer=1, incl_remainder=True, return_labels=True)),
    ("stack_head_results", dict(apply_ln=True, pos_slice=(1, 5))),
    ("stack_head_results", dict(layer=0, incl_remainder=True, return_labels=True)),
    ("stack_neuron_results", dict(layer=2, return_labels=True)),
    ("stack_neuron_results", dict(layer=1, incl_remainder=True, mlp_input=True,
                                  return_labels=True)),
    ("stack_neuron_results", dict(layer=2, apply_ln=True, neuron_slice=[0, 5],
                                  return_labels=True)),
    ("stack_neuron_results", dict(layer=2, neuron_slice=3, pos_slice=-1, return_labels=True)),
    ("get_full_resid_decomposition", dict(return_labels=True)),
    ("get_full_resid_decomposition", dict(layer=1, mlp_input=True, return_labels=True)),
    ("get_full_resid_decomposition", dict(apply_ln=True, return_labels=True)),
    ("get_full_resid_decomposition", dict(expand_neurons=False, apply_ln=True, pos_slice=-1,
                                          return_labels=True)),
    ("get_neuron_results", dict(layer=1, neuron_slice=(2, 6))),
    ("stack_activation", dict(activation_name="pattern")),
    ("stack_activation", dict(activation_name="scale", layer=1, sublayer_type="ln2")),
]


def test_every_analysis_equals_transformer_lens(lens_pair):
    model, ours, lens = lens_pair
    for method, kwargs in METHOD_CALLS:
        try:
            same(getattr(ours, method)(**kwargs), getattr(lens, method)(**kwargs))
        except AssertionError as error:
            raise AssertionError(f"{method}({kwargs}): {error}") from None
    direction = torch.randn(model.config.n_embd, 3, generator=torch.Generator().manual_seed(5))
    same(ours.stack_neuron_results(2, project_output_onto=direction, apply_ln=True),
         lens.stack_neuron_results(2, project_output_onto=direction, apply_ln=True))
    same(ours.get_full_resid_decomposition(project_output_onto=direction[:, 0]),
         lens.get_full_resid_decomposition(project_output_onto=direction[:, 0]))


def test_logit_attrs_and_apply_ln_equal_transformer_lens(lens_pair):
    _, ours, lens = lens_pair
    stack, lens_stack = ours.decompose_resid(), lens.decompose_resid()
    right, wrong = torch.tensor([3, 7]), torch.tensor([5, 9])
    same(ours.logit_attrs(stack, right, wrong), lens.logit_attrs(lens_stack, right, wrong))
    same(ours.logit_attrs(stack[:, :, -1], right, wrong, pos_slice=-1),
         lens.logit_attrs(lens_stack[:, :, -1], right, wrong, pos_slice=-1))
    same(ours.logit_attrs(stack, 4), lens.logit_attrs(lens_stack, 4))
    per_position = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    same(ours.logit_attrs(stack, per_position, batch_slice=[1]),
         lens.logit_attrs(lens_stack, per_position, batch_slice=[1]))
    same(ours.apply_ln_to_stack(stack, 1, mlp_input=True),
         lens.apply_ln_to_stack(lens_stack, 1, mlp_input=True))
    with pytest.raises(InputError, match="one shape"):
        ours.logit_attrs(stack, right, 4)
    with pytest.raises(InputError, match="no tokenizer"):
        ours.logit_attrs(stack, " road")


def test_without_the_batch_axis_equal_transformer_lens(lens_pair):
    model, ours, lens = lens_pair
    ours, lens = ours.apply_slice_to_batch_dim([0]), lens.apply_slice_to_batch_dim([0])
    ours.remove_batch_dim()
    lens.remove_batch_dim()
    same(ours.decompose_resid(apply_ln=True, return_labels=True),
         lens.decompose_resid(apply_ln=True, return_labels=True))
    same(ours.get_full_resid_decomposition(apply_ln=True, pos_slice=-1),
         lens.get_full_resid_decomposition(apply_ln=True, pos_slice=-1))
    same(ours.accumulated_resid(apply_ln=True), lens.accumulated_resid(apply_ln=True))
    stack = ours.stack_head_results(incl_remainder=True)
    same(ours.logit_attrs(stack, 3, 5, has_batch_dim=False),
         lens.logit_attrs(lens.stack_head_results(incl_remainder=True), 3, 5,
                          has_batch_dim=False))


# -- every decomposition adds up to the stream, on every family --------------------------------

@pytest.fixture(scope="module", params=list(FAMILIES))
def family_run(request):
    torch.manual_seed(0)
    model = random_model(**FAMILIES[request.param])
    logits, cache = run_with_cache(model, tokens())
    return request.param, model, logits, cache


def sums_to(stack: torch.Tensor, stream: torch.Tensor) -> None:
    torch.testing.assert_close(stack.sum(0), stream, atol=TOL, rtol=0)


def test_decompositions_add_up_to_the_stream(family_run):
    family, model, _, cache = family_run
    final = cache["resid_post", -1]
    stack, labels = cache.decompose_resid(return_labels=True)
    sums_to(stack, final)
    assert ("pos_embed" in labels) == (family in ("gpt2", "attn_only", "no_norm"))
    assert any("mlp" in label for label in labels) == (family != "attn_only")
    sums_to(cache.decompose_resid(layer=1), cache["resid_pre", 1])
    for expand in (True, False):
        full, labels = cache.get_full_resid_decomposition(expand_neurons=expand,
                                                          return_labels=True)
        sums_to(full, final)
        assert labels[-1] == "bias" and labels[:2] == ["L0H0", "L0H1"]
    sums_to(cache.get_full_resid_decomposition(layer=0), cache["resid_pre", 0])
    sums_to(cache.stack_head_results(incl_remainder=True), final)
    b_o = model.blocks[0].attn.proj.bias
    attn_out = cache.stack_head_results(layer=1).sum(0) + (0 if b_o is None else b_o)
    torch.testing.assert_close(attn_out, cache["attn_out", 0], atol=TOL, rtol=0)
    if family != "attn_only":
        sums_to(cache.decompose_resid(layer=1, mlp_input=True), cache["resid_mid", 1])
        sums_to(cache.get_full_resid_decomposition(layer=1, mlp_input=True),
                cache["resid_mid", 1])
        sums_to(cache.stack_neuron_results(2, incl_remainder=True), final)
        sums_to(cache.stack_neuron_results(1, incl_remainder=True, mlp_input=True),
                cache["resid_mid", 1])


def test_head_results_are_z_through_each_head_s_w_o(family_run):
    _, model, _, cache = family_run
    attn = model.blocks[1].attn
    z = cache["z", 1]  # (B, T, H, d)
    for head in range(4):
        w_o = attn.proj.weight[:, head * 8:(head + 1) * 8]  # (C, d)
        torch.testing.assert_close(cache["result", 1][:, :, head], z[:, :, head] @ w_o.T,
                                   atol=TOL, rtol=0)
    computed = ActivationCache({k: v for k, v in cache.items() if "hook_result" not in k},
                               cache.ids, model)
    computed.compute_head_results()
    torch.testing.assert_close(computed["result", 1], cache["result", 1], atol=TOL, rtol=0)


def test_apply_ln_divides_as_the_norm_does(family_run):
    """A stream through apply_ln_to_stack is the norm's own x_hat (centred for a LayerNorm,
    divided by the run's scale, no gain); with no norm it is the stream itself."""
    family, model, logits, cache = family_run
    into_block_1 = cache.accumulated_resid(layer=1)  # (2, B, T, C): 0_pre, 1_pre
    normed = cache.apply_ln_to_stack(into_block_1, 1)
    if family == "no_norm":
        assert torch.equal(normed, into_block_1)
    else:
        torch.testing.assert_close(normed[-1], cache["normalized", 1, "ln1"], atol=TOL, rtol=0)
    if family not in ("no_norm", "attn_only"):
        mid = cache.accumulated_resid(layer=1, mlp_input=True)[-1:]  # (1, B, T, C): 1_mid
        torch.testing.assert_close(cache.apply_ln_to_stack(mid, 1, mlp_input=True)[0],
                                   cache["normalized", 1, "ln2"], atol=TOL, rtol=0)
    final = cache.accumulated_resid(apply_ln=True)[-1]  # the logit lens: ln_final itself
    torch.testing.assert_close(final @ model.lm_head.weight.T, logits, atol=TOL, rtol=0)


def test_logit_attrs_of_the_whole_stream_add_up_to_the_logit_difference(family_run):
    """TransformerLens assumes the final norm's gain folded into W_U: with a unit gain and no
    shift the attributions of every part add up to the logit difference exactly."""
    family, model, _, _ = family_run
    if family != "no_norm":
        with torch.no_grad():
            model.ln_f.weight.fill_(1.0)
            if getattr(model.ln_f, "bias", None) is not None:
                model.ln_f.bias.zero_()
    logits, cache = run_with_cache(model, tokens())
    right, wrong = torch.tensor([3, 7]), torch.tensor([5, 9])
    attrs = cache.logit_attrs(cache.get_full_resid_decomposition(), right, wrong)  # (parts, B, T)
    difference = logits[0, :, 3] - logits[0, :, 5], logits[1, :, 7] - logits[1, :, 9]
    torch.testing.assert_close(attrs.sum(0), torch.stack(difference), atol=TOL, rtol=0)


# -- what the analysis refuses ------------------------------------------------------------------

def test_refusals_name_the_problem(gpt2_run):
    model, _, cache = gpt2_run
    with pytest.raises(InputError, match="mode must be"):
        cache.decompose_resid(mode="heads")
    with pytest.raises(InputError, match="layer must be an int in \\[0, n_layer = 2\\]"):
        cache.accumulated_resid(layer=3)
    with pytest.raises(InputError, match="pos_slice must be"):
        cache.decompose_resid(pos_slice="last")
    with pytest.raises(InputError, match="token ids in \\[0, 40\\)"):
        cache.logit_attrs(cache.decompose_resid(), 40)
    with pytest.raises(InputError, match="has no model"):
        ActivationCache(dict(cache.items()), cache.ids).decompose_resid()
    models = [random_model(attn_only=True), random_model(pre_ln=False),
              random_model(norm="rmsnorm", post_norms=True)]  # held: a cache holds it weakly
    attn_only, post_ln, sandwich = (run_with_cache(m, tokens())[1] for m in models)
    with pytest.raises(InputError, match="attn_only"):
        attn_only.stack_neuron_results(2)
    with pytest.raises(InputError, match="Post-LN"):
        post_ln.decompose_resid()
    sums_to(sandwich.decompose_resid(), sandwich["resid_post", -1])  # sub-layer outputs add up
    with pytest.raises(InputError, match="post_norms"):
        sandwich.stack_head_results()


class Wrapper(torch.nn.Module):
    """What HookedGPT is to the cache: a module holding the glass model as `.glass`, with a
    tokenizer's to_single_token."""

    def __init__(self, glass: torch.nn.Module):
        super().__init__()
        self.glass = glass

    def to_single_token(self, text: str) -> int:
        return {" road": 7, " path": 9}[text]


def test_a_wrapper_s_cache_reads_the_glass_weights_and_its_tokens(gpt2_run):
    model, _, cache = gpt2_run
    wrapper = Wrapper(model)
    wrapped = ActivationCache(dict(cache.items()), cache.ids, wrapper)
    stack = cache.get_full_resid_decomposition()
    same(wrapped.get_full_resid_decomposition(), stack)
    same(wrapped.logit_attrs(stack, " road", " path"), cache.logit_attrs(stack, 7, 9))


def test_a_cache_built_in_transformer_lens_s_order(gpt2_run):
    """ARENA builds caches as TransformerLens's ActivationCache(cache_dict, model)."""
    model, _, cache = gpt2_run
    built = ActivationCache(dict(cache.items()), model)
    assert built.model is model and built.ids is None and built.has_batch_dim
    same(built.decompose_resid(), cache.decompose_resid())
    single = ActivationCache({k: v[0] for k, v in cache.items()}, model, False)
    assert not single.has_batch_dim and single.model is model
    same(single.decompose_resid(pos_slice=-1), cache.decompose_resid(pos_slice=-1)[:, 0])
