"""glassgpt.interp handed what it cannot use (issue 38): each case is refused with a glassgpt
error naming the value, before it turns into a traceback from inside torch, a silent cast, or a
number that means nothing (a NaN map, a patch of a prompt of another length, an attribution of
another run).

The model is tiny and float32 (a replacement's dtype is checked against the model's own).
"""

from __future__ import annotations

import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.errors import GlassGPTError, InputError, ModelError
from glassgpt.interp import run_with_cache, run_with_hooks, zero_heads
from glassgpt.interp.core.cache import MissingActivationError
from glassgpt.interp.methods.attribution import logit_attribution
from glassgpt.interp.methods.patching import (
    get_act_patch_attn_head_out_by_pos,
    get_act_patch_attn_out,
    get_act_patch_resid_pre,
    normalized_logit_diff,
)
from glassgpt.interp.methods.scores import head_scores
from glassgpt.model import GPT

VOCAB = 29


def tiny(seed: int = 0, n_embd: int = 32, n_head: int = 4) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=n_head,
                       n_embd=n_embd, dropout=0.0)
    return GPT(config).eval()


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny()


def ids(batch: int = 2, length: int = 6, seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)


def first_logit(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 0].mean()


# --- patching: the clean run must match the corrupted one --------------------------------------

@pytest.mark.parametrize("patch", [get_act_patch_resid_pre, get_act_patch_attn_out,
                                   get_act_patch_attn_head_out_by_pos])
def test_patching_refuses_a_clean_cache_of_another_length_naming_both_shapes(model, patch):
    _, clean_cache = run_with_cache(model, ids(length=8))
    with pytest.raises(InputError, match=r"\(2, 8.*\(2, 6"):
        patch(model, ids(length=6), clean_cache, first_logit)


def test_patching_refuses_a_clean_batch_of_one_spread_over_two(model):
    _, clean_cache = run_with_cache(model, ids(batch=1))
    with pytest.raises(InputError, match=r"\(1, 6, 32\).*\(2, 6, 32\)"):
        get_act_patch_resid_pre(model, ids(batch=2), clean_cache, first_logit)


@pytest.mark.parametrize("other", [dict(n_embd=16), dict(n_head=2)], ids=["width", "heads"])
def test_patching_refuses_a_clean_cache_of_another_model_shape(model, other):
    _, clean_cache = run_with_cache(tiny(**other), ids())
    with pytest.raises(InputError, match="clean cache"):
        get_act_patch_attn_head_out_by_pos(model, ids(), clean_cache, first_logit)


def test_a_cache_missing_a_needed_name_raises_a_glassgpt_key_error_naming_it(model):
    _, clean_cache = run_with_cache(model, ids(), names=["blocks.0.hook_resid_pre"])
    for cache in (clean_cache, dict(clean_cache)):  # run_with_cache's, or a plain dict
        with pytest.raises(MissingActivationError, match="blocks.1.hook_resid_pre") as caught:
            get_act_patch_resid_pre(model, ids(), cache, first_logit)
        assert isinstance(caught.value, KeyError) and isinstance(caught.value, GlassGPTError)


# --- patching: the metric must give one finite real number -------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300, "0.5", None,
                                   torch.ones(2), torch.tensor(1 + 2j), torch.tensor(True)],
                         ids=["nan", "inf", "1e300", "str", "none", "vector", "complex", "bool"])
def test_a_metric_that_returns_no_finite_real_number_is_refused(model, value):
    _, clean_cache = run_with_cache(model, ids())
    with pytest.raises(InputError, match="metric"):
        get_act_patch_resid_pre(model, ids(), clean_cache, lambda logits: value)


def test_a_metric_that_is_not_a_function_is_refused(model):
    _, clean_cache = run_with_cache(model, ids())
    with pytest.raises(InputError, match="patching_metric"):
        get_act_patch_resid_pre(model, ids(), clean_cache, 0.5)


@pytest.mark.parametrize("bad", [dict(answer=VOCAB), dict(wrong=-1), dict(answer=True),
                                 dict(answer=1.0), dict(pos=6), dict(pos=slice(0, 1))])
def test_normalized_logit_diff_refuses_a_token_or_position_outside_the_logits(model, bad):
    clean, corrupted = run_with_hooks(model, ids(seed=3)), run_with_hooks(model, ids(seed=4))
    settings = {"answer": 1, "wrong": 2, "pos": -1, **bad}
    with pytest.raises(InputError, match=f"{next(iter(bad))} must be"):
        normalized_logit_diff(clean, corrupted, **settings)


# --- hooks: what they return, how they are given -----------------------------------------------

@pytest.mark.parametrize("name", ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_pattern",
                                  "blocks.0.attn.hook_z", "blocks.0.attn.hook_q"])
@pytest.mark.parametrize("make", [lambda x: x.to(torch.int64), lambda x: x.to(torch.bfloat16),
                                  lambda x: x.double(), lambda x: torch.full_like(x, float("nan"))],
                         ids=["int64", "bf16", "float64", "nan"])
def test_a_replacement_of_another_dtype_or_holding_nan_is_refused(model, name, make):
    with pytest.raises(InputError, match=name):
        run_with_hooks(model, ids(), [(name, lambda x, _name: make(x))])


@pytest.mark.parametrize("name", ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_pattern",
                                  "hook_embed"])
