"""Decoding engines change the speed, never the tokens.

Every engine of `glassgpt.decoding` is held to the reference, `EagerEngine` (the plain model's
forward with its KV cache): whole generations token for token, and each speed piece against the
PyTorch operation it replaces. Shapes: B = batch, T = prompt length.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from glassgpt.attention import explicit_attention, scale_and_cap
from glassgpt.config import GPTConfig
from glassgpt.decoding import (
    CompiledCPUEngine,
    CPUEngine,
    CUDAGraphEngine,
    EagerEngine,
    choice,
    engine_for,
)
from glassgpt.decoding import cpu as cpu_engines
from glassgpt.decoding.engine import model_kind, twin, twin_kind
from glassgpt.decoding.generate import generate
from glassgpt.errors import ConfigError
from glassgpt.model import GPT

V, BLOCK = 37, 24


@pytest.fixture(autouse=True)
def compiled_for_real() -> Iterator[None]:
    """Fail rather than fall back to eager (which would pass trivially) if dynamo ever gives up
    after too many recompilations: every model shape in a test session compiles once."""
    wanted = {"fail_on_recompile_limit_hit": True, "recompile_limit": 64,
              "cache_size_limit": 64}  # the last is the older torch's name of the limit
    config = torch._dynamo.config
    with config.patch(**{k: v for k, v in wanted.items() if hasattr(config, k)}):
        yield


@pytest.fixture()
def two_threads() -> Iterator[None]:
    """Two threads for the test (conftest pins one), so the threaded one-row path really runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    settings = dict(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32) | overrides
    return GPT(GPTConfig(**settings)).eval()


def prompt(B: int, T: int) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(10 * B + T))


# --- the pieces -----------------------------------------------------------------------------

# The narrow step's one query (reductions) and the wide step's (matmuls).
ONE_QUERY = [cpu_engines.one_query_attention, cpu_engines.one_query_matmul_attention]


@pytest.mark.parametrize("one_query", ONE_QUERY)
@pytest.mark.parametrize("S", [1, 7])
def test_one_query_attention_equals_sdpa_float64(one_query, S):
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (1, S, S))
    expected = F.scaled_dot_product_attention(q, k, v)  # one query sees every key
    torch.testing.assert_close(one_query(q, k, v), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("one_query", ONE_QUERY)
def test_one_query_attention_scales_by_one_over_sqrt_head_width(one_query):
    q = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    k = torch.stack([torch.zeros(4), torch.ones(4)]).to(torch.float64).view(1, 1, 2, 4)
    v = torch.tensor([[0.0], [1.0]], dtype=torch.float64).view(1, 1, 2, 1)
    weight_on_second = 1 / (1 + math.exp(-4 / math.sqrt(4)))  # scores 0 and 4/sqrt(d)
    assert one_query(q, k, v).item() == pytest.approx(weight_on_second, rel=1e-12)


@pytest.mark.parametrize("one_query", ONE_QUERY)
def test_one_query_attention_takes_the_scale_and_soft_cap_as_explicit_attention_does(one_query):
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (1, 9, 9))
    expected, _ = explicit_attention(q, k, v, None, nn.Identity(), scale=0.3, softcap=2.0)
    scored = functools.partial(scale_and_cap, head_dim=8, scale=0.3, softcap=2.0)
    torch.testing.assert_close(one_query(q, k, v, scored), expected, rtol=1e-12, atol=1e-12)


def as_subclass(linear: nn.Linear, cls: type[nn.Linear]) -> nn.Linear:
    linear.__class__ = cls
    return linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 24), (24,)])
