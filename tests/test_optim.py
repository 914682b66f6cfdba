"""The schedules (cosine, warmup-stable-decay), the optimizer choice and the target-loss stop."""

from __future__ import annotations

import pytest

from glassgpt.config import TrainConfig
from glassgpt.data import PreparedData, prepare
from glassgpt.errors import ConfigError
from glassgpt.training.metrics import read_metrics
from glassgpt.training.optim import lr_at
from glassgpt.training.runs import build_model
from glassgpt.training.trainer import Trainer

TINY = dict(block_size=16, n_layer=1, n_head=2, n_embd=16)


def test_wsd_warms_up_holds_the_peak_then_decays_linearly_to_the_floor():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_iters=10, max_iters=110, schedule="wsd",
                      decay_fraction=0.2)
    assert lr_at(4, cfg) == pytest.approx(5 / 11)  # the same warmup as cosine
    assert lr_at(10, cfg) == lr_at(50, cfg) == lr_at(90, cfg) == 1.0  # stable
    assert lr_at(100, cfg) == pytest.approx(0.55)  # half way down the last 20 steps
    assert lr_at(110, cfg) == lr_at(300, cfg) == pytest.approx(0.1)
    values = [lr_at(i, cfg) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert lr_at(60, TrainConfig(lr=1.0, min_lr=0.0, warmup_iters=0, max_iters=100,
                                 schedule="wsd", decay_fraction=1.0)) == pytest.approx(0.4)


def test_schedule_and_optimizer_settings_are_checked():
    for bad, match in ((dict(schedule="linear"), "unknown schedule"),
                       (dict(decay_fraction=0.0), "decay_fraction"),
                       (dict(muon_lr=0.0), "muon_lr"),
                       (dict(muon_momentum=1.0), "muon_momentum"),
                       (dict(target_loss="low"), "target_loss")):
        with pytest.raises(ConfigError, match=match):
            TrainConfig(**bad)


def test_target_loss_stops_at_the_first_evaluation_that_reaches_it(tmp_path, small_text):
    prepare(tmp_path / "data", small_text)
    data = PreparedData(tmp_path / "data")
    cfg = TrainConfig(max_iters=6, batch_size=4, eval_interval=3, eval_iters=2,
                      log_interval=1, warmup_iters=0, lr=1e-2, seed=3, target_loss=1e-9)
    never = Trainer(build_model(TINY, data.vocab_size, cfg.seed), cfg, data,
                    tmp_path / "never").run()
    assert not never.target_reached and never.target_iteration is None
    assert never.iteration == 6
    val = {r["iter"]: r["val_loss"] for r in read_metrics(tmp_path / "never") if "val_loss" in r}
    assert val[3] < val[0]
    # The same run (same seed), with a target between the losses at steps 0 and 3.
    reached = TrainConfig(**{**cfg.to_dict(), "target_loss": (val[0] + val[3]) / 2})
    result = Trainer(build_model(TINY, data.vocab_size, cfg.seed), reached, data,
                     tmp_path / "r").run()
    assert result.target_reached and result.target_iteration == result.iteration == 3
    assert 0 < result.target_seconds <= result.seconds
    evals = [r["iter"] for r in read_metrics(tmp_path / "r") if "val_loss" in r]
    assert evals == [0, 3]  # the start, then the first evaluation: at or below the target
    # A target the step-0 evaluation meets already stops there, before any step.
    met = TrainConfig(**{**cfg.to_dict(), "target_loss": 1e9})
    at_start = Trainer(build_model(TINY, data.vocab_size, cfg.seed), met, data,
                       tmp_path / "met").run()
    assert at_start.target_iteration == at_start.iteration == 0
