"""Decoding: the KV cache changes nothing but the speed; sampling filters; stop tokens; streaming.

Shapes: B = batch, T = prompt length, V = vocabulary.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from conftest import tiny_gpt
from glassgpt.decoding.generate import generate, generate_stream, sample_next_token
from glassgpt.decoding.sampling import keep_top_k, keep_top_p
from glassgpt.errors import InputError, ModelError
from glassgpt.model import GPT

V, BLOCK = 23, 10


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return tiny_gpt(vocab_size=V, block_size=BLOCK).eval()


def prompt(B: int, T: int) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(B * 100 + T))


# --- cached decoding == uncached decoding --------------------------------------------------

SAMPLING = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=1.0, seed=7),
    "top_k": dict(temperature=0.8, top_k=5, seed=8),
    "top_p": dict(temperature=1.2, top_p=0.9, seed=9),
    "top_k+top_p": dict(temperature=1.0, top_k=10, top_p=0.8, seed=10),
}


@pytest.mark.parametrize("kind", SAMPLING)
@pytest.mark.parametrize("B, T, new", [
    (1, 1, 6),  # short prompt, stays inside the window
    (3, 4, BLOCK - 4),  # ends exactly at block_size
    (2, 4, 2 * BLOCK),  # runs far past block_size: the window slides
    (2, BLOCK, 5),  # the prompt fills the window already
    (2, BLOCK + 3, 4),  # the prompt itself is longer than the window
])
def test_cached_decoding_gives_exactly_the_uncached_tokens(model, kind, B, T, new):
    idx = prompt(B, T)
    cached = generate(model, idx, max_new_tokens=new, use_cache=True, **SAMPLING[kind])
    uncached = generate(model, idx, max_new_tokens=new, use_cache=False, **SAMPLING[kind])
    assert cached.shape == (B, T + new)
    assert torch.equal(cached[:, :T], idx)
    assert torch.equal(cached, uncached)


def test_decoding_past_block_size_conditions_on_the_last_window(model):
    idx = prompt(1, 3)
    # Rolls the token buffer twice.
    out = generate(model, idx, max_new_tokens=4 * BLOCK, temperature=0.0)
    # Greedy: every new token is the argmax after the block_size tokens before it.
    for pos in range(3, out.shape[1]):
        window = out[:, max(0, pos - BLOCK):pos]
        assert out[0, pos] == model(window)[0][0, -1].argmax()


def test_a_huge_token_budget_allocates_no_huge_buffer(model):
    # Streaming a few tokens of an enormous budget: the decoder keeps at most two windows.
    stream = generate_stream(model, prompt(1, 3), max_new_tokens=10**12, temperature=0.0)
    tokens = [next(stream) for _ in range(3 * BLOCK)]
    stream.close()
    expected = generate(model, prompt(1, 3), max_new_tokens=3 * BLOCK, temperature=0.0)[:, 3:]
    assert torch.equal(torch.cat(tokens, dim=1), expected)


@pytest.mark.parametrize("attn_impl", ["fused", "explicit"])
def test_kv_cached_logits_equal_full_forward_position_by_position(attn_impl):
    torch.manual_seed(1)
    model = tiny_gpt(vocab_size=V, block_size=BLOCK, n_layer=3, n_head=4, n_embd=32,
                     attn_impl=attn_impl).eval()
    idx = prompt(3, BLOCK)
    with torch.no_grad():
        full, _ = model(idx)  # (B, T, V)
        model.setup_kv_cache(3)
        prefill, _ = model(idx[:, :4], start_pos=0)  # (B, 4, V)
        steps = [model(idx[:, t:t + 1], start_pos=t)[0] for t in range(4, BLOCK)]
        model.remove_kv_cache()
    cached = torch.cat([prefill, *steps], dim=1)
    diff = (cached - full).abs().max(dim=-1).values.max(dim=0).values  # (T,)
    print(f"{attn_impl}: max |cached - full| logits per position: "
          + " ".join(f"{d:.1e}" for d in diff.tolist()))
    assert torch.all(diff <= 1e-5)


@pytest.mark.parametrize("use_cache", [True, False])
def test_cache_feeds_one_token_per_step_until_the_window_is_full(model, use_cache):
    fed = []
    hook = model.register_forward_pre_hook(lambda module, args: fed.append(args[0].shape[1]))
    try:  # the eager engine: the model's own forward, which the hook watches
        generate(model, prompt(1, 3), max_new_tokens=2 * BLOCK, temperature=0.0,
                 use_cache=use_cache, engine="eager")
    finally:
        hook.remove()
    # After the prompt, one call per new token but the last, when the sequence holds n tokens:
    # with the cache only the newest while n fits the window, then the last BLOCK tokens.
    lengths = range(4, 3 + 2 * BLOCK)
    if use_cache:
        expected = [3] + [1 if n <= BLOCK else BLOCK for n in lengths]
    else:
        expected = [3] + [min(n, BLOCK) for n in lengths]
    assert fed == expected


def test_generate_cleans_up_the_cache_and_restores_training_mode(model):
    model.train()
    try:
        generate(model, prompt(1, 2), max_new_tokens=3)
        assert model.training
        assert all(block.attn.kv_cache is None for block in model.blocks)
    finally:
        model.eval()


def test_zero_new_tokens_returns_the_prompt(model):
    idx = prompt(2, 3)
    assert torch.equal(generate(model, idx, max_new_tokens=0), idx)


# --- streaming -----------------------------------------------------------------------------

@pytest.mark.parametrize("use_cache", [True, False])
def test_stream_yields_one_token_at_a_time_and_matches_generate(model, use_cache):
    idx = prompt(2, 3)
    stream = generate_stream(model, idx, max_new_tokens=8, temperature=1.0, seed=3,
                             use_cache=use_cache)
    tokens = list(stream)
    assert len(tokens) == 8 and all(t.shape == (2, 1) for t in tokens)
    expected = generate(model, idx, max_new_tokens=8, temperature=1.0, seed=3, use_cache=use_cache)
    assert torch.equal(torch.cat([idx, *tokens], dim=1), expected)


def test_stream_is_lazy(model):
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    try:
        stream = generate_stream(model, prompt(1, 2), max_new_tokens=5, temperature=0.0,
                                 engine="eager")
        assert calls == []  # nothing runs before the first token is asked for
        assert next(stream).shape == (1, 1)
        assert len(calls) == 1  # the prompt only: the next step waits for the next request
        next(stream)
        assert len(calls) == 2
        stream.close()
    finally:
        hook.remove()
    assert all(block.attn.kv_cache is None for block in model.blocks)


# --- seeds ---------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone(model):
    idx = prompt(2, 3)
    state = torch.get_rng_state()
    first = generate(model, idx, max_new_tokens=12, temperature=1.0, seed=123)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(generate(model, idx, max_new_tokens=12, temperature=1.0, seed=123), first)
    other = generate(model, idx, max_new_tokens=12, temperature=1.0, seed=124)
    assert not torch.equal(other, first)


def test_unseeded_sampling_uses_the_global_rng(model):
    idx = prompt(1, 3)
    torch.manual_seed(5)
    a = generate(model, idx, max_new_tokens=12, temperature=1.0)
    torch.manual_seed(5)
    b = generate(model, idx, max_new_tokens=12, temperature=1.0)
    assert torch.equal(a, b)


# --- stop token ----------------------------------------------------------------------------

class CountingModel(nn.Module):
    """A stand-in model that always predicts `last token + 1` (mod vocab), to test decoding."""

    def __init__(self, vocab_size: int = 10, block_size: int = 16):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, block_size=block_size)

    def setup_kv_cache(self, batch_size: int, max_len: int | None = None) -> None:
        pass

    def remove_kv_cache(self) -> None:
        pass

    def forward(self, idx: Tensor, start_pos: int | None = None, last_only: bool = False,
                check_ids: bool = True) -> tuple[Tensor, None]:
        following = (idx[:, -1:] + 1) % self.config.vocab_size  # (B, 1)
        logits = torch.zeros(idx.shape[0], 1, self.config.vocab_size)
        return logits.scatter(-1, following.unsqueeze(-1), 10.0), None  # (B, 1, V)


def test_a_row_that_emitted_the_stop_token_repeats_it():
    idx = torch.tensor([[1], [3]])
    out = generate(CountingModel(), idx, max_new_tokens=6, temperature=0.0, stop_token=5)
    # Row 1 reaches 5 after two steps and then repeats it; row 0 gets there after four.
    assert out.tolist() == [[1, 2, 3, 4, 5], [3, 4, 5, 5, 5]]  # ends once both rows stopped


def test_decoding_runs_to_max_tokens_when_a_row_never_stops():
    idx = torch.tensor([[1], [7]])
    out = generate(CountingModel(vocab_size=10), idx, max_new_tokens=5, temperature=0.0,
                   stop_token=4)
    assert out.tolist() == [[1, 2, 3, 4, 4, 4], [7, 8, 9, 0, 1, 2]]


def test_stop_token_with_the_real_model(model):
    idx = prompt(2, 4)
    free = generate(model, idx, max_new_tokens=8, temperature=0.0)
    stop = int(free[0, 6])  # row 0's third new token (or an earlier repeat of it)
    first = int((free[0, 4:] == stop).nonzero()[0])
    stopped = generate(model, idx, max_new_tokens=8, temperature=0.0, stop_token=stop)
    row0 = stopped[0, 4:]
    assert torch.equal(row0[:first + 1], free[0, 4:4 + first + 1])
    assert torch.all(row0[first:] == stop)
    # Row 1 is not touched until it emits the stop token itself.
    hits = (free[1, 4:] == stop).nonzero()
    row1_until = int(hits[0]) + 1 if len(hits) else 8
    assert torch.equal(stopped[1, 4:4 + row1_until], free[1, 4:4 + row1_until])


def test_stop_when_every_row_emits_it_ends_early(model):
    idx = prompt(1, 4).expand(3, 4)  # three identical rows stop at the same step
    free = generate(model, idx, max_new_tokens=8, temperature=0.0)
    stop = int(free[0, 5])
    first = int((free[0, 4:] == stop).nonzero()[0])
    stopped = generate(model, idx, max_new_tokens=8, temperature=0.0, stop_token=stop)
    assert stopped.shape == (3, 4 + first + 1)
    assert torch.equal(stopped, free[:, :4 + first + 1])


# --- sampling functions --------------------------------------------------------------------

def test_keep_top_k():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0],
                           [0.5, 0.125, 0.875, 0.25, 0.75]])
    kept = keep_top_k(logits, 2)
    inf = float("-inf")
    assert kept.tolist() == [[inf, 5.0, inf, 4.0, inf], [inf, inf, 0.875, inf, 0.75]]
    assert torch.equal(keep_top_k(logits, 99), logits)  # k above V keeps everything


def test_keep_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log()
    inf = float("-inf")
    # 0.5 alone is below 0.7; 0.5 + 0.3 reaches it, so the smallest nucleus is those two.
    assert keep_top_p(logits, 0.7).isinf().tolist() == [[True, False, True, False]]
    assert keep_top_p(logits, 0.9).isinf().tolist() == [[True, False, False, False]]
    assert keep_top_p(logits, 0.3)[0].tolist() == [inf, logits[0, 1].item(), inf, inf]
    assert torch.equal(keep_top_p(logits, 1.0), logits)


def test_sample_next_token_greedy_at_temperature_zero():
    logits = torch.randn(6, V)
    state = torch.get_rng_state()
    token = sample_next_token(logits, temperature=0.0)
    assert token.shape == (6, 1)
    assert torch.equal(token[:, 0], logits.argmax(-1))
    assert torch.equal(torch.get_rng_state(), state)  # greedy draws no random number
    assert torch.equal(sample_next_token(logits, top_k=1), token)


def test_sample_next_token_follows_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(20000, 4)
    generator = torch.Generator().manual_seed(0)
    for temperature in (0.5, 1.0, 2.0):
        tokens = sample_next_token(logits, temperature=temperature, generator=generator)
        freq = torch.bincount(tokens[:, 0], minlength=4) / 20000
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        assert (freq - expected).abs().max() < 0.015, (temperature, freq, expected)


def test_sample_next_token_never_picks_a_filtered_token():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, 2.8]).expand(5000, 5)
    generator = torch.Generator().manual_seed(1)
    top_k = sample_next_token(logits, top_k=2, generator=generator)
    assert set(top_k.unique().tolist()) == {0, 1}
    top_p = sample_next_token(logits, top_p=0.5, generator=generator)
    assert set(top_p.unique().tolist()) == {0, 1}


def test_sampling_with_a_generator_is_reproducible():
    logits = torch.randn(50, V)
    a = sample_next_token(logits, generator=torch.Generator().manual_seed(4))
    b = sample_next_token(logits, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)


# --- bad arguments -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), r"temperature must be >= 0.*got -0.5"),
    (dict(top_k=0), r"top_k must be a positive integer, got 0"),
    (dict(top_k=-3), r"top_k .*got -3"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p .*got 1.5"),
    (dict(max_new_tokens=-1), r"max_new_tokens must be >= 0, got -1"),
])
def test_bad_sampling_arguments_are_errors(model, kwargs, message):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(InputError, match=message):
        generate(model, prompt(1, 2), **kwargs)
    with pytest.raises(InputError, match=message):
        next(generate_stream(model, prompt(1, 2), **kwargs))


def test_empty_or_flat_prompt_is_an_error(model):
    with pytest.raises(InputError, match=r"got shape \(1, 0\)"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(InputError, match=r"got shape \(4,\)"):
        generate(model, torch.zeros(4, dtype=torch.long), max_new_tokens=3)


def test_prompt_token_outside_the_vocabulary_is_an_error(model):
    with pytest.raises(InputError, match=rf"token id {V} "):
        generate(model, torch.tensor([[1, V]]), max_new_tokens=3)


# --- temperatures and nuclei below float32's range; damaged models (issue 19) ---------------

@pytest.mark.parametrize("temperature", [1e-300, 1e-46, 1e-39])
def test_a_temperature_too_small_for_float32_is_greedy(model, temperature):
    """1e-46 is 0 in float32: dividing by it made NaN and torch's multinomial failed."""
    idx = prompt(2, 3)
    greedy = generate(model, idx, max_new_tokens=6, temperature=0.0)
    assert torch.equal(generate(model, idx, max_new_tokens=6, temperature=temperature, seed=0),
                       greedy)