@pytest.mark.parametrize("out_features", [30, 31])  # even split, and one column left over
def test_threaded_one_row_product_equals_f_linear(two_threads, bias, shape, out_features):
    linear = as_subclass(nn.Linear(24, out_features, bias=bias), cpu_engines.ThreadedLinear)
    x = torch.randn(shape, requires_grad=True)
    y, expected = linear(x), F.linear(x, linear.weight, linear.bias)
    assert y.shape == expected.shape == (*shape[:-1], out_features)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(y.sum(), x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_many_rows_and_bf16_take_the_plain_path(two_threads):
    linear = as_subclass(nn.Linear(24, 30), cpu_engines.ThreadedLinear)
    x = torch.randn(3, 24)
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
    half, row = linear.to(torch.bfloat16), torch.randn(1, 24, dtype=torch.bfloat16)
    assert torch.equal(half(row), F.linear(row, half.weight, half.bias))


@pytest.mark.parametrize("bias", [True, False])
def test_compiled_one_row_reduction_equals_f_linear(bias):
    linear = as_subclass(nn.Linear(48, 40, bias=bias), cpu_engines.ReductionLinear)
    x = torch.randn(1, 1, 48)
    compiled = torch.compile(linear, fullgraph=True)
    torch.testing.assert_close(compiled(x), F.linear(x, linear.weight, linear.bias),
                               rtol=1e-5, atol=1e-6)


def test_compiled_bf16_one_row_reduction_is_f_linear_rounded_once():
    """bf16 weights times the row in float32 (exact products), rounded to bf16 once at the end."""
    linear = as_subclass(nn.Linear(256, 40), cpu_engines.ReductionLinear).to(torch.bfloat16)
    x = torch.randn(1, 1, 256, dtype=torch.bfloat16)
    y = torch.compile(linear, fullgraph=True)(x)
    exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-6)  # bf16's half ulp


def test_run_eagerly_the_reduction_linear_is_f_linear_not_the_whole_product():
    """The compiled engine's prefill runs its twin eagerly: the prompt's last row into the LM
    head must not materialise (out, in) products (154 MB for GPT-2's head in float32)."""
    linear = as_subclass(nn.Linear(768, 512), cpu_engines.ReductionLinear)
    x = torch.randn(1, 1, 768)
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))


def test_a_twin_shares_every_tensor_and_leaves_the_model_as_it_was():
    model = tiny_gpt()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    copy = twin(model, lambda m: cpu_engines.ThreadedLinear if type(m) is nn.Linear else None)
    assert all(type(m) is not cpu_engines.ThreadedLinear for m in model.modules())
    assert sum(type(m) is cpu_engines.ThreadedLinear for m in copy.modules()) == 9
    ours, theirs = model.state_dict(), copy.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].data_ptr() == theirs[k].data_ptr() for k in ours)  # shared, not copied
    assert all(torch.equal(before[k], ours[k]) for k in ours)
    assert copy.lm_head.weight is copy.tok_emb.weight  # still tied


# --- whole generations ----------------------------------------------------------------------

VARIANTS = {
    "pre-ln gelu": {},
    "post-ln gelu_tanh, no bias": dict(pre_ln=False, activation="gelu_tanh", bias=False),
    "relu, untied, explicit attention": dict(activation="relu", tie_weights=False,
                                             attn_impl="explicit"),
}
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "top_k+top_p": dict(temperature=1.0, top_k=10, top_p=0.9, seed=3),
}
SHAPES = [
    (1, 5, 12),  # the shape decoding is tuned for
    (2, 3, 8),  # a batch: rows take the plain matmul path
    (1, 4, 2 * BLOCK),  # runs past block_size, where the window slides by recomputation
]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> GPT:
    return tiny_gpt(**VARIANTS[request.param])


def eager_tokens(model: GPT, idx: torch.Tensor, new: int, **sampling) -> torch.Tensor:
    return generate(model, idx, max_new_tokens=new, engine="eager", **sampling)


@pytest.mark.parametrize("kind", SAMPLING)
@pytest.mark.parametrize("B, T, new", SHAPES)
def test_the_threaded_cpu_engine_gives_exactly_the_eager_tokens(two_threads, variant, kind, B,
                                                                 T, new):
    idx = prompt(B, T)
    assert torch.equal(generate(variant, idx, max_new_tokens=new, engine="cpu", **SAMPLING[kind]),
                       eager_tokens(variant, idx, new, **SAMPLING[kind]))


