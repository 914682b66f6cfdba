"""`glassgpt bench generate --against llamacpp` at a toy size: every contender measured, the
figures consistent with each other, and llama.cpp's greedy tokens glassgpt's."""

from __future__ import annotations

import sys

import pytest

from glassgpt.bench.llamacpp import LLAMACPP, bench_against_llamacpp
from glassgpt.errors import ConfigError
from helpers_cli import glassgpt, one_error_line

TOY = {"n_layer": 2, "n_head": 6, "n_embd": 96, "vocab_size": 256}


def test_every_decoder_and_precision_is_measured_at_each_thread_count() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the extra llamacpp) is the "
                        "reference decoder")
    report = bench_against_llamacpp(("gpt2", "smollm2-135m"), threads=(1,), rounds=1,
                                    new_tokens=6, prompt_len=4, prefill_len=16, compiled=False,
                                    **TOY)
    measured = {(r.preset, r.decoder, r.precision) for r in report.rows}
    for preset in ("gpt2", "smollm2-135m"):
        assert {(d, p) for q, d, p in measured if q == preset} == {
            ("glassgpt eager", "fp32"), ("glassgpt eager", "bf16"), ("glassgpt eager", "int8"),
            ("glassgpt eager", "int4"), (LLAMACPP, "f32"),
            (LLAMACPP, "f16"), (LLAMACPP, "bf16"), (LLAMACPP, "q8_0"), (LLAMACPP, "q4_0")}
        # The same weights decode to the same greedy tokens (a toy model has no near ties),
        # and the same Q8_0 and Q4_0 blocks too (the integer sums are llama.cpp's).
        assert report.same_tokens[preset] == (6, 6)
        assert report.same_blocks[f"{preset} int8/q8_0"] == (6, 6)
        assert report.same_blocks[f"{preset} int4/q4_0"] == (6, 6)
    for r in report.rows:
        assert 0 < r.slowest <= r.tokens_per_s <= r.fastest
        assert r.prefill_tokens_per_s > 0 and r.bandwidth_fraction > 0
    # A fraction is tokens/s x bytes a step / bandwidth: q8_0 reads 34/32 bytes a weight,
    # f32 four, at the same bandwidth.
    row = {(r.preset, r.precision): r for r in report.rows if r.decoder == LLAMACPP}
    f32, q8 = row["gpt2", "f32"], row["gpt2", "q8_0"]
    assert (q8.bandwidth_fraction / q8.tokens_per_s) / (f32.bandwidth_fraction
                                                        / f32.tokens_per_s) \
        == pytest.approx(34 / 32 / 4)


def test_without_llama_cpp_the_bench_says_how_to_install_it(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(ConfigError, match=r"pip install 'glassgpt\[llamacpp\]'"):
        bench_against_llamacpp(("gpt2",), rounds=1, **TOY)
    code, err = glassgpt("bench", "train", "--against", "llamacpp", capsys=capsys)
    assert code == 2 and "glassgpt bench generate --against llamacpp" in one_error_line(err)
