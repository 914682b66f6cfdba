"""The patching functions glassgpt added for issue 40, each against TransformerLens 4.3's own
on the same weights: the by-position q/k/v/pattern sweeps, the pattern's (dest, src) sweep,
the stacked *_every maps, TransformerLens 4.x's reduce= / baseline= / metric mappings with
their PatchingResult, and direct path patching.

A tiny random GPT-2 and a tiny Llama with grouped K/V heads (4 query heads, 2 K/V heads) are
imported into glassgpt and TransformerLens's TransformerBridge boots over the same Hugging Face
model (test_interp_reference's `boot`); both run the same corrupted prompts with the same clean
cache's activations put back, and every map must agree within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")

from transformer_lens import patching as lens_patching  # noqa: E402

from glassgpt.config import GPTConfig  # noqa: E402
from glassgpt.errors import InputError  # noqa: E402
from glassgpt.interp import patching, run_with_cache  # noqa: E402
from glassgpt.model import GPT  # noqa: E402
from test_interp_reference import boot, ids  # noqa: E402

TOL = 1e-5
ANSWER, WRONG = 7, 11


def per_prompt(logits: torch.Tensor) -> torch.Tensor:
    """The answer's logit lead at the last position, one number per prompt (batch,)."""
    return logits[:, -1, ANSWER] - logits[:, -1, WRONG]


def one_number(logits: torch.Tensor) -> torch.Tensor:
    return per_prompt(logits).mean()


def top_logit(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].max(dim=-1).values


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def run(request, tmp_path_factory):
    """(family, glassgpt model, bridge, corrupted ids, glassgpt's clean cache, glassgpt's
    corrupted cache, TransformerLens's clean cache, its corrupted cache, clean logits): three
    prompts of three tokens."""
    family, model, bridge = boot(request.param, tmp_path_factory.mktemp(request.param))
    clean, corrupted = ids(batch=3, length=3, seed=5), ids(batch=3, length=3, seed=6)
    _, clean_cache = run_with_cache(model, clean)
    _, corrupted_cache = run_with_cache(model, corrupted)
    with torch.no_grad():
        clean_logits, lens_clean = bridge.run_with_cache(clean)
        _, lens_corrupted = bridge.run_with_cache(corrupted)
    return dict(family=family, model=model, bridge=bridge, corrupted=corrupted,
                clean_cache=clean_cache, corrupted_cache=corrupted_cache, lens_clean=lens_clean,
                lens_corrupted=lens_corrupted, clean_logits=clean_logits)


def both(run: dict, function: str, metric, **settings):
    """(glassgpt's answer, TransformerLens's) of the function of that name."""
    ours = getattr(patching, function)(run["model"], run["corrupted"], run["clean_cache"],
                                       metric, **settings)
    theirs = getattr(lens_patching, function)(run["bridge"], run["corrupted"], run["lens_clean"],
                                              metric, **settings)
    return ours, theirs


def assert_equal_maps(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=TOL, rtol=0)


NEW = ["get_act_patch_attn_head_q_by_pos", "get_act_patch_attn_head_k_by_pos",
       "get_act_patch_attn_head_v_by_pos", "get_act_patch_attn_head_pattern_by_pos",
       "get_act_patch_attn_head_pattern_dest_src_pos", "get_act_patch_block_every",
       "get_act_patch_attn_head_all_pos_every", "get_act_patch_attn_head_by_pos_every"]


@pytest.mark.parametrize("function", NEW)
def test_each_new_function_equals_transformer_lens(run, function) -> None:
    ours, theirs = both(run, function, one_number)
    assert_equal_maps(ours, theirs)
    config = run["model"].config
    if function.endswith(("k_by_pos", "v_by_pos")):  # grouped K/V heads are swept as such
        assert ours.shape[-1] == (config.n_kv_head or config.n_head)
    if function.startswith("get_act_patch_attn_head") and function.endswith("_every") \
            and config.n_kv_head not in (None, config.n_head):
        assert (ours[2:4, ..., config.n_kv_head:] == 0).all()  # padded, as TransformerLens's
    assert ours.abs().max() > 1e-3  # the maps hold numbers, not a row of zeros


def assert_same_result(ours: patching.PatchingResult, theirs) -> None:
    """Every field glassgpt's PatchingResult shares with TransformerLens's."""
    assert_equal_maps(ours.values, theirs.values)
    assert ours.axis_names == list(theirs.axis_names)
    assert ours.metric_names == list(theirs.metric_names)
    assert ours.reduced == theirs.reduced and ours.has_metric_axis == theirs.has_metric_axis
    assert ours.patch_type_names == theirs.patch_type_names
    assert (ours.baseline is None) == (theirs.baseline is None)
    if ours.baseline is not None:
        assert_equal_maps(ours.baseline, theirs.baseline)