@pytest.mark.parametrize("kind", SAMPLING)
@pytest.mark.parametrize("B, T, new", SHAPES)
def test_the_compiled_cpu_engine_gives_exactly_the_eager_tokens(variant, kind, B, T, new):
    idx = prompt(B, T)
    compiled = generate(variant, idx, max_new_tokens=new, compiled=True, **SAMPLING[kind])
    assert torch.equal(compiled, eager_tokens(variant, idx, new, **SAMPLING[kind]))


class StaticStepEngine(CUDAGraphEngine):
    """The CUDA engine's static step (full cache, position as a tensor, masked attention) on any
    device, without capturing a graph: what the graph replays, checked where CI runs."""

    def __init__(self, model):
        super().__init__(model, capture=False)


@pytest.mark.parametrize("kind", SAMPLING)
@pytest.mark.parametrize("B, T, new", SHAPES)
def test_the_static_step_of_the_cuda_engine_gives_exactly_the_eager_tokens(
        variant, kind, B, T, new, monkeypatch):
    monkeypatch.setattr("glassgpt.decoding.generate.engine_for", lambda model, name, compiled:
                        StaticStepEngine(model) if name == "cuda-graph" else EagerEngine(model))
    idx = prompt(B, T)
    static = generate(variant, idx, max_new_tokens=new, engine="cuda-graph", **SAMPLING[kind])
    assert torch.equal(static, eager_tokens(variant, idx, new, **SAMPLING[kind]))


# The modern switches (docs/modern.md): rotary positions at every decoding offset, grouped and
# multi-query KV caches, QK-norm, the gated and squared MLPs, RMSNorm and a soft-capped head.
MODERN_VARIANTS = {
    "rope, GQA 4->2, qk_norm, swiglu, rmsnorm, softcap": dict(
        n_head=4, n_kv_head=2, position="rope", qk_norm=True, activation="swiglu",
        mlp_hidden=48, norm="rmsnorm", bias=False, logit_softcap=3.0),
    "rope, MQA 4->1, relu2, untied": dict(n_head=4, n_kv_head=1, position="rope",
                                          activation="relu2", tie_weights=False),
    "no positions, rmsnorm with biases": dict(position="none", norm="rmsnorm"),
}


# (variant, sampling, shape, compile too): compiling is the slow part, so one compiled case
# holds every switch but multi-query (which only repeats K/V more times than GQA). PAST_BLOCK
# runs a few tokens past block_size, where the window slides (rotary positions restart at 0).
PAST_BLOCK = (1, 4, BLOCK + 4)
MODERN_CASES = [
    ("rope, GQA 4->2, qk_norm, swiglu, rmsnorm, softcap", "greedy", SHAPES[0], True),
    ("rope, GQA 4->2, qk_norm, swiglu, rmsnorm, softcap", "top_k+top_p", SHAPES[1], False),
    ("rope, GQA 4->2, qk_norm, swiglu, rmsnorm, softcap", "greedy", PAST_BLOCK, False),
    ("rope, MQA 4->1, relu2, untied", "top_k+top_p", SHAPES[0], False),
    ("rope, MQA 4->1, relu2, untied", "greedy", PAST_BLOCK, False),
    ("no positions, rmsnorm with biases", "greedy", SHAPES[1], False),
]


@pytest.mark.parametrize(("name", "kind", "shape", "compiled"), MODERN_CASES)
def test_every_engine_gives_exactly_the_eager_tokens_for_the_modern_switches(
        name, kind, shape, compiled, monkeypatch):
    model, (B, T, new), sampling = tiny_gpt(**MODERN_VARIANTS[name]), shape, SAMPLING[kind]
    idx = prompt(B, T)
    expected = eager_tokens(model, idx, new, **sampling)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the threaded one-row path runs only with two threads or more
    try:
        threaded = generate(model, idx, max_new_tokens=new, engine="cpu", **sampling)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(threaded, expected)
    if compiled:
        assert torch.equal(generate(model, idx, max_new_tokens=new, compiled=True, **sampling),
                           expected)
    monkeypatch.setattr("glassgpt.decoding.generate.engine_for", lambda model, name, compiled:
                        StaticStepEngine(model) if name == "cuda-graph" else EagerEngine(model))
    static = generate(model, idx, max_new_tokens=new, engine="cuda-graph", **sampling)
    assert torch.equal(static, expected)