def test_zero_heads_is_refused_where_there_is_no_head_axis(model, name):
    with pytest.raises(InputError, match="head axis"):
        run_with_hooks(model, ids(), [(name, zero_heads(1))])


@pytest.mark.parametrize("head", [1.0, True, "1", None])
def test_zero_heads_takes_only_int_heads(head):
    with pytest.raises(InputError, match="zero_heads"):
        zero_heads(head)


def test_zero_heads_still_switches_a_head_off_at_hook_v(model):
    switched = run_with_hooks(model, ids(), [("blocks.0.attn.hook_v", zero_heads(1))])
    assert not torch.equal(switched, run_with_hooks(model, ids()))


def test_a_names_filter_in_the_hooks_list_hooks_every_point_it_selects(model):
    """TransformerLens's hooks take a predicate for a name; so do glassgpt's."""
    seen = []
    run_with_hooks(model, ids(), [(lambda n: n.endswith("hook_resid_pre"),
                                   lambda x, name: seen.append(name))])
    assert seen == ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"]
    with pytest.raises(InputError, match="selects no hook point"):
        run_with_hooks(model, ids(), [(lambda n: False, lambda x, name: None)])


@pytest.mark.parametrize("fn", [lambda x: x, lambda: None, lambda x, name, extra: x],
                         ids=["one-argument", "no-argument", "three-arguments"])
def test_a_hook_function_that_cannot_take_tensor_and_name_is_refused_before_the_run(model, fn):
    with pytest.raises(InputError, match=r"fn\(tensor, name\)"):
        run_with_hooks(model, ids(), [("hook_embed", fn)])


@pytest.mark.parametrize("hooks", [None, "hook_embed", {"hook_embed": print}, 3])
def test_hooks_that_are_no_list_of_pairs_are_refused(model, hooks):
    with pytest.raises(InputError, match="hooks must be a list"):
        run_with_hooks(model, ids(), hooks)


def test_a_run_started_inside_a_hook_of_the_same_model_is_refused_not_recursed(model):
    def nested(x, name):
        run_with_cache(model, ids())
    with pytest.raises(InputError, match="inside a hook"):
        run_with_hooks(model, ids(), [("hook_embed", nested)])
    run_with_cache(model, ids())  # and the guard is lifted afterwards


@pytest.mark.parametrize("names", [{"hook_embed": 1}, 3, torch.zeros(2)],
                         ids=["dict", "int", "tensor"])
def test_names_that_are_no_filter_are_refused(model, names):
    with pytest.raises(InputError, match="names must be"):
        run_with_cache(model, ids(), names=names)


# --- the entry points: a model, some tokens ----------------------------------------------------

@pytest.mark.parametrize("bad", [torch.zeros(0, 6, dtype=torch.long),
                                 torch.zeros(2, 0, dtype=torch.long),
                                 torch.zeros(6, dtype=torch.long)], ids=["batch0", "len0", "1d"])
@pytest.mark.parametrize("call", ["cache", "hooks", "attribution", "scores"])
def test_empty_or_flat_token_ids_are_refused_naming_the_shape(model, bad, call):
    runs = {"cache": lambda: run_with_cache(model, bad),
            "hooks": lambda: run_with_hooks(model, bad),
            "attribution": lambda: logit_attribution(model, bad, 3),
            "scores": lambda: head_scores(model, tokens=torch.cat([bad, bad], -1))}
    with pytest.raises(InputError, match="shape|must be"):
        runs[call]()


@pytest.mark.parametrize("call", [lambda: run_with_cache(None, ids()),
                                  lambda: run_with_hooks(None, ids()),
                                  lambda: logit_attribution(None, ids(), 3),
                                  lambda: head_scores(None)],
                         ids=["cache", "hooks", "attribution", "scores"])
def test_no_model_is_refused(call):
    with pytest.raises(ModelError, match="NoneType"):
        call()


@pytest.mark.parametrize("pos", [6, -7, True, 1.0, slice(0, 2), "1"])
def test_attribution_refuses_a_position_outside_the_prompt_or_not_an_int(model, pos):
    with pytest.raises(InputError, match="pos must be an int"):
        logit_attribution(model, ids(), 3, pos=pos)


def test_attribution_refuses_a_cache_of_other_ids_or_another_model(model):
    _, cache = run_with_cache(model, ids(seed=3))
    with pytest.raises(InputError, match="other token ids"):
        logit_attribution(model, ids(seed=4), 3, cache=cache)
    _, other = run_with_cache(tiny(seed=1), ids())
    with pytest.raises(InputError, match="another model"):
        logit_attribution(model, ids(), 3, cache=other)
    _, short = run_with_cache(model, ids(length=4))
    with pytest.raises(InputError, match="hook_embed"):
        logit_attribution(model, ids(), 3, cache=dict(short))  # a plain mapping: its shape
    found = logit_attribution(model, ids(), 3, cache=run_with_cache(model, ids())[1])
    assert found.values.sum().item() == pytest.approx(found.logit, abs=1e-4)


@pytest.mark.parametrize("settings", [dict(seed=-1), dict(seed=2**70), dict(seed=1.0),
                                      dict(batch=0), dict(batch=-1), dict(batch=1.5),
                                      dict(batch=True)])
def test_head_scores_refuse_a_bad_seed_or_batch(model, settings):
    name = next(iter(settings))
    with pytest.raises(InputError, match=f"{name} must be an int"):
        head_scores(model, half=4, **settings)
