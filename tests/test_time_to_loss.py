"""What a time-to-loss run spends outside its steps: an evaluation commits only where something
changed (a new best, the end, a new run's first), and loss.png is drawn once, as the run returns;
a crash loses at most the steps since the last commit, and resuming from it stays bitwise."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from conftest import TINY_GPT
from glassgpt.config import TrainConfig
from glassgpt.data import PreparedData, prepare
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.rundir.checkpoint import load_train_state
from glassgpt.training import trainer as trainer_module
from glassgpt.training.metrics import read_metrics
from glassgpt.training.runs import build_model
from glassgpt.training.trainer import Trainer

TINY = {k: v for k, v in TINY_GPT.items() if k != "vocab_size"}
# The val loss each evaluation reports, by iteration: new bests at 0, 2 and 8 only.
SCRIPTED_VAL = {0: 3.0, 2: 2.0, 4: 2.5, 6: 2.2, 8: 1.9}


@pytest.fixture()
def data(tmp_path, small_text) -> PreparedData:
    prepare(tmp_path / "data", small_text)
    return PreparedData(tmp_path / "data")


def tiny_trainer(data, run_dir, stop: threading.Event | None = None,
                 threads: int | str = 1) -> Trainer:
    cfg = TrainConfig(max_iters=8, batch_size=4, eval_interval=2, eval_iters=1,
                      log_interval=1, warmup_iters=2, lr=3e-3, seed=5)
    model = build_model(TINY, data.vocab_size, seed=cfg.seed)
    return Trainer(model, cfg, data, run_dir, threads=threads, stop=stop)


@pytest.fixture()
def scripted(monkeypatch) -> dict:
    """Evaluations report SCRIPTED_VAL for the iteration of the trainer in `holder`; commits
    and drawings are recorded (by iteration) and still happen."""
    holder: dict = {"commits": [], "drawings": []}

    def scripted_loss(*args, **kwargs):
        value = torch.tensor(SCRIPTED_VAL[holder["trainer"].state.iteration])
        return {"train": value, "val": value}

    real_save, real_plot = ckpt.save_checkpoint, trainer_module.plot_losses

    def save(run_dir, model, tokenizer, train_config, data_dir, state, **kwargs):
        holder["commits"].append((state.iteration, kwargs.get("best", False)))
        real_save(run_dir, model, tokenizer, train_config, data_dir, state, **kwargs)

    def plot(run_dir):
        holder["drawings"].append(holder["trainer"].state.iteration)
        real_plot(run_dir)

    monkeypatch.setattr(trainer_module, "estimate_loss", scripted_loss)
    monkeypatch.setattr(ckpt, "save_checkpoint", save)
    monkeypatch.setattr(trainer_module, "plot_losses", plot)
    return holder


def test_only_new_bests_and_the_end_commit_and_the_picture_is_drawn_once(tmp_path, data,
                                                                         scripted):
    scripted["trainer"] = trainer = tiny_trainer(data, tmp_path / "run")
    result = trainer.run()
    # 4 and 6 are no better than 2: they write their metrics line and nothing else.
    assert scripted["commits"] == [(0, True), (2, True), (8, True)]
    assert scripted["drawings"] == [8]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    assert result.best_iteration == 8 and load_train_state(tmp_path / "run").iteration == 8
    evaluated = [r["iter"] for r in read_metrics(tmp_path / "run")
                 if "val_loss" in r]
    assert evaluated == [0, 2, 4, 6, 8]


def test_a_stop_after_an_uncommitted_evaluation_saves_where_it_came(tmp_path, data, scripted,
                                                                    monkeypatch):
    stop, steps, real_step = threading.Event(), [], trainer_module.train_step

    def step(*args, **kwargs):
        steps.append(1)
        if len(steps) == 5:  # Ctrl-C during step 5, after the evaluation at 4 (not a best)
            stop.set()
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_step", step)
    scripted["trainer"] = trainer = tiny_trainer(data, tmp_path / "run", stop)
    result = trainer.run()
    assert result.interrupted and result.iteration == 5
    assert scripted["commits"] == [(0, True), (2, True), (5, False)]
    assert scripted["drawings"] == [5]
    assert load_train_state(tmp_path / "run").iteration == 5


def test_a_crash_loses_the_steps_since_the_last_best_and_resuming_is_bitwise(tmp_path, data,
                                                                            scripted,
                                                                            monkeypatch):
    scripted["trainer"] = whole = tiny_trainer(data, tmp_path / "whole")
    whole.run()
    steps, real_step = [], trainer_module.train_step

    def crashing_step(*args, **kwargs):
        steps.append(1)
        if len(steps) == 7:
            raise RuntimeError("the machine went away")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_step", crashing_step)
    scripted["trainer"] = crashed = tiny_trainer(data, tmp_path / "split")
    with pytest.raises(RuntimeError, match="went away"):
        crashed.run()
    # The last commit was the best at 2: the evaluations at 4 and 6 wrote none.
    assert load_train_state(tmp_path / "split").iteration == 2
    monkeypatch.setattr(trainer_module, "train_step", real_step)
    torch.manual_seed(999)  # the resumed run must not depend on what ran before it
    scripted["trainer"] = resumed = tiny_trainer(data, tmp_path / "split")
    resumed.resume()
    resumed.run()
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    losses = [[r["loss"] for r in read_metrics(tmp_path / d) if "loss" in r]
              for d in ("whole", "split")]
    assert len(losses[0]) == 8 and losses[0] == losses[1]


def test_the_bf16_rungs_are_skipped_on_a_cpu_without_bf16_instructions(monkeypatch):
    from glassgpt.bench import ladder

    def no_training(*args, **kwargs):
        raise AssertionError("a bf16 rung trained on a CPU without bf16")

    monkeypatch.setattr(ladder, "cpu_bf16_support", lambda: False)
    monkeypatch.setattr(ladder, "train_rung", no_training)
    report = ladder.run_ladder(None, only=list(ladder.BF16_RUNGS))
    assert [r.name for r in report.rungs] == ["bf16", "short-cosine"]
    assert all("no bf16 matrix instructions" in r.skipped for r in report.rungs)
    assert ladder.ladder_rungs()[-1].train["dtype"] == "bfloat16"


def test_the_first_evaluation_runs_at_one_thread_until_the_tuner_has_timed(tmp_path, data,
                                                                           scripted,
                                                                           monkeypatch):
    """With threads "auto", the evaluation at step 0 runs at one thread, as the first steps
    do: at all cores it took 11-22 s instead of 1-1.6 s on this shared 2-core machine."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # else "auto" keeps the user's count
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    seen, scripted_loss = [], trainer_module.estimate_loss

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return scripted_loss(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "estimate_loss", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        scripted["trainer"] = trainer = tiny_trainer(data, tmp_path / "run", threads="auto")
        trainer.run()
    finally:
        torch.set_num_threads(before)
    assert seen[0] == 1 and len(seen) == 5


@pytest.mark.parametrize("compile_steps", [True, False])
def test_a_compiled_run_probes_thread_counts_past_their_compilation(tmp_path, data, monkeypatch,
                                                                   compile_steps):
    """Each thread count is a graph of its own under torch.compile (dynamo guards on it), so
    "auto" leaves each count's first step, its compilation, out of the timing; measured on a
    Zen 3: with it timed, two threads lost every probe to a 33 s compile."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cfg = TrainConfig(max_iters=2, batch_size=4, eval_iters=1, compile=compile_steps)
    model = build_model(TINY, data.vocab_size, seed=cfg.seed)
    trainer = Trainer(model, cfg, data, tmp_path / "run", threads="auto")
    assert trainer.threads is not None and trainer.threads.warm_up_each is compile_steps