def test_compiled_logits_match_eager_step_by_step():
    model = tiny_gpt(seed=1)
    idx = prompt(1, 6)
    expected, got = [], []
    for engine, out in ((EagerEngine(model), expected), (CompiledCPUEngine(model), got)):
        engine.start(1, BLOCK)
        with torch.no_grad():
            engine.prefill(idx[:, :3])
            out.extend(engine.step(idx[:, pos:pos + 1], pos) for pos in range(3, 6))
        engine.close()
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_one_compilation_serves_every_position_prompt_and_call():
    model = tiny_gpt(seed=2)
    # Compiles here: steps at position 1 (older torch specialises an int of 1, as it does sizes
    # 0 and 1, and compiles once more for it) and at every later position.
    generate(model, prompt(1, 1), max_new_tokens=4, temperature=0.0, compiled=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T, new in [(1, 5), (7, 9), (3, BLOCK - 3)]:  # each call builds a new twin
            generate(model, prompt(1, T), max_new_tokens=new, temperature=0.0, compiled=True)


def test_each_model_kind_compiles_a_step_of_its_own_so_none_falls_back_to_eager():
    """Dynamo counts recompilations per code object and past its limit silently runs the step
    uncompiled. One step shared by every model did so after 8 model shapes in one process (a
    test worker, a benchmark of several presets): now each model kind has a step of its own."""
    a, b = tiny_gpt(seed=6, n_layer=1), tiny_gpt(seed=6, n_layer=1, n_embd=48)
    same_kind = tiny_gpt(seed=7, n_layer=1)
    assert CompiledCPUEngine(a).compiled is CompiledCPUEngine(same_kind).compiled
    assert CompiledCPUEngine(a).compiled is not CompiledCPUEngine(b).compiled
    assert CompiledCPUEngine(a).compiled is not CompiledCPUEngine(a.to(torch.bfloat16)).compiled
    a.float()
    idx = prompt(1, 3)
    generate(a, idx, max_new_tokens=4, temperature=0.0, compiled=True)  # the pick compiles too
    limit_one = {"fail_on_recompile_limit_hit": True, "recompile_limit": 1, "cache_size_limit": 1}
    config = torch._dynamo.config
    with config.patch(**{k: v for k, v in limit_one.items() if hasattr(config, k)}):
        for model in (b, same_kind, a):  # a shared step would fail at b, its second graph
            tokens = generate(model, idx, max_new_tokens=4, temperature=0.0, compiled=True)
            assert torch.equal(tokens, eager_tokens(model, idx, 4, temperature=0.0))


def test_a_model_kind_holds_what_the_dropped_module_guards_checked():
    """The compiled step runs without dynamo's module-tree guards, so the kind that keys it must
    tell apart whatever those guards would: a module's settings, a hook, a tensor's strides;
    and it must not change with the engine's own KV cache (or every call would compile)."""
    model = tiny_gpt(seed=8, n_layer=1)
    kind = model_kind(model)
    model.setup_kv_cache(1, BLOCK)
    assert model_kind(model) == kind
    model.remove_kv_cache()
    model.blocks[0].attn.impl = "explicit"
    assert model_kind(model) != kind
    model.blocks[0].attn.impl = "fused"
    handle = model.blocks[0].register_forward_hook(lambda *_: None)
    assert model_kind(model) != kind
    handle.remove()
    assert model_kind(model) == kind
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().t().contiguous().t())
    assert model_kind(model) != kind  # the same shape, other strides
    step = CompiledCPUEngine(model).compiled
    idx = prompt(1, 3)
    tokens = generate(model, idx, max_new_tokens=3, temperature=0.0, compiled=True)
    assert torch.equal(tokens, eager_tokens(model, idx, 3, temperature=0.0))
    assert CompiledCPUEngine(model).compiled is step  # its twin now holds a cache: same kind
    engine_twin = CompiledCPUEngine(model).model
    assert twin_kind(engine_twin) is twin_kind(engine_twin) == model_kind(engine_twin)  # once


