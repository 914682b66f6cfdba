"""nnsight sees glassgpt's hook points: `NNsight(model)` on a plain GPT reads and sets any point.

nnsight (0.8) watches a module by putting its own `forward` on the instance, and leaves it there;
an idle HookPoint skips nn.Module's call (a forward of a small model would pay ~2 us a point
otherwise), so it counts such a `forward` as a watcher while a trace runs, and only then
(glassgpt.hooks.HookPoint). Checked against nnsight itself: what it reads equals run_with_cache,
what it sets equals run_with_hooks with that replacement, and after the trace the model computes
as before. nnsight compiles the body of each `with` block from this file's source.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_gpt
from glassgpt.hooks import HookPoint
from glassgpt.interp import run_with_cache, run_with_hooks, zero_heads
from glassgpt.model import GPT

nnsight = pytest.importorskip("nnsight")  # the extra lens; absent on the oldest torch


def model() -> GPT:
    """A tiny float64 GPT (rotary, so hook_rot_q shows the transposed layout of its point)."""
    return tiny_gpt(position="rope").to(torch.float64).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(1))


def test_nnsight_reads_every_kind_of_point_as_run_with_cache_caches_it():
    glass = model()
    _, cache = run_with_cache(glass, ids())
    wrapped = nnsight.NNsight(glass)
    with wrapped.trace(ids()):  # in the order the model reaches them, as nnsight requires
        rot_q = wrapped.blocks[0].attn.hook_rot_q.output.save()
        pattern = wrapped.blocks[0].attn.hook_pattern.output.save()
        result = wrapped.blocks[0].attn.hook_result.output.save()
        x_hat = wrapped.blocks[1].ln2.hook_normalized.output.save()
        post = wrapped.blocks[1].ffn.hook_post.output.save()
        resid = wrapped.blocks[1].hook_resid_post.output.save()
    for name, read in [("blocks.0.attn.hook_rot_q", rot_q),
                       ("blocks.0.attn.hook_pattern", pattern),
                       ("blocks.0.attn.hook_result", result),
                       ("blocks.1.ln2.hook_normalized", x_hat), ("blocks.1.mlp.hook_post", post),
                       ("blocks.1.hook_resid_post", resid)]:
        torch.testing.assert_close(read, cache[name], rtol=0, atol=1e-12, msg=name)


def test_a_value_nnsight_sets_at_a_point_equals_run_with_hooks_replacing_it():
    glass = model()
    clean = glass(ids())[0]
    replacement = torch.randn(2, 9, 16, dtype=torch.float64)
    by_hooks = run_with_hooks(glass, ids(), [("blocks.0.hook_resid_mid", lambda x, n: replacement)])
    head_off = run_with_hooks(glass, ids(), [("blocks.1.attn.hook_z", zero_heads(1))])
    wrapped = nnsight.NNsight(glass)
    with wrapped.trace(ids()):
        wrapped.blocks[0].hook_resid_mid.output = replacement
        by_nnsight = wrapped.output.save()
    with wrapped.trace(ids()):
        wrapped.blocks[1].attn.hook_z.output[:, :, 1] = 0  # (B, T, H, d): head 1 off
        head_off_by_nnsight = wrapped.output.save()
    assert (by_hooks - clean).abs().max() > 1e-3  # the replacement changed the logits
    torch.testing.assert_close(by_nnsight[0], by_hooks, rtol=0, atol=1e-12)
    torch.testing.assert_close(head_off_by_nnsight[0], head_off, rtol=0, atol=1e-12)
    torch.testing.assert_close(glass(ids())[0], clean, rtol=0, atol=1e-12)  # after: as before


def module_types_called(glass: GPT) -> list[type]:
    """The modules a forward of `glass` calls through nn.Module (a global forward hook sees
    them); an idle hook point returns its input without that call."""
    called: list[type] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, inputs, output: called.append(type(module)))
    try:
        glass(ids())
    finally:
        handle.remove()
    return called


def test_outside_a_trace_the_points_are_idle_as_if_nnsight_never_came():
    """The plain forward's shortcut stays, and comes back after a trace: nnsight leaves its
    `forward` on every module it wrapped, but a point is watched only while a trace runs, so
    the owner keeps its fused path (the same logits, bit for bit) and no point is a module
    call; one watching hook still makes a point active."""
    glass, untouched = model(), model()
    untouched.load_state_dict(glass.state_dict())
    points = [m for m in glass.modules() if isinstance(m, HookPoint)]
    assert HookPoint not in module_types_called(glass)
    wrapped = nnsight.NNsight(glass)
    with wrapped.trace(ids()):
        wrapped.blocks[1].attn.hook_pattern.output.save()
    assert all("forward" in point.__dict__ for point in points)  # nnsight's, left there
    assert not any(point.active for point in points)
    called = module_types_called(glass)
    assert called and HookPoint not in called
    assert torch.equal(glass(ids())[0], untouched(ids())[0])
    handle = glass.blocks[1].attn.hook_pattern.register_forward_hook(lambda *args: None)
    assert glass.blocks[1].attn.hook_pattern.active
    handle.remove()
