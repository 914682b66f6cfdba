"""The five experiments of the modern Transformer's switches (positions, norms, mlps, kvheads,
qknorm) at their reduced (--quick) size: each must still show what it claims, with the numbers
its table prints. They train the library's own GPT with the switch turned, so a switch that
breaks (rotary past the trained context, the grouped KV cache, QK-norm) fails here.
No test reads a timing: decoding speed is shown by `kvheads`, never asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import quick_experiment
from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.experiments.kvheads import cache_bytes_per_token
from glassgpt.experiments.mlps import equal_parameter_hidden
from glassgpt.experiments.norms import count_operations
from glassgpt.experiments.qknorm import largest_logit
from glassgpt.experiments.results import ExperimentResult
from glassgpt.model import GPT
from glassgpt.norms import ManualLayerNorm, RMSNorm

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_quick(name: str, out_dir: Path) -> ExperimentResult:
    result = quick_experiment(name, out_dir)
    assert result.name == name
    assert [p.read_bytes()[:8] for p in result.pictures] == [PNG_MAGIC]
    failed = [check.claim for check in result.checks if not check.holds]
    assert not failed, f"{name}: expected outcomes not shown: {failed}"
    return result


def tiny_gpt(n_layer: int = 2, **switches) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=n_layer, n_head=4, n_embd=16,
                         **switches))


def test_positions_rotary_and_none_read_past_the_trained_context(tmp_path: Path) -> None:
    result = run_quick("positions", tmp_path)
    n = result.numbers
    T, T2 = n["block_size"], n["long_length"]
    assert T2 == 2 * T
    assert not n["learned"]["long_runs"]
    assert f"longer than block_size={T}" in n["learned"]["long_refusal"]
    assert n["learned"]["long_loss_per_position"] is None
    for position in ("rope", "none"):
        losses = n[position]["long_loss_per_position"]
        assert len(losses) == T2 and all(0 < loss < 5 for loss in losses)
    # Only the learned table holds parameters for positions: T rows of width C.
    assert n["learned"]["parameters"] - n["rope"]["parameters"] == T * 64
    assert n["rope"]["parameters"] == n["none"]["parameters"]
    table = result.tables[0]
    assert table.rows[0][-1] == f"no: the table has {T} rows"
    assert table.rows[0][3] is None and table.rows[1][4] == n["rope"]["long_loss_beyond"]


def test_norms_count_operations_and_match_within_noise(tmp_path: Path) -> None:
    result = run_quick("norms", tmp_path)
    counts = result.numbers["counts"]
    assert counts["layernorm"]["operations"] == ["mean", "var", "sub", "add", "sqrt", "div",
                                                 "mul", "add"]
    assert counts["rmsnorm"]["operations"] == ["pow", "mean", "add", "rsqrt", "mul", "mul"]
    assert counts["layernorm"]["reductions"] == ["mean", "var"]
    assert counts["rmsnorm"]["reductions"] == ["mean"]
    assert result.numbers["gap"] <= result.numbers["noise"]
    assert len(result.numbers["rmsnorm"]["val_loss"]) == len(result.numbers["seeds"]) >= 2


def test_operation_counter_records_what_a_module_computes() -> None:
    # A LayerNorm without its shift makes one operation fewer; the recorder sees it.
    assert len(count_operations(ManualLayerNorm(8, bias=False), 8)["operations"]) == 7
    rms = count_operations(RMSNorm(8), 8)
    assert rms["per position"] == ["add", "rsqrt"] and rms["parameters"] == 8


def test_mlps_hold_equal_parameters_and_start_at_different_sizes(tmp_path: Path) -> None:
    result = run_quick("mlps", tmp_path)
    n = result.numbers
    C = n["width"]
    assert [n[a]["mlp_hidden"] for a in ("gelu", "swiglu", "relu2")] == [4 * C, 8 * C // 3, 4 * C]
    assert {n[a]["mlp_parameters"] for a in ("gelu", "swiglu", "relu2")} == {8 * C * C}
    assert len({n[a]["parameters"] for a in ("gelu", "swiglu", "relu2")}) == 1
    assert n["swiglu"]["output_rms_at_init"] < n["relu2"]["output_rms_at_init"] \
        < n["gelu"]["output_rms_at_init"]


def test_swiglu_hidden_width_must_be_whole() -> None:
    assert equal_parameter_hidden("swiglu", 96) == 256
    assert equal_parameter_hidden("relu2", 64) == 256
    with pytest.raises(ConfigError, match="width C=64 is not a multiple of 3"):
        equal_parameter_hidden("swiglu", 64)


def test_kvheads_cache_shrinks_by_the_group_size(tmp_path: Path) -> None:
    result = run_quick("kvheads", tmp_path)
    n = result.numbers
    L, d = n["n_layer"], n["head_dim"]
    assert [n[str(kv)]["cache_bytes_per_token"] for kv in (4, 2, 1)] == \
        [2 * L * kv * d * 4 for kv in (4, 2, 1)]
    # Fewer K and V rows in qkv: each KV head dropped saves 2 * d * (C + 1) per layer.
    C = 4 * d
    assert n["4"]["parameters"] - n["1"]["parameters"] == L * 3 * 2 * d * (C + 1)
    assert n["1"]["val_loss"] - n["4"]["val_loss"] <= 0.05


def test_cache_bytes_are_read_off_the_real_cache() -> None:
    model = tiny_gpt(n_kv_head=2)
    assert cache_bytes_per_token(model) == 2 * 2 * 2 * 4 * 4  # K and V, L, H_kv, d, float32
    assert all(block.attn.kv_cache is None for block in model.blocks)  # removed again
    assert cache_bytes_per_token(model.double()) == 2 * 2 * 2 * 4 * 8


def test_qknorm_keeps_the_largest_logit_small(tmp_path: Path) -> None:
    result = run_quick("qknorm", tmp_path)
    plain = result.numbers["without QK-norm"]
    normed = result.numbers["with QK-norm"]
    assert plain["largest_logit"] > 3 * normed["largest_logit"]
    assert normed["val_loss"] < plain["val_loss"]
    assert plain["logit_steps"][0] == 0 and plain["largest_logits"][0] < 1.0


def test_largest_logit_reads_the_q_the_model_uses() -> None:
    # One layer without biases: doubling the query rows of qkv doubles every logit.
    model = tiny_gpt(n_layer=1, bias=False)
    idx = torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(1))
    before = largest_logit(model, idx)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:16] *= 2
    assert largest_logit(model, idx) == pytest.approx(2 * before, rel=1e-5)
    # QK-norm divides the doubling out again.
    normed = tiny_gpt(n_layer=1, bias=False, qk_norm=True, norm_eps=1e-12)
    before = largest_logit(normed, idx)
    with torch.no_grad():
        for block in normed.blocks:
            block.attn.qkv.weight[:16] *= 2
    assert largest_logit(normed, idx) == pytest.approx(before, rel=1e-4)
