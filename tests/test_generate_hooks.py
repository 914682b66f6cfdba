"""Sampling with hooks: `generate(model, idx, hooks=[(name, fn)])` runs each hook at every
decoding step, and the KV cache still changes nothing but the speed.

Shapes: B = batch, T = prompt length, C = width, V = vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from conftest import tiny_gpt
from glassgpt.decoding.generate import generate, generate_stream
from glassgpt.errors import InputError
from glassgpt.hooks import HookPoint
from glassgpt.interp import run_with_hooks
from glassgpt.model import GPT

V, BLOCK = 23, 10
POINT = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return tiny_gpt(vocab_size=V, block_size=BLOCK).eval()


def prompt(B: int, T: int) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(B * 100 + T))


def push(model: GPT):
    """A hook adding a fixed direction to the stream, large enough to change greedy tokens."""
    direction = 3.0 * torch.randn(model.config.n_embd, generator=torch.Generator().manual_seed(1))

    def add(x: Tensor, name: str) -> Tensor:  # x (B, T, C)
        return x + direction
    return add


def recomputed(model: GPT, idx: Tensor, new: int, hooks) -> Tensor:
    """Greedy decoding by hand: run_with_hooks on the last block_size tokens, one per step."""
    for _ in range(new):
        logits = run_with_hooks(model, idx[:, -BLOCK:], hooks)  # (B, T, V)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("B, T, new", [(1, 3, 6), (2, 4, 2 * BLOCK)])  # the second slides
def test_cached_decoding_with_a_hook_equals_a_recompute_with_it(model, B, T, new):
    hooks = [(POINT, push(model))]
    idx = prompt(B, T)
    cached = generate(model, idx, hooks=hooks, max_new_tokens=new, temperature=0.0)
    uncached = generate(model, idx, hooks=hooks, max_new_tokens=new, temperature=0.0,
                        use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, recomputed(model, idx, new, hooks))
    plain = generate(model, idx, max_new_tokens=new, temperature=0.0)
    assert not torch.equal(cached, plain)  # the hook did reach the steps


def test_a_hook_sees_the_prompt_then_one_position_a_step(model):
    shapes = []
    generate(model, prompt(2, 4), hooks=[(POINT, lambda x, name: shapes.append(x.shape))],
             max_new_tokens=3, temperature=0.0)
    C = model.config.n_embd
    assert shapes == [(2, 4, C), (2, 1, C), (2, 1, C)]


def test_the_threaded_cpu_engine_runs_the_hooks_too(model):
    hooks = [(POINT, push(model))]
    idx = prompt(1, 3)
    eager = generate(model, idx, hooks=hooks, max_new_tokens=6, temperature=0.0, engine="eager")
    threaded = generate(model, idx, hooks=hooks, max_new_tokens=6, temperature=0.0,
                        engine="cpu")
    assert torch.equal(eager, threaded)


def attached_hooks(model: GPT) -> int:
    return sum(len(m._forward_hooks) for m in model.modules() if isinstance(m, HookPoint))


def test_hooks_are_removed_after_decoding_an_error_and_an_early_stop(model):
    generate(model, prompt(1, 2), hooks=[(POINT, push(model))], max_new_tokens=2)
    assert attached_hooks(model) == 0

    def broken(x: Tensor, name: str) -> Tensor:
        return x[..., :1]  # the wrong shape: refused at the first step
    with pytest.raises(InputError, match=POINT):
        generate(model, prompt(1, 2), hooks=[(POINT, broken)], max_new_tokens=2)
    assert attached_hooks(model) == 0
    stream = generate_stream(model, prompt(1, 2), hooks=[(POINT, push(model))],
                             max_new_tokens=5)
    next(stream)
    assert attached_hooks(model) == 1
    stream.close()
    assert attached_hooks(model) == 0


def test_no_hook_attaches_nothing(model):
    stream = generate_stream(model, prompt(1, 2), max_new_tokens=3, temperature=0.0)
    next(stream)
    assert attached_hooks(model) == 0
    stream.close()


@pytest.mark.parametrize("settings, named", [
    (dict(compiled=True), "compiled"),
    (dict(engine="cuda-graph"), "cuda-graph"),
])
def test_engines_that_cannot_run_hooks_refuse_them_by_name(model, settings, named):
    with pytest.raises(InputError, match=named):
        generate(model, prompt(1, 2), hooks=[(POINT, push(model))], max_new_tokens=2,
                 **settings)


@pytest.mark.parametrize("hooks, named", [
    ([("blocks.9.hook_resid_post", lambda x, n: None)], "blocks.9.hook_resid_post"),
    ([(POINT, "not a function")], "pair"),
    ("blocks.0.hook_resid_post", "list"),
])
def test_bad_hooks_are_refused_before_decoding(model, hooks, named):
    with pytest.raises(InputError, match=named):
        generate(model, prompt(1, 2), hooks=hooks, max_new_tokens=2)