def test_the_compiled_step_runs_where_torch_lacks_the_cpu_only_options(monkeypatch):
    """An older (or CUDA) torch rejects inductor options it does not know: the engine asks only
    for those the installed torch lists, so removing them from the list must still compile."""
    ours = {*cpu_engines.CPU_STEP_OPTIONS, *cpu_engines.WIDE_CPU_STEP_OPTIONS}
    known = [o for o in torch._inductor.list_options() if o not in ours]
    monkeypatch.setattr(torch._inductor, "list_options", lambda: known)
    assert cpu_engines.step_compile_options() == {}
    assert cpu_engines.step_compile_options(cpu_engines.options_for_width(768)) == {}
    model = tiny_gpt(seed=4, n_layer=1)
    idx = prompt(1, 3)
    compiled = generate(model, idx, max_new_tokens=5, temperature=0.0, compiled=True)
    assert torch.equal(compiled, eager_tokens(model, idx, 5, temperature=0.0))


def test_the_cpu_options_are_used_where_torch_has_them():
    options = cpu_engines.step_compile_options()
    known = set(torch._inductor.list_options())
    assert options == {k: v for k, v in cpu_engines.CPU_STEP_OPTIONS.items() if k in known}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_greedy_pick_is_the_eager_one_ties_and_damaged_rows_included(dtype):
    from glassgpt.decoding.sampling import greedy_pick

    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, [7, 300, 999]] = 50.0  # a three-way tie: the first index wins, as in eager
    logits[2, 3] = float("nan")
    logits[3, 4] = float("inf")  # damaged rows take token 0 and clear the flag
    for rows in (logits[:1], logits[:2], logits):  # every batch size and finiteness
        flag = torch.ones((), dtype=torch.bool)
        eager, eager_flag = greedy_pick(rows, flag)
        compiled, compiled_flag = cpu_engines.compiled_greedy_pick()(rows, flag)
        assert torch.equal(compiled, eager) and bool(compiled_flag) == bool(eager_flag)
    assert eager[:, 0].tolist()[:4] == [int(logits[0].float().argmax()), 7, 0, 0]
    assert not bool(eager_flag)


def test_greedy_compiled_decoding_picks_every_token_through_the_compiled_pick(monkeypatch):
    picks = []
    compiled_pick = cpu_engines.compiled_greedy_pick()
    monkeypatch.setattr(cpu_engines, "compiled_greedy_pick",
                        lambda: lambda *args: picks.append(1) or compiled_pick(*args))
    model, idx = tiny_gpt(seed=4, n_layer=1), prompt(1, 3)
    tokens = generate(model, idx, max_new_tokens=6, temperature=0.0, compiled=True)
    assert len(picks) == 6 and torch.equal(tokens, eager_tokens(model, idx, 6, temperature=0.0))
    generate(model, idx, max_new_tokens=6, temperature=0.9, seed=1, compiled=True)
    assert len(picks) == 6  # sampling draws eagerly


