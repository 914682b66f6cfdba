"""`glassgpt demo windows` at its --quick size: the receptive field of all-local layers ends at
exactly L * (W - 1), one global layer reaches every position and solves what all-local cannot,
and the KV-cache bytes follow from the config (glassgpt's own cache keeping every position).
Plus the pieces on their own: the gradient's exact zeros, the cache formula at Gemma 3's shape.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import quick_experiment
from glassgpt.config import GPTConfig
from glassgpt.experiments import EXPERIMENTS, ExperimentResult
from glassgpt.experiments.windows import (
    QUICK,
    cache_bytes,
    glassgpt_cache_bytes,
    input_gradient,
    local_presets,
    preset_caches,
)
from glassgpt.model import GPT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> ExperimentResult:
    return quick_experiment("windows", tmp_path_factory.mktemp("windows"))


def test_the_quick_demo_shows_what_it_claims(result: ExperimentResult) -> None:
    failed = [check.claim for check in result.checks if not check.holds]
    assert not failed, failed
    assert "windows" in EXPERIMENTS and len(result.checks) == 5
    assert [p.name for p in result.pictures] == ["windows.png"]
    assert result.pictures[0].read_bytes()[:8] == PNG_MAGIC
    json.dumps(result.to_dict())  # the --json file


def test_the_numbers_are_measured_in_the_run(result: ExperimentResult) -> None:
    n = result.numbers
    reach, T = QUICK.n_layer * (QUICK.window - 1), QUICK.seq_len
    assert n["local_reach"] == reach
    local = n["receptive_field"]["all local"]
    assert local["reach"] == reach and local["zeros"] == T - reach - 1
    assert all(g == 0 for g in local["gradient"][reach + 1:])
    assert all(g > 0 for g in local["gradient"][:reach + 1])
    assert all(g > 0 for g in n["receptive_field"]["last layer global"]["gradient"])
    assert len(n["accuracy"]["all local"]) == len(n["accuracy"]["last layer global"]) == T
    far_local = n["accuracy"]["all local"][reach + 1:]
    far_global = n["accuracy"]["last layer global"][reach + 1:]
    assert sum(far_global) > sum(far_local) + 0.5 * len(far_local)


def test_the_cache_table_says_glassgpt_keeps_every_position(result: ExperimentResult) -> None:
    cache = result.numbers["cache"]
    per_position = 2 * QUICK.n_embd * 4  # K and V, H_kv x d = C, float32
    L, W = QUICK.n_layer, QUICK.window
    for n, full, windowed in zip(cache["contexts"], cache["all_global"], cache["windowed"],
                                 strict=True):
        assert full == L * n * per_position
        assert windowed == ((L - 1) * min(n, W) + n) * per_position
    assert cache["glassgpt_allocates"] == L * QUICK.seq_len * per_position
    title = result.tables[1].title
    assert "glassgpt's KVCache keeps every position" in title
    assert "which glassgpt does not have" in title


def test_all_local_layers_see_exactly_l_times_w_minus_1_back() -> None:
    config = GPTConfig(vocab_size=11, block_size=12, n_layer=3, n_head=2, n_embd=16,
                       position="rope", sliding_window=2)  # reach 3
    idx = torch.randint(11, (1, 12))
    grad = input_gradient(GPT(config), idx)  # (T,), position order
    assert torch.all(grad[:8] == 0) and torch.all(grad[8:] > 0)
    mixed = dataclasses.replace(config, local_layers=(0, 2))  # layer 1 global
    assert torch.all(input_gradient(GPT(mixed), idx) > 0)


def test_the_cache_formula_at_gemma_3s_pattern_and_glassgpts_buffers() -> None:
    gemma = GPTConfig(vocab_size=16, block_size=64, n_layer=6, n_head=4, n_kv_head=1,
                      n_embd=32, head_dim=16, position="rope", sliding_window=8,
                      local_layers=(0, 1, 2, 3, 4))  # five local, one global
    per_position = 2 * 16 * 2  # one K/V head of width 16, bfloat16
    assert cache_bytes(gemma, 64, windowed=False, dtype_bytes=2) == 6 * 64 * per_position
    assert cache_bytes(gemma, 64, windowed=True, dtype_bytes=2) == (5 * 8 + 64) * per_position
    assert cache_bytes(gemma, 4, windowed=True, dtype_bytes=2) == 6 * 4 * per_position
    assert glassgpt_cache_bytes(GPT(gemma)) == cache_bytes(gemma, 64, windowed=False)
    found = preset_caches({"tiny-gemma": gemma})["tiny-gemma"]
    assert (found["local_layers"], found["n_layer"], found["window"]) == (5, 6, 8)
    assert found["all_global"] / found["windowed"] == pytest.approx(6 * 64 / (5 * 8 + 64))
    assert all(config.sliding_window is not None for config in local_presets().values())