def test_per_prompt_values_and_baseline_equal_transformer_lens(run) -> None:
    ours, theirs = both(run, "get_act_patch_attn_head_k_by_pos", per_prompt, reduce="none",
                        baseline=True)
    assert_same_result(ours, theirs)
    assert ours.values.shape[-1] == 3  # one value per prompt
    clean = per_prompt(run["clean_logits"])
    for method in ("mean", "stderr", "effect"):
        assert_equal_maps(getattr(ours, method)(), getattr(theirs, method)())
    # normalized divides by clean - corrupted: float32's error grows by as much
    spread = (clean - theirs.baseline).abs().min()
    torch.testing.assert_close(ours.normalized(clean), theirs.normalized(clean),
                               atol=TOL / spread, rtol=0)


def test_stacked_results_with_a_baseline_equal_transformer_lens(run) -> None:
    ours, theirs = both(run, "get_act_patch_block_every", per_prompt, reduce="none",
                        baseline=True)
    assert_same_result(ours, theirs)
    assert ours.values.shape[:2] == (3, run["model"].config.n_layer)
    assert_equal_maps(ours.effect(), theirs.effect())


def test_a_mapping_of_metrics_equals_transformer_lens(run) -> None:
    metrics = {"lead": per_prompt, "top": top_logit}
    ours, theirs = both(run, "get_act_patch_attn_head_all_pos_every", metrics, reduce="mean")
    assert_same_result(ours, theirs)  # (metric, 5, L, H), K/V heads padded
    for name in metrics:
        assert_same_result(ours[name], theirs[name])
    numbers = {"lead": one_number, "top": lambda logits: top_logit(logits).mean()}
    ours, theirs = both(run, "get_act_patch_attn_head_pattern_by_pos", numbers, baseline=True)
    assert_same_result(ours, theirs)  # (metric, L, H, T): the pattern's own axes


def test_mean_is_the_mean_of_the_per_prompt_values(run) -> None:
    args = (run["model"], run["corrupted"], run["clean_cache"], per_prompt)
    kept = patching.get_act_patch_attn_head_all_pos_every(*args, reduce="none", baseline=True)
    mean = patching.get_act_patch_attn_head_all_pos_every(*args, reduce="mean")
    assert torch.equal(mean, kept.values.mean(dim=-1)) and torch.equal(mean, kept.mean())
    one = patching.get_act_patch_attn_head_all_pos_every(run["model"], run["corrupted"],
                                                         run["clean_cache"], one_number)
    torch.testing.assert_close(one, mean, atol=1e-6, rtol=0)


# --- direct path patching ------------------------------------------------------------------------

def direct_paths(run: dict, function: str, *args, **settings):
    ours = getattr(patching, function)(run["model"], run["corrupted"], run["clean_cache"],
                                       run["corrupted_cache"], one_number, *args, **settings)
    theirs = getattr(lens_patching, function)(run["bridge"], run["corrupted"],
                                              run["lens_clean"], run["lens_corrupted"],
                                              one_number, *args, verbose=False, **settings)
    return ours, theirs


def test_direct_path_equals_transformer_lens(run) -> None:
    components = ["q", "k", "v"] if run["family"] == "gpt2" else ["q"]  # GQA: q only
    for component in components:
        ours, theirs = direct_paths(run, "get_act_patch_direct_path", 0, 1, component=component)
        assert_equal_maps(ours, theirs)
        assert (ours[0] == 0).all() and ours[1].abs().max() > 1e-5
    ours, theirs = direct_paths(run, "get_act_patch_direct_path_all_sources")
    assert_equal_maps(ours, theirs)


def test_direct_path_into_k_or_v_is_refused_only_where_heads_share_them(run) -> None:
    """As TransformerLens refuses it: the Llama's K/V heads each serve two query heads, so a
    path into one query head's k or v does not exist; GPT-2's heads each have their own."""
    for component in ("k", "v"):
        if run["family"] == "llama":
            with pytest.raises(InputError, match="K/V heads"):
                direct_paths(run, "get_act_patch_direct_path", 0, 1, component=component)
        else:
            ours, theirs = direct_paths(run, "get_act_patch_direct_path", 0, 1,
                                        component=component)
            assert torch.isfinite(ours).all() and ours.shape == theirs.shape


# --- what glassgpt refuses, each one InputError before any run -----------------------------------

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=32)).eval()
    tokens = ids(batch=2, length=4, seed=1, vocab=29)
    return model, tokens, run_with_cache(model, tokens)[1]


def refused(tiny, function: str, metric, **settings) -> str:
    model, tokens, cache = tiny
    with pytest.raises(InputError) as caught:
        getattr(patching, function)(model, tokens, cache, metric, **settings)
    return str(caught.value)


@pytest.mark.parametrize("reduce", ["sum", None, "MEAN"])
def test_an_unknown_reduce_mode_is_refused(tiny, reduce) -> None:
    assert "reduce must be one of" in refused(tiny, "get_act_patch_resid_pre", one_number,
                                              reduce=reduce)