@pytest.mark.slow  # compiles a wide step
def test_a_wide_model_compiles_its_step_storing_every_intermediate_and_keeps_the_tokens(
        monkeypatch):
    """From WIDE_FROM on the step asks inductor to store each intermediate, and attention's one
    query is two matmuls; the same tokens, with grouped K/V, a soft-cap and a local layer
    whose window the decoding passes."""
    asked = []
    build = cpu_engines.compiled_step
    monkeypatch.setattr(cpu_engines, "compiled_step",
                        lambda options, kind: asked.append(dict(options)) or build(options, kind))
    model = tiny_gpt(seed=5, n_head=4, n_kv_head=2, position="rope", attn_softcap=1.0,
                     sliding_window=3, local_layers=[0])
    with torch.no_grad():  # scores past the soft-cap, and logits that show what attention did
        for block in model.blocks:
            block.attn.qkv.weight.mul_(8)
        model.lm_head.weight.mul_(20)
    narrow_attention = {type(block.attn) for block in CompiledCPUEngine(model).model.blocks}
    monkeypatch.setattr(cpu_engines, "WIDE_FROM", model.config.n_embd)  # this model is "wide"
    engine = CompiledCPUEngine(model)
    idx = prompt(1, 3)
    wide = generate(model, idx, max_new_tokens=6, temperature=0.0, compiled=True)
    assert asked == [cpu_engines.step_compile_options(cpu_engines.CPU_STEP_OPTIONS),
                     cpu_engines.step_compile_options(cpu_engines.WIDE_CPU_STEP_OPTIONS),
                     cpu_engines.step_compile_options(cpu_engines.WIDE_CPU_STEP_OPTIONS)]
    assert narrow_attention == {cpu_engines.OneQueryAttention}
    assert {type(block.attn) for block in engine.model.blocks} == {
        cpu_engines.OneQueryMatmulAttention}
    assert cpu_engines.options_for_width(768) == cpu_engines.WIDE_CPU_STEP_OPTIONS
    assert torch.equal(wide, eager_tokens(model, idx, 6, temperature=0.0))
    # Each step's logits, not only its argmax: a lost soft-cap can keep a tiny model's tokens.
    reference = EagerEngine(model)
    for run in (engine, reference):
        run.start(1, BLOCK)
    torch.testing.assert_close(engine.prefill(idx), reference.prefill(idx))
    for pos in range(3, wide.shape[1]):
        token = wide[:, pos:pos + 1]
        torch.testing.assert_close(engine.step(token, pos), reference.step(token, pos),
                                   rtol=1e-5, atol=1e-5)
    reference.close()


def test_compiled_bf16_decoding_runs_and_mostly_agrees():
    model = tiny_gpt(seed=3)
    idx = prompt(1, 4)
    fp32 = generate(model, idx, max_new_tokens=10, temperature=0.0)
    half = generate(model.to(torch.bfloat16), idx, max_new_tokens=10, temperature=0.0,
                    compiled=True)
    assert half.shape == fp32.shape and half.dtype == torch.long
    assert torch.equal(half[:, :6], fp32[:, :6])  # rounding may part them late, not at once


# --- choosing an engine ---------------------------------------------------------------------

def test_auto_picks_the_engine_of_the_device():
    model = tiny_gpt()
    assert type(engine_for(model)) is EagerEngine  # one thread (conftest): nothing to split
    assert type(engine_for(model, "cpu")) is CPUEngine
    assert type(engine_for(model, compiled=True)) is CompiledCPUEngine
    assert type(engine_for(model, "eager")) is EagerEngine


@pytest.mark.parametrize(("plain", "threaded", "chosen"), [
    ([0.010, 0.011, 0.009], [0.008, 0.007, 0.008], CPUEngine),  # threaded faster: taken
    ([0.010, 0.010, 0.010], [0.012, 0.004, 0.013], EagerEngine),  # slower median: refused
    ([0.010, 0.010, 0.010], [0.010, 0.010, 0.010], EagerEngine),  # a tie: the plain model
    ([0.010, 0.010, 0.010], [0.0097, 0.0097, 0.0097], EagerEngine),  # within the noise margin
])
def test_auto_on_a_cpu_takes_the_threaded_engine_only_where_it_is_faster(
        two_threads, plain, threaded, chosen):
    calls = []

    def timer(engines):
        calls.append(sorted(engines))
        return {"eager": plain, "cpu": threaded}

    choice.forget_choices()
    try:
        model = tiny_gpt()
        assert type(choice.measured_cpu_engine(model, timer)) is chosen
        assert type(choice.measured_cpu_engine(model, timer)) is chosen
        assert calls == [["cpu", "eager"]]  # measured once for this shape, dtype and threads
        torch.set_num_threads(1)
        assert type(choice.measured_cpu_engine(model, timer)) is EagerEngine
        assert len(calls) == 1  # one thread: the plain model, without timing
        torch.set_num_threads(2)
        half = tiny_gpt().to(torch.bfloat16)
        assert type(choice.measured_cpu_engine(half, timer)) is EagerEngine
        assert len(calls) == 1  # bf16 weights: nothing is threaded, nothing to time
    finally:
        choice.forget_choices()


