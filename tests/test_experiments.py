"""The experiments at their reduced (--quick) size: each must still show its expected outcome.

These run the library's own modules, so a regression in attention, the block, LayerNorm or the
model's construction shows up here as an experiment that no longer demonstrates its point.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import quick_experiment
from glassgpt.errors import ConfigError
from glassgpt.experiments import EXPERIMENTS, run_experiment
from glassgpt.experiments.multihead import weight_per_offset
from glassgpt.experiments.results import ExperimentResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_quick(name: str, out_dir: Path, seed: int = 0, **options) -> ExperimentResult:
    result = quick_experiment(name, out_dir, seed=seed, **options)
    assert result.name == name
    assert result.pictures, f"{name} drew no picture"
    for picture in result.pictures:
        assert picture.parent == out_dir
        assert picture.read_bytes()[:8] == PNG_MAGIC
    failed = [check.claim for check in result.checks if not check.holds]
    assert not failed, f"{name}: expected outcomes not shown: {failed}"
    return result


def test_shapes_walk_matches_module_and_records_each_shape(tmp_path: Path) -> None:
    result = run_quick("shapes", tmp_path, batch_size=2, seq_len=5, d_model=24, n_heads=3)
    shapes = result.numbers["shapes"]
    assert shapes["project to Q, K, V"] == [2, 5, 72]
    assert shapes["split Q | K | V"] == [2, 5, 24]
    assert shapes["heads become batch"] == [2, 3, 5, 8]
    assert shapes["softmax over keys"] == [2, 3, 5, 5]
    assert shapes["merge heads"] == [2, 5, 24]
    assert max(result.numbers["max_diff"].values()) <= 1e-6


def test_shapes_rejects_width_not_divisible_by_heads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="d_model=10 is not divisible by n_heads=4"):
        run_experiment("shapes", tmp_path, d_model=10, n_heads=4)


@pytest.mark.slow
def test_parity_every_reference_agrees_in_float64(tmp_path: Path) -> None:
    result = run_quick("parity", tmp_path)
    for mask in ("causal", "bidirectional"):
        diffs = result.numbers[mask]
        assert set(diffs) == {"per-head loop (ModuleList + cat)",
                              "fused path (scaled_dot_product_attention)",
                              "nn.MultiheadAttention"}
        for output_diff, weights_diff in diffs.values():
            assert output_diff <= 1e-12
            assert weights_diff is None or weights_diff <= 1e-12


@pytest.mark.slow
def test_multihead_one_head_fails_a_target_and_three_heads_solve_all(tmp_path: Path) -> None:
    result = run_quick("multihead", tmp_path)
    worst = result.numbers["worst_target"]
    assert len(worst["1"]) >= 2  # every seed is checked, not an average
    assert all(w < 0.5 for w in worst["1"]), worst["1"]
    assert all(w > 0.9 for w in worst["3"]), worst["3"]
    assert all(w > 0.9 for w in worst["6"]), worst["6"]
    assert len(set(result.numbers["parameters"].values())) == 1
    assert sorted(result.numbers["dominant_offset"]["3"]) == [1, 2, 4]
    # The table and the check line print the same per-seed numbers.
    accuracy, where = result.tables
    one_head = next(row for row in accuracy.rows if row[0] == 1)
    per_seed = one_head[accuracy.columns.index("worst target, each seed")]
    assert per_seed == ", ".join(f"{w:.1%}" for w in worst["1"])
    assert any(per_seed in check.claim and check.claim.startswith("1 head")
               for check in result.checks)
    # Every head's shares of attention over offsets t-0 .. t-4 and further back sum to 1.
    shares = [name for name in where.columns if name.startswith("w t-")]
    assert shares == ["w t-0", "w t-1", "w t-2", "w t-3", "w t-4", "w t-5.."]
    for row in where.rows:
        assert abs(sum(row[where.columns.index(name)] for name in shares) - 1.0) < 1e-5


def test_weight_per_offset_averages_every_offset_over_the_same_queries() -> None:
    # Head 0 always looks 1 back; head 1 spreads evenly over every key it can see.
    T = 6
    one_back = torch.zeros(T, T)
    one_back[0, 0] = 1.0
    for t in range(1, T):
        one_back[t, t - 1] = 1.0
    even = torch.ones(T, T).tril()
    even = even / even.sum(dim=-1, keepdim=True)
    shares = weight_per_offset(torch.stack([one_back, even]).unsqueeze(0), max_offset=2)
    # Queries t = 2..5 only: head 0 puts everything on t-1; head 1 gives each of its t+1 keys
    # 1/(t+1), so t-0, t-1, t-2 each get mean(1/3, 1/4, 1/5, 1/6) and the rest goes further.
    assert torch.allclose(shares[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    each = (1 / 3 + 1 / 4 + 1 / 5 + 1 / 6) / 4
    assert torch.allclose(shares[1], torch.tensor([each, each, each, 1 - 3 * each]))


def test_layernorm_manual_matches_and_sequence_norm_leaks(tmp_path: Path) -> None:
    result = run_quick("layernorm", tmp_path)
    numbers = result.numbers
    assert numbers["mean"] == 5.0 and numbers["variance"] == 5.0  # population variance
    assert numbers["manual_vs_torch"] <= 1e-12
    assert numbers["scale_rows_diff"] <= 1e-4
    assert max(numbers["leak_per_position"]) == 0.0
    assert max(numbers["leak_over_sequence"]) > 1e-3


def test_params_formula_and_gpt2_small_total(tmp_path: Path) -> None:
    result = run_quick("params", tmp_path)
    for width, counts in result.numbers["block"].items():
        C = int(width)
        assert counts["counted"] == counts["formula"] == 12 * C * C + 13 * C
    assert result.numbers["gpt2_small_total"] == 124_439_808
    assert 0.30 < result.numbers["embedding_share"] < 0.33


@pytest.mark.slow
def test_residual_collapse_without_skips_and_learning_with_them(tmp_path: Path) -> None:
    result = run_quick("residual", tmp_path)
    chance = math.log(10)
    no_residual = result.numbers["Pre-LN, no residual"]
    assert no_residual["collapse_at_init"] > 0.9
    assert no_residual["loss_last"] > 2.0
    for name in ("Pre-LN + residual", "Post-LN + residual"):
        assert result.numbers[name]["collapse_at_init"] < 0.6
        assert result.numbers[name]["loss_last"] < chance / 2
        assert result.numbers[name]["accuracy"] > 0.9


def test_the_residual_free_block_lives_in_its_experiment_and_drops_both_skips() -> None:
    from glassgpt.block import TransformerBlock
    from glassgpt.experiments.residual import ResidualFreeBlock
    torch.manual_seed(0)
    block = ResidualFreeBlock(16, 4).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    expected = block.ffn(block.ln2(block.attn(block.ln1(x))))
    assert (block(x) - expected).abs().max() <= 1e-12
    torch.manual_seed(0)
    with_skips = TransformerBlock(16, 4).double()  # the same parts, the same initial weights
    for a, b in zip(with_skips.state_dict().values(), block.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(TypeError):
        TransformerBlock(16, 4, residual=False)  # the library's block always has its skips


def test_dropout_modes_and_fused_path(tmp_path: Path) -> None:
    result = run_quick("dropout", tmp_path)
    modes = result.numbers["modes"]
    assert modes["train()"]["dropout_active"] and modes["train() + no_grad"]["dropout_active"]
    assert not modes["eval()"]["dropout_active"] and not modes["eval() + no_grad"]["dropout_active"]
    assert modes["train()"]["row_sum_max"] > 1.0 + 1e-3
    assert abs(modes["eval()"]["row_sum_max"] - 1.0) < 1e-5
    fused = result.numbers["fused"]
    assert fused["fused, eval()"] <= 1e-6 < fused["fused, train()"]
    assert fused["BUG: SDPA with dropout_p=p in eval()"] > 1e-3


def test_sharing_counts_and_updates(tmp_path: Path) -> None:
    result = run_quick("sharing", tmp_path)
    per_block = result.numbers["per_block"]
    shared = result.numbers["[block] * L (shared)"]
    independent = result.numbers["L independent blocks"]
    assert shared["parameters"] == per_block and shared["distinct_blocks"] == 1
    assert independent["parameters"] == 4 * per_block and independent["distinct_blocks"] == 4
    assert shared["layers_changed"] == [True] * 4
    assert independent["layers_changed"] == [True, False, False, False]
    # The state_dict lists 4 blocks' worth of names either way; only 12 tensors are distinct.
    assert shared["state_dict_entries"] == independent["state_dict_entries"] == 48
    assert shared["distinct_tensors"] == 12 and independent["distinct_tensors"] == 48


def test_same_seed_gives_the_same_numbers(tmp_path: Path) -> None:
    first = run_experiment("dropout", tmp_path / "a", seed=3, quick=True)
    second = run_experiment("dropout", tmp_path / "b", seed=3, quick=True)
    assert first.numbers == second.numbers


def test_unknown_experiment_and_option_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown experiment 'nope'"):
        run_experiment("nope", tmp_path)
    with pytest.raises(ConfigError, match="takes no option"):
        run_experiment("params", tmp_path, d_model=32)
    assert list(EXPERIMENTS) == ["shapes", "parity", "multihead", "layernorm", "params",
                                 "residual", "dropout", "sharing", "positions", "norms", "mlps",
                                 "kvheads", "qknorm", "induction", "windows",
                                 "features"]
