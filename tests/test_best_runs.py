"""Runs a user can trust: the best weights kept beside the last, an evaluation at step 0, an
early stop, a summary that says what happened, threads that fit the machine, bf16 only where
it pays, and fine-tuning settings from a config file."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glassgpt.cli import main
from glassgpt.data import prepare
from glassgpt.machine import devices
from glassgpt.rundir.checkpoint import load_model
from glassgpt.training.metrics import best_evaluation, read_metrics

SHAPE = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
         "--batch-size", "8", "--eval-iters", "4", "--log-interval", "1", "--lr", "3e-2",
         "--warmup-iters", "0", "--dropout", "0", "--device", "cpu"]
TINY = [*SHAPE, "--threads", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Train on "abab...", validate on "aaaa...": as the model learns that b follows a, its
    val loss falls at first (it learns the alphabet) and then rises, so the best weights are
    an early checkpoint and the last ones are worse."""
    root = tmp_path_factory.mktemp("best")
    (root / "text.txt").write_text("ab" * 900 + "a" * 200)
    prepare(root / "data", root / "text.txt", val_fraction=0.1)
    return root / "data"


def run_main(capsys, *argv: object) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "run"
    assert main([str(a) for a in ("train", "--data", data, "--out", run, "--max-iters", "24",
                                  "--eval-interval", "4", *TINY)]) == 0
    return run


def test_the_best_evaluation_is_kept_and_named(trained):
    state = json.loads((trained / "train_state.json").read_text())
    evals = [r for r in read_metrics(trained) if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 4, 8, 12, 16, 20, 24]  # step 0 too, as nanoGPT
    best = best_evaluation(read_metrics(trained))
    assert state["best_iteration"] == best["iter"] < 24  # the val loss rose after it
    assert state["best_val_loss"] == best["val_loss"] < evals[-1]["val_loss"]
    best_weights = load_file(trained / "best.safetensors")
    last_weights = load_file(trained / "model.safetensors")
    assert not torch.equal(best_weights["tok_emb.weight"], last_weights["tok_emb.weight"])


def test_sample_eval_and_init_from_take_the_best_weights_and_say_so(trained, capsys):
    best, _ = load_model(trained)
    last, _ = load_model(trained, checkpoint="last")
    expected = load_file(trained / "best.safetensors")["tok_emb.weight"]
    assert torch.equal(best.tok_emb.weight, expected)
    assert not torch.equal(last.tok_emb.weight, expected)
    state = json.loads((trained / "train_state.json").read_text())
    code, _, err = run_main(capsys, "sample", trained, "--prompt", "ab", "--max-new-tokens", "4",
                            "--threads", "1")
    assert code == 0
    assert (f"sampling from the best weights (val loss {state['best_val_loss']:.4f} at "
            f"iteration {state['best_iteration']})") in err
    losses = {}
    for checkpoint in ("best", "last"):
        code, out, _ = run_main(capsys, "eval", trained, "--checkpoint", checkpoint, "--json",
                                "--threads", "1")
        losses[checkpoint] = json.loads(out)["loss"]
    assert losses["best"] < losses["last"]  # on the whole val split too


def test_resume_continues_from_the_last_checkpoint(trained, tmp_path, capsys):
    run = shutil.copytree(trained, tmp_path / "run")
    code, out, err = run_main(capsys, "train", "--resume", "--out", run, "--max-iters", "28",
                              "--threads", "1")
    assert code == 0
    assert "resuming at iteration 24 of 28" in err
    assert "trained 4 iterations (24 -> 28)" in out  # not "28 iterations"
    assert "best val loss" in out


def test_early_stop_ends_after_evaluations_without_improvement(data, tmp_path, capsys):
    code, out, _ = run_main(capsys, "train", "--data", data, "--out", tmp_path / "run",
                            "--max-iters", "400", "--eval-interval", "4", "--early-stop", "2",
                            *TINY)
    assert code == 0 and "early stop" in out
    state = json.loads((tmp_path / "run" / "train_state.json").read_text())
    assert state["iteration"] == state["best_iteration"] + 2 * 4 < 400


