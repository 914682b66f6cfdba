"""Int8 weight-only decoding (`glassgpt.decoding.quantized`) and `sample --dtype int8`.

An int8 model is held to its dequantized float model (every weight q * s): the same logits to
float rounding, exactly the same greedy tokens on every CPU engine; and to the float model it
came from: the same next token almost everywhere on a model that has learned something.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from glassgpt import bench
from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.decoding import CompiledCPUEngine, engine_for
from glassgpt.decoding.blocks import quantize_blocks, reference_products
from glassgpt.decoding.generate import generate
from glassgpt.decoding.prepare import decoding_model
from glassgpt.decoding.quantized import (
    INT8_MAX,
    Int8Embedding,
    Int8Linear,
    Int8ReductionLinear,
    dequantize_rows,
    dequantized,
    has_int8_mm,
    quantize_int8,
    quantize_rows,
)
from glassgpt.errors import ModelError
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import Run

V, BLOCK = 37, 24


@pytest.fixture(autouse=True)
def compiled_for_real() -> Iterator[None]:
    """Fail rather than fall back to eager if dynamo gives up (as tests/test_decoding.py)."""
    wanted = {"fail_on_recompile_limit_hit": True, "recompile_limit": 64,
              "cache_size_limit": 64}
    config = torch._dynamo.config
    with config.patch(**{k: v for k, v in wanted.items() if hasattr(config, k)}):
        yield


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    settings = dict(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32) | overrides
    return GPT(GPTConfig(**settings)).eval()


# --- the format ------------------------------------------------------------------------------

def test_a_row_round_trips_within_half_its_scale():
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.logspace(-3, 1, 64).unsqueeze(1)  # rows of every size
    weight[5] = 0.0  # a row of zeros
    q, scales = quantize_rows(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scales.shape == (64,)
    assert int(q.abs().max()) == INT8_MAX and int(q.min()) >= -INT8_MAX
    error = (dequantize_rows(q, scales) - weight).abs()  # (64, 96)
    # round(w / s) is within 1/2 of w / s; the float rounding of w / s and q * s adds ~1e-7.
    assert (error <= scales.unsqueeze(1) * (0.5 + 1e-5)).all()
    assert (q[5] == 0).all() and scales[5] == 1.0  # zeros stay exactly zero
    nonzero = torch.cat([scales[:5], scales[6:]])
    expected = torch.cat([weight[:5], weight[6:]]).abs().amax(1) / INT8_MAX
    torch.testing.assert_close(nonzero, expected)  # absmax / 127, per row


def test_a_scale_rounded_to_bf16_is_the_one_q_is_computed_against():
    weight = torch.randn(8, 40)
    q, scales = quantize_rows(weight, torch.bfloat16)
    assert scales.dtype == torch.bfloat16
    error = (dequantize_rows(q, scales).float() - weight).abs()
    # The scale rounded down can push |w| / s past 127 (clamped): still within one step.
    assert (error <= scales.float().unsqueeze(1) * 1.01).all()


@pytest.mark.parametrize("tie", [True, False])
def test_every_linear_becomes_int8_and_a_tied_table_shares_the_heads(tie):
    model = tiny_gpt(tie_weights=tie)
    int8 = quantize_int8(model)
    assert not any(type(m) is nn.Linear for m in int8.modules())
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert [n for n, m in int8.named_modules() if isinstance(m, Int8Linear)] == linears
    if tie:
        assert isinstance(int8.tok_emb, Int8Embedding)
        assert int8.tok_emb.qweight is int8.lm_head.qweight  # one table, both ways
    else:
        assert type(int8.tok_emb) is nn.Embedding
    assert not int8.training
    # The float model is left as it was, and shares nothing with its int8 copy.
    assert all(type(m) is not Int8Linear for m in model.modules())
    ours = {p.data_ptr() for p in model.parameters()}
    assert not ours & {p.data_ptr() for p in int8.parameters()}
    with pytest.raises(ModelError, match="int8 already"):
        quantize_int8(int8)


def test_the_weight_a_plain_reader_sees_is_the_dequantized_one():
    int8 = quantize_int8(tiny_gpt())
    head = int8.lm_head
    torch.testing.assert_close(head.weight, head.qweight.float() * head.scales.unsqueeze(1),
                               rtol=0, atol=0)
    assert int8.lm_head.weight.dtype == torch.float32  # what the KV cache is allocated in


def test_bytes_per_token_count_int8_weights_their_scales_and_one_row_of_each_table():
    int8 = quantize_int8(tiny_gpt())
    C, L = 32, 2
    linears = [m for m in int8.modules() if isinstance(m, Int8Linear)]  # the head included
    weights = sum(m.qweight.numel() for m in linears)
    scales = sum(m.scales.numel() for m in linears)
    other = sum(p.numel() for n, p in int8.named_parameters()
                if not n.endswith(("qweight", "scales")) and not n.startswith("pos_emb"))
    assert len(linears) == 4 * L + 1
    assert bench.decode_bytes_per_token(int8) == weights + 4 * scales + 4 * other + 4 * C


# --- the int8 model is the dequantized model ---------------------------------------------------

@pytest.mark.parametrize("rows", [1, 5, BLOCK])
def test_the_int8_logits_are_the_dequantized_models_to_float_rounding(rows):
    """Both multiply by the same q * s; the int8 product scales each row's sum once, the float
    one scales every weight first, so they differ by the rounding of a sum of 32-128 float32
    terms: ~1e-7 of the logits' size (~1 here), a few ulps after two layers. 1e-5 leaves
    room; a wrong scale, row or transpose is off by 1e-2 or more."""
    int8 = quantize_int8(tiny_gpt())
    plain = dequantized(int8)
    assert not any(isinstance(m, Int8Linear | Int8Embedding) for m in plain.modules())
    assert plain.lm_head.weight is plain.tok_emb.weight  # tied as the int8 model is
    idx = torch.randint(0, V, (2, rows))
    with torch.no_grad():
        torch.testing.assert_close(int8(idx)[0], plain(idx)[0], rtol=1e-5, atol=1e-5)
        # The token table is read exactly: q * s, row by row.
        torch.testing.assert_close(int8.tok_emb(idx), plain.tok_emb(idx), rtol=0, atol=0)


def test_bf16_activations_take_int8pack_mm_for_a_few_rows_and_match_the_dequantized_model():
    half = tiny_gpt().to(torch.bfloat16)
    int8 = quantize_int8(half)
    row = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    scales = int8.lm_head.scales
    assert has_int8_mm(row, scales) == hasattr(torch.ops.aten, "_weight_int8pack_mm")
    assert not has_int8_mm(row.float(), scales.float())  # its float32 loop is the slow one
    assert not has_int8_mm(torch.zeros(1, 64, 32, dtype=torch.bfloat16), scales)  # a prompt
    idx = torch.randint(0, V, (1, 6))
    with torch.no_grad():
        # bf16 rounds each output (and the dequantized model each weight q * s): a few bf16 ulps.
        torch.testing.assert_close(int8(idx)[0].float(), dequantized(int8)(idx)[0].float(),
                                   rtol=0.02, atol=0.02)


@pytest.mark.parametrize("engine,compiled", [("eager", False), ("cpu", False), ("auto", True)])
@pytest.mark.parametrize("tie", [True, False])
def test_every_cpu_engine_gives_the_dequantized_models_greedy_tokens(engine, compiled, tie):
    int8 = quantize_int8(tiny_gpt(seed=1, tie_weights=tie))
    prompt = torch.randint(0, V, (2, 3))
    expected = generate(dequantized(int8), prompt, max_new_tokens=BLOCK, temperature=0.0,
                        engine="eager")  # past the context: the recompute path too
    got = generate(int8, prompt, max_new_tokens=BLOCK, temperature=0.0, engine=engine,
                   compiled=compiled)
    assert torch.equal(got, expected)


def test_the_compiled_step_multiplies_the_int8_weights_as_reductions():
    int8 = quantize_int8(tiny_gpt())
    engine = engine_for(int8, "cpu", compiled=True)
    assert isinstance(engine, CompiledCPUEngine)
    fused = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert fused and all(type(m) is Int8ReductionLinear for m in fused)
    assert all(type(m) is Int8Linear for m in int8.modules() if isinstance(m, Int8Linear))


# --- against the float model ------------------------------------------------------------------

def trained_gpt(steps: int = 150) -> GPT:
    """A tiny GPT that has learned a noisy counting sequence (loss well below uniform's)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, n_embd=64,
                          dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        start = torch.randint(0, V, (16, 1))
        data = (start + torch.arange(BLOCK + 1) * torch.randint(1, 3, (16, 1))) % V
        _, loss = model(data[:, :-1], data[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss) < 0.5 * torch.log(torch.tensor(float(V)))
    return model.eval()


def test_int8_picks_the_float_models_next_token_almost_everywhere():
    model = trained_gpt()
    int8 = quantize_int8(model)
    torch.manual_seed(1)
    idx = (torch.randint(0, V, (32, 1)) + torch.arange(BLOCK) * torch.randint(1, 3, (32, 1))) % V
    with torch.no_grad():
        reference, approx = model(idx)[0], int8(idx)[0]  # (32, BLOCK, V)
    agreement = (reference.argmax(-1) == approx.argmax(-1)).float().mean()
    kl = F.kl_div(approx.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                  reduction="none").sum(-1).mean()
    assert agreement >= 0.98 and float(kl) < 1e-3


def test_the_bench_states_int8s_cost_and_decodes_it_with_the_block_kernel():
    tiny = dict(n_layer=1, n_head=2, n_embd=32, block_size=32)
    cost = bench.precision_cost("cpu-small", torch.int8, new_tokens=8, **tiny)
    assert cost.dtype == "int8" and 0.5 <= cost.top1_agreement <= 1.0
    assert 0.0 <= cost.mean_kl < 1e-2 and 0.0 < cost.max_logit_error < 0.5
    assert bench.bf16_cost("cpu-small", new_tokens=8, **tiny).dtype == "bfloat16"
    probes = bench.LimitProbes(matmul_size=64, buffer_bytes=1 << 16)
    rows = bench.bench_decoding("cpu-small", probes, bf16=False, uncached=False, rounds=1,
                                new_tokens=4, **tiny)
    int8 = [r for r in rows if r.dtype == "int8"]  # uncompiled: the kernel is fast as it is
    assert [(r.contender, r.cache) for r in int8] == [(bench.GLASSGPT, True)]
    model = quantize_blocks(bench.bench_model("cpu-small", dropout=0.0, **tiny), "q8_0")
    assert int8[0].bytes_per_token == bench.decode_bytes_per_token(model)


# --- the command line -----------------------------------------------------------------------

def test_sample_dtype_int8_decodes_the_runs_q8_0_model(trained_run, capsys):
    capsys.readouterr()
    args = ["sample", str(trained_run.run), "--dtype", "int8", "--prompt", "To be",
            "--max-new-tokens", "12", "--temperature", "0", "--threads", "1"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "int8: every layer's weight in Q8_0 blocks of 32" in err
    # every int8 model decodes uncompiled, through the block kernel, and says so
    assert "decoding uncompiled" in err and "compiled" not in err.replace("uncompiled", "")
    model, tokenizer = Run(trained_run.run).load_model("cpu")
    prompt = torch.tensor([tokenizer.encode("To be")])
    with reference_products():  # the kernel's tokens are its written-out reference's
        expected = generate(quantize_blocks(model, "q8_0"), prompt, max_new_tokens=12,
                            temperature=0.0, engine="eager")
    assert out == tokenizer.decode(expected[0].tolist()) + "\n"


def test_int8_never_compiles_unasked():
    """A 0.1M model compiled for minutes to decode 24 tokens, GPT-2 for 100 s: int8 and int4
    now multiply with the block kernel uncompiled, at any size (issue 56)."""
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=64))
    for dtype in ("int8", "int4", "float32"):
        assert not decoding_model(model, dtype).compiled
    assert decoding_model(model, "int8", compiled=True).compiled


def test_int8s_start_line_says_how_it_decodes():
    from glassgpt.decoding.session import BLOCK_NOTES, INT8_NOTE, int8_line

    small = int8_line(False, "cpu")
    assert small.startswith(INT8_NOTE) and "decoding uncompiled" in small
    assert "block kernel" in small
    assert int8_line(False, "cpu", "int4").startswith(BLOCK_NOTES["int4"])
    assert "--compile" in int8_line(True, "cpu")
    assert "torch reference" in int8_line(False, "cuda")
    assert "tens of seconds" not in small  # the old promise, which a loaded machine broke
    assert "\n" not in small