def test_a_short_decoding_is_not_worth_timing_the_engines_for(two_threads, monkeypatch):
    timed = []

    def timer(engines):
        timed.append(1)
        return {"eager": [1.0], "cpu": [0.1]}

    monkeypatch.setattr("glassgpt.decoding.measured_cpu_engine",
                        lambda model: choice.measured_cpu_engine(model, timer))
    choice.forget_choices()
    try:
        model = tiny_gpt()
        short = choice.MEASURED_FROM - 1
        assert choice.auto_engine_name(model, short, compiled=False) == "eager"
        assert choice.auto_engine_name(model, short, compiled=True) == "auto"
        assert choice.auto_engine_name(model, choice.MEASURED_FROM, compiled=False) == "auto"
        generate(model, prompt(1, 3), max_new_tokens=short, temperature=0.0)
        assert timed == []  # eight timed steps would cost more than a few tokens win back
        generate(model, prompt(1, 3), max_new_tokens=choice.MEASURED_FROM, temperature=0.0)
        assert timed == [1]
    finally:
        choice.forget_choices()


def test_the_choice_times_real_steps_and_auto_gives_the_eager_tokens(two_threads):
    choice.forget_choices()
    try:
        model = tiny_gpt()
        seconds = choice.step_seconds({"eager": EagerEngine(model), "cpu": CPUEngine(model)})
        assert {k: len(v) for k, v in seconds.items()} == {"eager": 3, "cpu": 3}
        assert all(t > 0 for times in seconds.values() for t in times)
        assert all(block.attn.kv_cache is None for block in model.blocks)  # left as it was
        idx = prompt(1, 5)
        expected = generate(model, idx, max_new_tokens=12, temperature=0.0, engine="eager")
        assert torch.equal(generate(model, idx, max_new_tokens=12, temperature=0.0), expected)
    finally:
        choice.forget_choices()


@pytest.mark.parametrize(("name", "compiled", "message"), [
    ("eager", True, "uncompiled reference"),
    ("cuda-graph", False, "decodes a model on cuda, this one is on cpu"),
    ("turbo", False, "unknown decoding engine 'turbo'"),
])
def test_an_engine_that_cannot_run_is_a_config_error(name, compiled, message):
    with pytest.raises(ConfigError, match=message):
        engine_for(tiny_gpt(), name, compiled)


# --- on a GPU (the device check runs these; CI has no GPU) ----------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("variant", ["GPT-2", *MODERN_VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3])
def test_cuda_graph_decoding_gives_exactly_the_eager_tokens(dtype, B, variant):
    model = tiny_gpt(seed=5, **MODERN_VARIANTS.get(variant, {})).to("cuda", dtype)
    idx = prompt(B, 5).cuda()
    assert type(engine_for(model)) is CUDAGraphEngine
    for kind in SAMPLING.values():
        graph = generate(model, idx, max_new_tokens=30, **kind)
        assert torch.equal(graph, generate(model, idx, max_new_tokens=30, engine="eager", **kind))


@cuda
def test_compiled_cuda_graph_decoding_gives_the_eager_greedy_tokens():
    model = tiny_gpt(seed=6).cuda()
    idx = prompt(1, 5).cuda()
    compiled = generate(model, idx, max_new_tokens=30, temperature=0.0, compiled=True)
    torch.testing.assert_close(compiled, generate(model, idx, max_new_tokens=30,
                                                  temperature=0.0, engine="eager"))
