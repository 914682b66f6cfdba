"""Gradients at hook points and attribution patching (issue 42, items 1 and 2).

Checked against TransformerLens 4.3's TransformerBridge booted over the very same Hugging Face
GPT-2 weights (as tests/test_interp_reference.py does): the gradient at every shared hook point,
`run_with_cache(incl_bwd=True)` of the loss, and node attribution patching, each within 1e-5.
And against glassgpt's own exact activation patching where the model is linear in the patched
activation (a norm-less model's last layer, a metric linear in the logits): equal to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.errors import InputError
from glassgpt.interp import patching, run_with_cache, run_with_hooks
from glassgpt.interp.hooked_gpt import HookedGPT
from glassgpt.interp.methods import attribution_patching as attr
from glassgpt.model import GPT

TOL = 1e-5


def tiny(**options) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=16, **options)
    return GPT(config).eval()


def tokens(seed: int, batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 7].sum() - logits[:, -2, 11].mean()


# --- against TransformerLens 4.3 -------------------------------------------------------------

def test_gradients_equal_transformer_lens(gpt2_and_bridge) -> None:
    from transformer_lens.tools.analysis.attribution_patching import (
        cache_activation_and_gradient,
    )

    from test_interp_reference import names_for
    model, bridge = gpt2_and_bridge
    ids = tokens(3)
    # hook_resid_mid is left out: TransformerLens 4.3 aliases it to ln2's input, not the stream
    # (see test_interp_reference.test_resid_mid_patching_lands_where_each_side_says).
    names = [n for n in names_for("gpt2", 2) if not n.endswith("hook_resid_mid")]
    _, ours = run_with_cache(model, ids, names, incl_bwd=True, metric=metric)
    theirs = cache_activation_and_gradient(bridge, ids, metric, names_filter=names)
    assert set(theirs.gradients) == set(names)
    for name in names:
        torch.testing.assert_close(ours[f"{name}_grad"], theirs.gradients[name], atol=TOL,
                                   rtol=0, msg=name)
        if not name.endswith("hook_attn_scores"):  # masked cells: -inf here, finfo.min there
            torch.testing.assert_close(ours[name], theirs.activations[name], atol=TOL, rtol=0)
    assert ours["hook_embed_grad"].abs().max() > 1e-3  # a gradient, not zeros on both sides


def test_hooked_gpt_incl_bwd_equals_bridge(gpt2_and_bridge) -> None:
    model, bridge = gpt2_and_bridge
    ids = tokens(4)
    names = ["hook_embed", "blocks.0.attn.hook_pattern", "blocks.1.hook_mlp_out",
             "ln_final.hook_normalized"]
    loss, ours = HookedGPT(model).run_with_cache(ids, names_filter=names, incl_bwd=True,
                                                 return_type="loss")
    model.zero_grad(set_to_none=True)
    lens_loss, theirs = bridge.run_with_cache(ids, names_filter=names, incl_bwd=True,
                                              return_type="loss")
    torch.testing.assert_close(loss.detach(), lens_loss.detach(), atol=TOL, rtol=0)
    for name in names:
        torch.testing.assert_close(ours[f"{name}_grad"], theirs[f"{name}_grad"], atol=TOL,
                                   rtol=0, msg=name)


def test_node_attribution_patching_equals_transformer_lens(gpt2_and_bridge) -> None:
    from transformer_lens.tools.analysis import attribution_patching as lens_attr
    model, bridge = gpt2_and_bridge
    clean, corrupt = tokens(5, length=6), tokens(6, length=6)
    ours = attr.attribution_patch(model, clean, corrupt, metric)
    theirs = lens_attr.attribution_patch(bridge, clean, corrupt, metric)
    key = lambda node: (node.kind, node.position, node.layer, node.head)  # noqa: E731
    ours_by_key = {key(node): score for node, score in ours.node_scores.items()}
    theirs_by_key = {key(node): score for node, score in theirs.node_scores.items()}
    assert list(ours_by_key) == list(theirs_by_key)  # the same nodes, in the same order
    for node, score in theirs_by_key.items():
        assert abs(ours_by_key[node] - score) < TOL, (node, ours_by_key[node], score)
    assert max(abs(s) for s in theirs_by_key.values()) > 1e-2
    assert [key(n) for n, _ in ours.top_nodes(5)] == [key(n) for n, _ in theirs.top_nodes(5)]


# --- backward hooks --------------------------------------------------------------------------

def test_bwd_hooks_fire_on_a_backward_after_the_run_and_equal_the_cache() -> None:
    model, ids = tiny(), tokens(1)
    _, cache = run_with_cache(model, ids, incl_bwd=True, metric=metric)
    seen = {}
    logits = run_with_hooks(model, ids, bwd_hooks=[
        (lambda name: name.endswith(("hook_z", "hook_resid_pre")),
         lambda grad, name: seen.__setitem__(name, grad))])
    assert not seen  # nothing before the caller's backward
    metric(logits).backward()
    assert set(seen) == {f"blocks.{l}.{p}" for l in (0, 1) for p in ("attn.hook_z",
                                                                      "hook_resid_pre")}
    for name, grad in seen.items():
        assert grad.shape == cache[name].shape  # z as TransformerLens lays it: (B, T, H, d)
        torch.testing.assert_close(grad, cache[f"{name}_grad"], atol=0, rtol=0)


def test_a_bwd_hook_replaces_the_gradient() -> None:
    model, ids = tiny(), tokens(1)
    seen = {}
    logits = run_with_hooks(model, ids, bwd_hooks=[
        ("blocks.0.hook_resid_post", lambda grad, name: torch.zeros_like(grad)),
        ("hook_embed", lambda grad, name: seen.__setitem__(name, grad))])
    metric(logits).backward()
    assert torch.equal(seen["hook_embed"], torch.zeros_like(seen["hook_embed"]))


def test_hooked_gpt_bwd_hooks_arena_style() -> None:
    """ARENA 1.4.1's get_cache_fwd_and_bwd (its shape: add_hook "fwd" and "bwd" on a filter,
    metric(model(tokens)).backward(), reset_hooks)."""
    model, ids = tiny(), tokens(2)
    lens = HookedGPT(model)
    grad_cache = {}

    def backward_cache_hook(act, hook):
        grad_cache[hook.name] = act.detach()

    lens.add_hook(lambda name: "_input" not in name, backward_cache_hook, "bwd")
    with torch.no_grad():  # an attached backward hook has nothing to fire on here
        lens(ids)
    assert not grad_cache
    metric(lens(ids)).backward()
    lens.reset_hooks()
    _, cache = run_with_cache(model, ids, incl_bwd=True, metric=metric)
    assert len(grad_cache) == len(cache) // 2
    for name, grad in grad_cache.items():
        torch.testing.assert_close(grad, cache[f"{name}_grad"], atol=0, rtol=0, msg=name)
    assert not [h for h in lens._attached if h.dir == "bwd"]  # reset_hooks removed it


def test_gradients_do_not_need_trainable_weights_nor_touch_their_grad() -> None:
    model, ids = tiny(), tokens(1)
    _, cache = run_with_cache(model, ids, incl_bwd=True, metric=metric)
    assert all(p.grad is None for p in model.parameters())  # autograd.grad: no .grad written
    model.requires_grad_(False)
    with torch.no_grad():  # asked for by incl_bwd: enabled inside the call
        _, frozen = run_with_cache(model, ids, incl_bwd=True, metric=metric)
    for name in cache:
        torch.testing.assert_close(frozen[name], cache[name], atol=0, rtol=0, msg=name)


def test_misuse_is_refused_by_name() -> None:
    model, ids = tiny(), tokens(1)
    with torch.no_grad(), pytest.raises(InputError, match="no_grad"):
        run_with_hooks(model, ids, bwd_hooks=[("hook_embed", lambda grad, name: None)])
    with pytest.raises(InputError, match="incl_bwd"):
        run_with_cache(model, ids, metric=metric)
    with pytest.raises(InputError, match="metric=fn"):
        run_with_cache(model, ids, incl_bwd=True)
    with pytest.raises(InputError, match="scalar"):
        run_with_cache(model, ids, incl_bwd=True, metric=lambda logits: logits[:, -1])
    with pytest.raises(InputError, match="return_type='loss'"):
        HookedGPT(model).run_with_cache(ids, incl_bwd=True)
    with pytest.raises(InputError, match="granularity"):
        attr.EdgeAttributionConfig(granularity="edge")
    with pytest.raises(InputError, match="MLP"):
        attr.get_attr_patch_mlp_out(tiny(attn_only=True), ids, {}, metric)


# --- exact where the model is linear in the activation ---------------------------------------

def linear_case(**options):
    model = tiny(norm="none", **options)
    with torch.no_grad():  # weights of size: every layer moves the answer (default init: 1e-3)
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(parameter.numel()))
    clean, corrupted = tokens(7), tokens(8)
    clean_logits, clean_cache = run_with_cache(model, clean)
    corrupted_logits, _ = run_with_cache(model, corrupted, names=[])
    normalized = patching.normalized_logit_diff(clean_logits, corrupted_logits, 7, 11)
    return model, corrupted, clean_cache, normalized


@pytest.mark.parametrize("pair", [("get_attr_patch_attn_out", "get_act_patch_attn_out"),
                                  ("get_attr_patch_attn_head_out_by_pos",
                                   "get_act_patch_attn_head_out_by_pos"),
                                  ("get_attr_patch_attn_head_out_all_pos",
                                   "get_act_patch_attn_head_out_all_pos")])
def test_attribution_equals_activation_patching_where_linear(pair) -> None:
    """Attention-only and norm-less: the last layer's attention output reaches the logits
    through W_U alone, and normalized_logit_diff is affine in the logits, so the estimate is
    exact there; the first layer (through the last layer's attention) is only an estimate."""
    model, corrupted, clean_cache, normalized = linear_case(attn_only=True)
    estimated = getattr(attr, pair[0])(model, corrupted, clean_cache, normalized)
    exact = getattr(patching, pair[1])(model, corrupted, clean_cache, normalized)
    assert estimated.shape == exact.shape
    torch.testing.assert_close(estimated[-1], exact[-1], atol=TOL, rtol=0)
    assert exact[-1].abs().max() > 1e-2
    assert (estimated[0] - exact[0]).abs().max() > 1e-4  # the check above can fail


def test_mlp_out_and_resid_pre_of_a_norm_less_model() -> None:
    model, corrupted, clean_cache, normalized = linear_case()
    estimated = attr.get_attr_patch_mlp_out(model, corrupted, clean_cache, normalized)
    exact = patching.get_act_patch_mlp_out(model, corrupted, clean_cache, normalized)
    torch.testing.assert_close(estimated[-1], exact[-1], atol=TOL, rtol=0)
    # resid_pre of layer 0 at a position only the last position's metric reads through
    # attention: not linear, but the map has activation patching's shape and its sign there.
    estimated = attr.get_attr_patch_resid_pre(model, corrupted, clean_cache, normalized)
    exact = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, normalized)
    assert estimated.shape == exact.shape == (2, 7)