@pytest.mark.parametrize("metric, reduce, says", [
    (per_prompt, "scalar", "must return one real number"),
    (one_number, "none", "must return a (batch,) tensor of 2"),
    (one_number, "mean", "must return a (batch,) tensor of 2"),
    (lambda logits: logits[:, -1, :2], "none", "shape (2, 2)"),
    (lambda logits: torch.ones(3), "mean", "shape (3,)"),
    (lambda logits: per_prompt(logits) * float("nan"), "none", "not finite"),
], ids=["vector-scalar", "scalar-none", "scalar-mean", "matrix", "wrong-batch", "nan"])
def test_a_metric_of_the_wrong_shape_for_its_reduce_mode_is_refused(tiny, metric, reduce,
                                                                    says) -> None:
    message = refused(tiny, "get_act_patch_block_every", metric, reduce=reduce)
    assert "patching metric" in message and says in message


def test_a_named_metric_is_named_when_it_is_refused(tiny) -> None:
    message = refused(tiny, "get_act_patch_attn_head_all_pos_every",
                      {"good": per_prompt, "bad": one_number}, reduce="none")
    assert "'bad'" in message and "'good'" not in message


@pytest.mark.parametrize("settings, says", [
    (dict(index_df=[(0, 1)]), "pandas"), (dict(return_index_df=True), "pandas"),
    (dict(index_axis_names=("pos", "layer")), "'layer' first"),
    (dict(index_axis_names=("layer", "time")), "index_axis_names"),
    (dict(index_axis_names=("layer", "pos"), baseline="yes"), "baseline must be True or False"),
], ids=["index-df", "return-index-df", "layer-not-first", "unknown-axis", "baseline"])
def test_generic_patching_refuses_what_it_does_not_offer(tiny, settings, says) -> None:
    assert says in refused(tiny, "generic_activation_patch", one_number,
                           patch_setter=patching.layer_pos_setter, activation_name="resid_pre",
                           **settings)


def test_an_empty_mapping_of_metrics_is_refused(tiny) -> None:
    assert "empty" in refused(tiny, "get_act_patch_resid_pre", {})


def test_an_attention_only_model_has_no_block_every_map_but_its_parts(tiny) -> None:
    """glassgpt decides: refused by name before any run (TransformerLens fails at mlp_out);
    the two sweeps the model has still run."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=32,
                          attn_only=True)).eval()
    tokens = tiny[1]
    cache = run_with_cache(model, tokens)[1]
    calls = []
    with pytest.raises(InputError, match="attention-only"):
        patching.get_act_patch_block_every(model, tokens, cache, one_number,
                                           progress=lambda *done: calls.append(done))
    assert calls == []
    with pytest.raises(InputError, match="mlp_out"):
        patching.get_act_patch_mlp_out(model, tokens, cache, one_number)
    assert patching.get_act_patch_attn_out(model, tokens, cache, one_number).shape == (2, 4)


def test_progress_counts_every_run_of_every_sweep(tiny) -> None:
    model, tokens, cache = tiny
    calls = []
    patching.get_act_patch_block_every(model, tokens, cache, one_number,
                                       progress=lambda done, total: calls.append((done, total)))
    assert calls == [(done, 3 * 2 * 4) for done in range(1, 3 * 2 * 4 + 1)]


def test_direct_path_refuses_a_post_ln_model_and_a_head_out_of_range(tiny) -> None:
    model, tokens, cache = tiny
    with pytest.raises(InputError, match="src_head"):
        patching.get_act_patch_direct_path(model, tokens, cache, cache, one_number, 0, 2)
    with pytest.raises(InputError, match="component"):
        patching.get_act_patch_direct_path(model, tokens, cache, cache, one_number, 0, 1, "z")
    torch.manual_seed(0)
    post_ln = GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=32,
                            pre_ln=False)).eval()
    with pytest.raises(InputError, match="Post-LN"):
        patching.get_act_patch_direct_path(post_ln, tokens, cache, cache, one_number, 0, 1)


def test_a_result_refuses_what_it_was_not_run_with(tiny) -> None:
    model, tokens, cache = tiny
    reduced = patching.get_act_patch_resid_pre(model, tokens, cache, per_prompt, reduce="mean",
                                               baseline=True)
    with pytest.raises(InputError, match="reduce='none'"):
        reduced.stderr()
    with pytest.raises(InputError, match="no metric 'other'"):
        reduced["other"]
    with pytest.raises(InputError, match="baseline's shape"):
        reduced.normalized(torch.ones(2))
    kept = patching.get_act_patch_resid_pre(model, tokens, cache, per_prompt, reduce="none")
    with pytest.raises(InputError, match="baseline=True"):
        kept.effect()


def test_direct_path_runs_on_arena_s_model_and_a_zero_write_changes_nothing() -> None:
    """ARENA's switches (attention-only, no norms, shortformer positions fed to Q and K only):
    with the corrupted cache as the clean one the source head's write is zero, so every
    destination's number is the unpatched run's, bit for bit."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=32,
                          attn_only=True, norm="none", position="shortformer")).eval()
    tokens = ids(batch=2, length=4, seed=1, vocab=29)
    cache = run_with_cache(model, tokens)[1]
    unpatched = one_number(run_with_cache(model, tokens, names=[])[0])
    for component in ("q", "k", "v"):
        paths = patching.get_act_patch_direct_path(model, tokens, cache, cache, one_number, 0, 1,
                                                   component)
        assert (paths[0] == 0).all() and (paths[1] == unpatched).all()