def test_the_loss_picture_marks_the_best_evaluation():
    records = [{"iter": 0, "val_loss": 0.1}, {"iter": 4, "val_loss": 2.0},
               {"iter": 8, "val_loss": 1.5}, {"iter": 12, "val_loss": 1.7},
               {"iter": 9, "loss": 0.3}]
    assert best_evaluation(records) == {"iter": 8, "val_loss": 1.5}  # step 0 keeps no weights
    assert best_evaluation([{"iter": 0, "val_loss": 1.0}]) is None


def test_a_config_file_dropout_reaches_a_fine_tune(trained, tmp_path, capsys):
    config = tmp_path / "finetune.toml"
    config.write_text("[model]\ndropout = 0.25\n[train]\nmax_iters = 1\n")
    data_dir = json.loads((trained / "config.json").read_text())["data_dir"]
    code, _, err = run_main(capsys, "train", "--init-from", trained, "--config", config,
                            "--data", data_dir, "--out", tmp_path / "tuned", "--device", "cpu",
                            "--threads", "1", "--eval-iters", "2", "--batch-size", "4")
    assert code == 0, err
    assert "from the best weights" in err
    tuned = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert tuned["model"]["dropout"] == 0.25


@pytest.mark.slow
def test_threads_auto_times_the_first_steps_and_uses_the_faster(data, tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the user chose nothing
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 2)
    chosen = []
    real_choose = devices.ThreadTuner._choose

    def spy(self):
        real_choose(self)
        chosen.append((self.threads, dict(self._timings)))

    monkeypatch.setattr(devices.ThreadTuner, "_choose", spy)
    before = torch.get_num_threads()
    try:
        code, out, err = run_main(capsys, "train", "--data", data, "--out", tmp_path / "run",
                                  "--max-iters", "12", "--eval-interval", "12", *SHAPE,
                                  "--threads", "auto")
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert code == 0
    assert "threads auto (1 or 2, chosen by timing the first steps)" in err
    assert f"on {used} CPU thread" in out and "(chosen by timing)" in out
    (threads, timings), = chosen
    assert set(timings) == {1, 2} and len(timings[1]) == 3
    # Two threads are probed three times too, unless a step of theirs took over three times one
    # thread's median (another process held a core): then the tuner drops the rest of them.
    assert 1 <= len(timings[2]) <= 3
    if len(timings[2]) < 3:
        assert timings[2][-1] > 3 * statistics.median(timings[1])
    fastest = min(timings, key=lambda n: statistics.median(timings[n]))
    assert threads == fastest == used


def test_omp_num_threads_set_by_the_user_wins_over_auto(monkeypatch):
    thread_tuner = devices.tuner_for
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert thread_tuner("auto", torch.device("cpu")) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 2)
    assert thread_tuner("auto", torch.device("cpu")) is not None
    assert thread_tuner("auto", torch.device("meta")) is None  # nothing to tune off the CPU


def test_bf16_on_a_cpu_without_bf16_instructions_is_a_warning_with_the_measured_cost(
        trained, capsys, monkeypatch):
    monkeypatch.setattr(devices, "cpu_bf16_support", lambda: False)
    monkeypatch.setattr(devices, "bf16_slowdown", lambda: 12.7)
    code, _, err = run_main(capsys, "sample", trained, "--prompt", "ab", "--max-new-tokens",
                            "2", "--dtype", "bfloat16", "--threads", "1")
    assert code == 0
    assert ("warning: this CPU has no bf16 matrix instructions (avx512_bf16/amx_bf16): a bf16 "
            "matmul measured 12.7x slower than float32 here; use --dtype float32") in err
    monkeypatch.setattr(devices, "cpu_bf16_support", lambda: True)
    assert devices.bf16_warning(torch.device("cpu")) is None
    assert devices.autocast_dtype("auto", torch.device("cpu")) is None  # auto never picks it
