"""The benchmark's measuring code: timing method, FLOP and byte arithmetic, ratios, the CLI.

Tiny shapes only: these tests check that the numbers are computed right, not how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glassgpt import bench
from glassgpt.cli import main
from glassgpt.config import GPTConfig, TrainConfig
from glassgpt.decoding.blocks import quantize_blocks
from glassgpt.errors import ConfigError, GlassGPTError
from glassgpt.model import GPT

# cpu-small shrunk further: every code path of the benchmark, in well under a second.
TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=32)
PROBES = bench.LimitProbes(matmul_size=64, buffer_bytes=2**20)


def glassgpt(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glassgpt", *argv], capture_output=True,
                          text=True, timeout=120)


# --- timing ---------------------------------------------------------------------------------

def test_interleaved_medians_rotates_the_order_and_skips_warm_up(monkeypatch):
    calls: list[str] = []
    durations = {"a": 1.0, "b": 3.0}
    clock = [0.0]

    def contender(name: str):
        def run() -> None:
            calls.append(name)
            clock[0] += durations[name]
            durations[name] += 1.0  # each call of a contender takes a second longer
        return run

    monkeypatch.setattr(bench.measure.time, "perf_counter", lambda: clock[0])
    medians = bench.interleaved_medians({"a": contender("a"), "b": contender("b")}, rounds=3,
                                        warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then rotating rounds
    assert medians == {"a": 3.0, "b": 5.0}  # timed calls took 2, 3, 4 and 4, 5, 6 seconds


def test_interleaved_medians_needs_a_round():
    with pytest.raises(ConfigError, match="rounds"):
        bench.interleaved_medians({"a": lambda: None}, rounds=0)


def test_limit_probes_turn_seconds_into_rates():
    assert PROBES.flops(2.0) == 2 * 64**3 / 2.0
    assert PROBES.bandwidth(0.5) == 2**20 / 0.5
    limits = bench.measure_limits(PROBES, rounds=1)
    assert limits.matmul_flops > 1e6 and limits.read_bandwidth > 1e6


# --- arithmetic -----------------------------------------------------------------------------

def test_train_flops_per_token_is_6n_plus_attention_by_hand():
    model = GPT(GPTConfig.from_preset("cpu-small"))
    V, T, L, H, C = 65, 64, 4, 4, 128
    n_params = V * C + L * (12 * C * C + 13 * C) + 2 * C  # no position table: it is a lookup
    assert bench.matmul_parameters(model) == n_params
    expected = 6 * n_params + 12 * L * H * (C // H) * T
    assert bench.train_flops_per_token(model.config, n_params, T) == expected


@pytest.mark.parametrize("tied", [True, False])
def test_decode_bytes_count_every_weight_once_and_one_row_per_lookup(tied):
    V, L, C = 65, 1, 16  # block_size 32: the position table is read one row at a time
    model = GPT(GPTConfig.from_preset("cpu-small", tie_weights=tied, **TINY))
    blocks = L * (12 * C * C + 13 * C) + 2 * C  # + final LayerNorm
    lm_head, one_row = V * C, C
    lookups = one_row + (0 if tied else one_row)  # position row, and token row if untied
    assert bench.decode_bytes_per_token(model) == 4 * (blocks + lm_head + lookups)
    assert bench.decode_bytes_per_token(model.to(torch.bfloat16)) == 2 * (blocks + lm_head
                                                                         + lookups)


# --- training -------------------------------------------------------------------------------

def test_training_results_follow_from_the_measured_step():
    results = bench.bench_training("cpu-small", PROBES, against_hf=True, compiled=False,
                                   rounds=1, batch_size=2, dropout=0.1, **TINY)
    assert [(r.contender, r.dtype) for r in results] == [
        (bench.GLASSGPT, "float32"), (bench.GLASSGPT, "bfloat16"), (bench.HF, "float32")]
    model = GPT(GPTConfig.from_preset("cpu-small", **TINY))
    flops = bench.train_flops_per_token(model.config, bench.matmul_parameters(model), 32)
    for r in results:
        assert (r.batch_size, r.seq_len, r.dropout, r.flops_per_token) == (2, 32, 0.1, flops)
        assert r.tokens_per_s == pytest.approx(2 * 32 / r.step_seconds)
        assert r.mfu == pytest.approx(r.tokens_per_s * flops / r.matmul_flops)
    fp32, bf16, hf = results
    assert fp32.matmul_flops == hf.matmul_flops > 0  # one probe for the group
    assert bf16.matmul_flops > 0 and bf16.matmul_flops != fp32.matmul_flops  # its own peak


def test_bench_train_config_uses_the_recipe_with_a_capped_batch():
    cfg = bench.bench_train_config("shakespeare-char", None)
    assert (cfg.batch_size, cfg.grad_accum, cfg.lr, cfg.beta2) == (bench.MAX_TRAIN_BATCH, 1,
                                                                    1e-3, 0.99)
    assert bench.bench_train_config("shakespeare-char", 3).batch_size == 3


def test_compiled_training_is_one_graph_and_matches_eager_losses():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16))
    data = torch.randint(0, 11, (2, 9))
    cfg = TrainConfig(batch_size=2, lr=1e-2)
    eager, compiled = bench.eager_and_compiled_losses(model, (data[:, :-1], data[:, 1:]), 3, cfg)
    assert eager[0] != eager[-1]  # the steps did train
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


# --- decoding -------------------------------------------------------------------------------

def test_decoding_results_and_bandwidth_fraction():
    results = bench.bench_decoding("cpu-small", PROBES, against_hf=True, rounds=1,
                                   new_tokens=6, **TINY)
    keys = [(r.contender, r.cache, r.dtype) for r in results]
    assert keys == [(bench.GLASSGPT, True, "float32"), (bench.GLASSGPT_EAGER, True, "float32"),
                    (bench.GLASSGPT_COMPILED, True, "float32"),
                    (bench.GLASSGPT, True, "bfloat16"), (bench.GLASSGPT_COMPILED, True, "bfloat16"),
                    (bench.GLASSGPT, True, "int8"),  # uncompiled, as `sample --dtype int8`
                    (bench.HF, True, "float32"), (bench.GLASSGPT, False, "float32"),
                    (bench.HF, False, "float32")]
    fp32 = results[0].bytes_per_token
    int8 = bench.decode_bytes_per_token(quantize_blocks(bench.bench_model("cpu-small", **TINY)))
    for r in results:
        assert r.bytes_per_token == {"bfloat16": fp32 // 2, "int8": int8}.get(r.dtype, fp32)
        assert r.tokens_per_s == pytest.approx(6 / r.seconds)
        assert r.read_bandwidth == results[0].read_bandwidth > 0  # one probe for the run
        limit = r.read_bandwidth / r.bytes_per_token  # tokens/s if bandwidth-bound
        assert r.bandwidth_fraction == pytest.approx(r.tokens_per_s / limit)


def test_the_read_probe_runs_after_every_decoder_and_the_limit_is_its_best(monkeypatch):
    """One probe read after each decoder in each round; the limit is the fastest of them."""
    from glassgpt.bench import decoding

    assert list(decoding.alternate({"a": 1, "b": 2, "c": 3}, {"x": 9, "y": 8})) == \
        ["a", "x", "b", "y", "c"]
    seconds = iter([0.5, 0.25, 1.0] * 100)  # the probe's reads, slow and fast in turn
    probes = bench.LimitProbes(matmul_size=8, buffer_bytes=4096)
    timed = decoding.interleaved_times
    orders = []

    def recording(contenders, rounds, **kwargs):
        orders.append(list(contenders))
        times = timed(contenders, rounds, **kwargs)
        return {k: ([next(seconds) for _ in v] if k[0] == probes.READ else v)
                for k, v in times.items()}

    monkeypatch.setattr(decoding, "interleaved_times", recording)
    results = bench.bench_decoding("cpu-small", probes, bf16=False, uncached=False,
                                   compiled=False, int8=False, rounds=2, new_tokens=2, **TINY)
    kinds = ["probe" if k[0] == probes.READ else "decoder" for k in orders[0]]
    assert kinds == ["decoder", "probe"] * 2  # glassgpt, then glassgpt eager: a read after each
    assert results[0].read_bandwidth == probes.bandwidth(0.25)


def test_decode_profiles_show_operators_eager_and_one_graph_compiled():
    products = {"aten::baddbmm", "aten::bmm", "aten::addmm", "aten::mm"}  # BLAS, any path
    eager = bench.profile_decode_step("cpu-small", top=20)
    assert {o.workload for o in eager} == {"decode step"}
    assert products & {o.op for o in eager}
    compiled = bench.profile_decode_step("cpu-small", top=20, compiled=True)
    ops = {o.op: o for o in compiled}
    assert ops["inductor kernels (one compiled graph)"].calls == 1
    assert not products & set(ops)  # every one-row product runs inside the graph
    assert sum(o.share for o in compiled) == pytest.approx(1.0, abs=0.05)


def test_decode_must_fit_the_context():
    with pytest.raises(ConfigError, match="block_size=32"):
        bench.bench_decoding("cpu-small", PROBES, new_tokens=17, **TINY)


def test_bf16_cost_is_small_and_well_formed():
    cost = bench.bf16_cost("cpu-small", new_tokens=8, **TINY)
    assert 0.5 <= cost.top1_agreement <= 1.0
    assert 0.0 <= cost.mean_kl < 1e-2 and 0.0 < cost.max_logit_error < 0.5


def test_missing_transformers_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(GlassGPTError, match=r"pip install"):
        bench.hf_twin(GPT(GPTConfig.from_preset("cpu-small", **TINY)))


# --- the report -----------------------------------------------------------------------------

def _train(contender: str, tokens_per_s: float, dtype="float32") -> bench.TrainSpeed:
    return bench.TrainSpeed("p", contender, dtype, 1, 1, 0.0, 1.0, tokens_per_s, 1.0, 0.5, 1.0)


def _decode(contender: str, cache: bool, tokens_per_s: float, dtype="float32"):
    return bench.DecodeSpeed("p", contender, cache, dtype, 1.0, tokens_per_s, 1, 0.5, 1.0)


def test_speedups_divide_the_right_rows():
    report = bench.BenchReport({}, bench.MachineLimits(1.0, 1.0), train=[
        _train(bench.GLASSGPT, 300.0), _train(bench.GLASSGPT_COMPILED, 450.0),
        _train(bench.GLASSGPT, 500.0, "bfloat16"), _train(bench.HF, 200.0)], decode=[
        _decode(bench.GLASSGPT, True, 500.0), _decode(bench.GLASSGPT, True, 900.0, "bfloat16"),
        _decode(bench.GLASSGPT_COMPILED, True, 750.0),
        _decode(bench.GLASSGPT_COMPILED, True, 1500.0, "bfloat16"),
        _decode(bench.GLASSGPT, False, 100.0), _decode(bench.HF, True, 250.0),
        _decode(bench.HF, False, 50.0)])
    ratios = {(s.workload, s.contender, s.reference): s.ratio for s in bench.speedups(report)}
    assert ratios == {("train", bench.GLASSGPT, "hf"): 1.5,
                      ("train", bench.GLASSGPT_COMPILED, "hf"): 2.25,
                      ("train", f"{bench.GLASSGPT} bfloat16", "hf"): 2.5,
                      ("decode", bench.GLASSGPT, "hf"): 2.0,
                      ("decode", bench.GLASSGPT, "glassgpt no-cache"): 5.0,
                      ("decode", bench.GLASSGPT, "hf no-cache"): 10.0,
                      ("decode", bench.GLASSGPT_COMPILED, "hf"): 3.0,
                      ("decode", bench.GLASSGPT_COMPILED, "glassgpt no-cache"): 7.5,
                      ("decode", bench.GLASSGPT_COMPILED, "hf no-cache"): 15.0}


def test_cli_writes_every_figure_as_json(tmp_path: Path):
    out = tmp_path / "bench.json"
    result = glassgpt("bench", "generate", "--preset", "cpu-small", "--rounds", "1",
                      "--new-tokens", "4", "--no-compile", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "Decoding" in result.stdout and "tokens/s" in result.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"machine", "limits", "train", "decode", "precision", "profile",
                         "speedups"}
    assert data["limits"]["matmul_flops"] > 0 and data["limits"]["read_bandwidth"] > 0
    row = data["decode"][0]
    assert {"preset", "contender", "cache", "dtype", "tokens_per_s", "bytes_per_token",
            "bandwidth_fraction"} <= set(row)
    assert data["machine"]["cores"] >= 1 and "load_before" in data["machine"]
    assert data["precision"][0]["preset"] == "cpu-small"
    assert {r["cache"] for r in data["decode"]} == {True, False}


@pytest.mark.parametrize("argv, message", [
    (["bench", "--preset", "gpt5"], "unknown preset 'gpt5'"),
    (["bench", "generate", "--preset", "cpu-small"], "block_size=64"),
    (["bench", "--threads", "0"], "--threads must be between 1 and"),
    (["bench", "--threads", "1000000"], "--threads must be between 1 and"),
    (["bench", "--rounds", "0"], "--rounds must be positive, got 0"),
    (["bench", "train", "--dropout", "lots"], "--dropout must be a rate"),
    (["bench", "--json", "."], "is a directory"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_cuda_without_a_gpu_is_one_line(capsys):
    assert main(["bench", "--device", "cuda", "--quick"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_quick_picks_one_preset_per_workload_and_device():
    from glassgpt.cli.benchmark import QUICK_PRESETS

    assert QUICK_PRESETS == {"cpu": ("cpu-small", "shakespeare-char"), "cuda": ("gpt2", "gpt2")}
    assert bench.bench_train_config("shakespeare-char", None, on_gpu=True).batch_size == 64
    assert bench.bench_train_config("shakespeare-char", None).batch_size == bench.MAX_TRAIN_BATCH


def test_timing_waits_for_the_device_before_reading_the_clock(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(bench.measure.time, "perf_counter", lambda: events.append("clock") or 0)
    bench.interleaved_times({"a": lambda: events.append("run")}, rounds=1, warmup=0,
                            sync=lambda: events.append("sync"))
    assert events == ["sync", "clock", "run", "sync", "clock"]


def test_thread_settings_are_timed_side_by_side_and_auto_chooses(monkeypatch):
    monkeypatch.setattr("glassgpt.machine.devices.os.cpu_count", lambda: 2)
    monkeypatch.setattr("glassgpt.bench.threads.os.cpu_count", lambda: 2)
    rows = bench.bench_threads("cpu-small", steps=8, rounds=1, load=False, batch_size=1)
    assert [r.setting for r in rows] == ["torch default", "1", "2", "auto"]
    assert all(r.tokens_per_s > 0 and r.step_seconds > 0 for r in rows)
    assert rows[-1].threads_used in (1, 2)  # the tuner probed (1 warm-up + 3 + 3) and chose


def test_the_competing_load_is_a_process_that_ends_with_the_block(monkeypatch):
    started = []
    real_popen = bench.threads.subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(bench.threads.subprocess, "Popen", popen)
    with bench.competing_load():
        assert started[0].poll() is None  # spinning
    assert started[0].poll() is not None  # gone
