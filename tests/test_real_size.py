"""What makes a real-size model (Qwen3-0.6B: 28 layers, 151,936 words) answer on a laptop,
each part held to the plain computation it replaces: the logit lens read out for every layer
at once, looks at early layers that stop there, head scores sized to the model, a short
`sample` that does not time the engines, and `eval` windows that fit. Speed itself is measured
in BENCHMARKS.md ("Loading a real-size model"), never here."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_gpt
from glassgpt.errors import InputError
from glassgpt.interp import run_with_cache
from glassgpt.interp.methods import lens
from glassgpt.view import causal


def test_the_lens_read_out_in_chunks_across_layers_is_each_layer_read_out_alone(monkeypatch):
    model = tiny_gpt(n_layer=3).double()
    idx = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator()
                        .manual_seed(1))
    residuals = lens.trace(model, idx).residuals  # (L + 1, B, T, C)
    monkeypatch.setattr(lens, "LENS_ROWS", 7)  # chunks that cut across layers and rows
    got = lens.lens_top_k(model, residuals, 4)
    for layer, x in enumerate(residuals):
        probs = torch.softmax(model.read_out(x).float(), dim=-1)
        values, ids = probs.topk(4, dim=-1)
        assert torch.equal(got.ids[layer], ids)
        torch.testing.assert_close(got.probs[layer], values, rtol=1e-6, atol=1e-7)


def test_stop_at_layer_returns_the_stream_there_and_never_runs_the_head(monkeypatch):
    model = tiny_gpt(n_layer=3)
    idx = torch.randint(0, model.config.vocab_size, (1, 6))
    _, full = run_with_cache(model, idx)
    monkeypatch.setattr(model.lm_head, "forward", lambda x: pytest.fail("the head ran"))
    for layer in (1, 2, 3):
        stream, cache = run_with_cache(model, idx, stop_at_layer=layer)
        assert torch.equal(stream, full[f"blocks.{layer - 1}.hook_resid_post"])
        assert f"blocks.{layer - 1}.attn.hook_pattern" in cache
        assert not any(name.startswith(f"blocks.{layer}.") for name in cache)
    stream, _ = run_with_cache(model, idx, stop_at_layer=0)
    assert torch.equal(stream, full["hook_embed"] + full["hook_pos_embed"])
    for bad in (-1, 4, True, 1.5):
        with pytest.raises(InputError, match="stop_at_layer must be an int in"):
            run_with_cache(model, idx, stop_at_layer=bad)


class Shaped:
    """Parameters of a model's sizes, holding no values (the meta device)."""

    def __init__(self, *shapes: tuple[int, ...]):
        self.shapes = shapes

    def parameters(self):
        return [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in self.shapes]


def test_head_scores_average_fewer_sequences_only_where_eight_would_cost_seconds():
    assert causal.score_batch(tiny_gpt(), causal.SCORE_HALF) == 8
    qwen3_06b = Shaped((596_049_920,))
    assert causal.score_batch(qwen3_06b, causal.SCORE_HALF) == 1  # never none


def test_an_attribution_from_the_callers_cache_is_the_one_it_computes_itself():
    from glassgpt.interp.methods.attribution import logit_attribution
    model = tiny_gpt(n_layer=2).double().eval()
    idx = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator()
                        .manual_seed(3))
    _, cache = run_with_cache(model, idx, stop_at_layer=2)
    given = logit_attribution(model, idx, 5, pos=4, cache=cache)
    computed = logit_attribution(model, idx, 5, pos=4)
    assert torch.equal(given.values, computed.values) and given.logit == computed.logit
    with torch.no_grad():
        logits, _ = model(idx)
    assert given.logit == pytest.approx(float(logits[0, 4, 5]), abs=1e-9)


def test_the_views_thread_timing_reads_out_one_position_not_the_whole_prompt(trained_run,
                                                                             monkeypatch):
    from glassgpt.view import server
    timed = []

    def settle(setting, device, step):
        timed.append(step())  # the unit of work "auto" would time
        return 1

    monkeypatch.setattr(server, "settle_threads", settle)
    view = server.load_for_view(trained_run.run, threads="auto")
    (logits, _), = timed
    assert logits.shape == (1, 1, view.model.config.vocab_size)  # the head over one position


def test_the_views_thread_timing_takes_shorter_prompts_only_for_big_models():
    from glassgpt.view.server import probe_tokens
    assert probe_tokens(tiny_gpt(block_size=16)) == 16  # its whole context, as before
    assert probe_tokens(tiny_gpt(block_size=128)) == 64
    big = tiny_gpt(block_size=128)
    big.parameters = Shaped((596_049_920,)).parameters  # a 0.6B model's count
    assert probe_tokens(big) == 8


@pytest.mark.parametrize("offset", [False, True])
def test_rmsnorm_takes_the_fused_kernel_only_where_it_computes_the_same(offset, monkeypatch):
    from glassgpt.norms import RMSNorm
    norm = RMSNorm(16, eps=1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    fused = []
    real = torch.nn.functional.rms_norm
    monkeypatch.setattr(torch.nn.functional, "rms_norm",
                        lambda *args: fused.append(args[0].dtype) or real(*args))
    torch.testing.assert_close(norm(x), norm.steps(x), rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norm(x.bfloat16())
    assert fused == [torch.float32, torch.bfloat16]  # float32, and bf16 under autocast
    half = RMSNorm(16, eps=1e-6, offset=offset).bfloat16()
    assert torch.equal(half(x.bfloat16()), half.steps(x.bfloat16()))  # transformers' rounding
    norm.hook_normalized.register_forward_hook(lambda module, args, out: None)
    norm(x)
    assert len(fused) == 2  # watched: x_hat must exist, so the steps ran