def test_a_top_p_too_small_for_float32_keeps_the_top_token(model):
    """p = 1e-300 compares as 0 in float32, which dropped every token (NaN, then a crash)."""
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert keep_top_p(logits, 1e-300).isinf().tolist() == [[True, False, True]]
    idx = prompt(2, 3)
    greedy = generate(model, idx, max_new_tokens=6, temperature=0.0)
    assert torch.equal(generate(model, idx, max_new_tokens=6, top_p=1e-300, seed=0), greedy)


def damaged(model: GPT, name: str, row: int) -> GPT:
    """A copy of model whose parameter `name` holds NaN in one row."""
    copy = GPT(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        copy.get_parameter(name)[row] = float("nan")
    return copy


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=1.0, seed=0),
                                      dict(top_k=3, top_p=0.5, seed=0)])
@pytest.mark.parametrize("where", ["the prompt's step", "a later step"])
def test_logits_that_are_not_finite_are_a_model_error(model, settings, where):
    """Greedy returned tokens from NaN logits and sampling raised torch's RuntimeError. A NaN
    in position 6's embedding appears only at a later step, which is checked at the end."""
    broken = damaged(model, "tok_emb.weight", 0) if where == "the prompt's step" else \
        damaged(model, "pos_emb.weight", 6)
    with pytest.raises(ModelError, match="the model's logits are not finite"):
        generate(broken, prompt(2, 3), max_new_tokens=6, **settings)
    with pytest.raises(ModelError, match="not finite"):
        sample_next_token(torch.tensor([[0.0, float("nan")]]),
                          **{k: v for k, v in settings.items() if k != "seed"})


def test_a_stream_that_is_closed_early_never_raises_for_later_steps(model):
    broken = damaged(model, "pos_emb.weight", 6)
    stream = generate_stream(broken, prompt(1, 3), max_new_tokens=6, temperature=0.0)
    assert next(stream).shape == (1, 1)
    stream.close()  # the consumer stopped before position 6: nothing to report


@pytest.mark.parametrize("call, error, message", [
    (lambda m: generate(object(), prompt(1, 2)), ModelError,
     "generate needs a glassgpt GPT model, got object"),
    (lambda m: generate(nn.Linear(2, 2), prompt(1, 2)), ModelError, "got Linear"),
    (lambda m: generate(m, [[1, 2]]), InputError, "must be a tensor of token ids"),
    (lambda m: generate(m, prompt(1, 2), stop_token=V), InputError,
     rf"stop_token {V} is outside the vocabulary \[0, {V}\)"),
    (lambda m: next(generate_stream(m, prompt(1, 2), stop_token=10**6)), InputError,
     "stop_token 1000000"),
])
def test_what_generate_cannot_use_is_refused_before_any_work(model, call, error, message):
    with pytest.raises(error, match=message):
        call(model)
