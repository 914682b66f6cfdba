"""The training surfaces of issue 27's hostile round, each answered cleanly.

`--force` replaces only what glassgpt wrote (a Hugging Face directory is not a run); a signal
stops an evaluation within a batch; work that cannot finish and rates that only overflow are
refused up front; a target already met at step 0 stops there; Muon settings without Muon are
refused; `train_run` checks every argument before it writes and words its messages for Python;
`glassgpt eval` says what it does before doing it. Everything runs in this process, on tiny
models.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from glassgpt.data import prepare
from glassgpt.errors import ConfigError, GlassGPTError
from glassgpt.rundir.checkpoint import load_model, load_train_state
from glassgpt.training.lifecycle import summary_line, train_run
from glassgpt.training.runs import evaluate_run
from helpers_cli import glassgpt, one_error_line
from helpers_dirs import assert_unchanged, snapshot

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
        "--batch-size", "2", "--eval-iters", "1", "--log-interval", "1", "--device", "cpu",
        "--threads", "1"]
TINY_MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}
TINY_TRAIN = {"batch_size": 2, "eval_iters": 1, "log_interval": 1, "device": "cpu"}
TEXT = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(100))
HANG_SECONDS = 20


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adversarial-training")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare(root / "data", root / "text.txt")
    return root / "data"


@pytest.fixture(scope="module")
def template(data, tmp_path_factory) -> Path:
    """A tiny run of 2 iterations."""
    run = tmp_path_factory.mktemp("template") / "run"
    train_run(run, data=data, model=TINY_MODEL, threads=1,
              train={**TINY_TRAIN, "max_iters": 2, "eval_interval": 2})
    return run


class Hung(BaseException):
    """Raised by the alarm: the command ran past HANG_SECONDS (nothing in glassgpt catches it)."""


@contextmanager
def no_hang(seconds: int = HANG_SECONDS) -> Iterator[None]:
    def hung(*_):
        raise Hung(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused(argv: list[object], message: str, capsys, *places: Path) -> str:
    """`glassgpt ARGV` ends with one error line holding `message`, changing nothing."""
    before = snapshot(*places)
    with no_hang():
        code, err = glassgpt(*argv, capsys=capsys)
    assert code == 2, err
    line = one_error_line(err)
    assert message in line, line
    assert_unchanged(before, snapshot(*places))
    return line


def hugging_face_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2",
                                                  "architectures": ["GPT2LMHeadModel"]}))
    (path / "model.safetensors").write_bytes(b"weights someone downloaded")
    (path / "tokenizer.json").write_text("{}")
    (path / "README.md").write_text("the model card")
    return path


# --- item 3: --force replaces only a run glassgpt wrote ---------------------------------------

@pytest.mark.parametrize("force", [["--force"], []], ids=["forced", "unforced"])
def test_train_never_replaces_a_hugging_face_model_directory(force, data, tmp_path, capsys):
    hf = hugging_face_dir(tmp_path / "hf")
    line = refused(["train", "--data", data, "--out", hf, *force, "--max-iters", "1", *TINY],
                   "is a Hugging Face model directory", capsys, hf)
    assert "already holds a run" not in line and "even with --force" in line


def test_a_run_of_an_earlier_version_is_still_a_run(template, data, tmp_path, capsys):
    run = shutil.copytree(template, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    del config["format"]  # an older config.json, and no training state to go by
    (run / "config.json").write_text(json.dumps(config))
    for name in ("train_state.json", "train_state.safetensors"):
        (run / name).unlink()
    refused(["train", "--data", data, "--out", run, "--max-iters", "1", *TINY],
            "already holds a run", capsys, run)
    code, err = glassgpt("train", "--data", data, "--out", run, "--force", "--max-iters", "1",
                         *TINY, capsys=capsys)
    assert code == 0, err
    assert load_train_state(run).iteration == 1


# --- item 9: a signal stops an evaluation within a batch ------------------------------------

@contextmanager
def signals_recorded() -> Iterator[list[int]]:
    """Ctrl-C and SIGTERM recorded instead of ending pytest, should one land outside the run."""
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, _: got.append(sig))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def signal_soon(sig: int, sent: list[float], delay: float = 1.0):
    """An on_start callback: `sig` to this process `delay` s later, from a timer thread."""
    def send() -> None:
        sent.append(time.perf_counter())
        os.kill(os.getpid(), sig)

    def on_start(_start) -> None:
        threading.Timer(delay, send).start()
    return on_start


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_an_evaluation_stops_within_a_batch_and_saves(sig, template, data,
                                                                      tmp_path):
    run = shutil.copytree(template, tmp_path / "run")  # at iteration 2; its eval at 3 is long
    sent: list[float] = []
    with signals_recorded(), no_hang():
        done = train_run(run, resume=True, threads=1, on_start=signal_soon(sig, sent),
                         train={"max_iters": 4, "eval_interval": 1, "eval_iters": 10_000})
    assert sent and time.perf_counter() - sent[0] < 5, "the evaluation ignored the signal"
    assert done.result.interrupted and done.result.saved and done.result.iteration == 3
    assert load_train_state(run).iteration == 3  # saved as at any stop
    load_model(run)


def test_a_signal_in_the_first_evaluation_leaves_the_replaced_run_whole(template, data,
                                                                        tmp_path, capsys):
    run = shutil.copytree(template, tmp_path / "run")
    before = snapshot(run)
    sent: list[float] = []
    with signals_recorded(), no_hang():
        done = train_run(run, data=data, force=True, threads=1, model=TINY_MODEL,
                         on_start=signal_soon(signal.SIGINT, sent),
                         train={**TINY_TRAIN, "max_iters": 4, "eval_iters": 10_000})
    assert sent and time.perf_counter() - sent[0] < 5, "the evaluation ignored the signal"
    assert done.result.interrupted and not done.result.saved
    assert_unchanged(before, snapshot(run))  # nothing saved before the first checkpoint


# --- item 10: work that cannot finish is refused before it starts ---------------------------

@pytest.mark.parametrize("flag", ["--eval-iters", "--grad-accum"])
def test_work_that_cannot_finish_is_refused_naming_the_value(flag, data, tmp_path, capsys):
    name = flag.removeprefix("--").replace("-", "_")
    refused(["train", "--data", data, "--out", tmp_path / "run", *TINY, flag, "1000000000000"],
            f"{name}=1000000000000 is too large", capsys, tmp_path)


# --- item 11: rates that only overflow are refused, in the CLI and the API ----------------------

@pytest.mark.parametrize("flags", [["--optimizer", "muon", "--muon-lr", "1e300"],
                                   ["--lr", "1e300"], ["--weight-decay", "1e300"]],
                         ids=["muon-lr", "lr", "weight-decay"])
def test_an_absurd_rate_is_refused_up_front(flags, data, tmp_path, capsys):
    name = flags[-2].removeprefix("--").replace("-", "_")
    refused(["train", "--data", data, "--out", tmp_path / "run", *TINY, "--max-iters", "2",
             *flags], f"{name}=1e+300 is too large", capsys, tmp_path)
    with pytest.raises(ConfigError, match="muon_lr=1e"):
        train_run(tmp_path / "api", data=data, model=TINY_MODEL, threads=1,
                  train={**TINY_TRAIN, "max_iters": 2, "optimizer": "muon", "muon_lr": 1e300})
    assert not (tmp_path / "api").exists()


# --- item 13: a negative target is refused; one met at step 0 stops there --------------------

def test_a_negative_target_loss_is_refused(data, tmp_path, capsys):
    refused(["train", "--data", data, "--out", tmp_path / "run", *TINY, "--target-loss=-1"],
            "target_loss must be positive", capsys, tmp_path)
    with pytest.raises(ConfigError, match="target_loss"):
        train_run(tmp_path / "api", data=data, model=TINY_MODEL,
                  train={**TINY_TRAIN, "target_loss": -0.5})


def test_a_target_met_at_step_0_stops_at_iteration_0(data, tmp_path):
    done = train_run(tmp_path / "run", data=data, model=TINY_MODEL, threads=1,
                     train={**TINY_TRAIN, "max_iters": 4, "eval_interval": 2,
                            "target_loss": 100.0})
    result = done.result
    assert result.target_reached and result.target_iteration == 0 and result.iteration == 0
    assert "at iteration 0" in summary_line(result, done.run_dir)


# --- item 14: a rotary base that cannot work; a NaN message that claims no checkpoint -----------

def test_a_rotary_base_that_cannot_work_is_refused(data, tmp_path, capsys):
    refused(["train", "--data", data, "--out", tmp_path / "run", *TINY, "--position", "rope",
             "--rope-theta", "1e-300"], "rope_theta must be at least 1", capsys, tmp_path)


def test_a_nan_at_step_0_claims_no_checkpoint_and_blames_no_lr(data, tmp_path, monkeypatch):
    from glassgpt.training import trainer

    nan = torch.tensor(math.nan)
    monkeypatch.setattr(trainer, "estimate_loss", lambda *a, **k: {"train": nan, "val": nan})
    with pytest.raises(GlassGPTError) as raised:
        train_run(tmp_path / "run", data=data, model=TINY_MODEL, threads=1,
                  train={**TINY_TRAIN, "max_iters": 2})
    message = str(raised.value)
    assert "last good checkpoint" not in message and "--lr" not in message, message
    assert "nothing was written" in message and not (tmp_path / "run").exists()


# --- item 15: Muon settings without Muon are refused ------------------------------------------

def test_muon_settings_with_adamw_are_refused(data, tmp_path, capsys):
    refused(["train", "--data", data, "--out", tmp_path / "run", *TINY, "--optimizer", "adamw",
             "--muon-lr", "0.05"], "--muon-lr is a setting of the Muon optimizer", capsys,
            tmp_path)
    with pytest.raises(ConfigError, match="muon_momentum is a setting of the Muon"):
        train_run(tmp_path / "api", data=data, model=TINY_MODEL,
                  train={**TINY_TRAIN, "muon_momentum": 0.9})
    assert not (tmp_path / "api").exists()


# --- item 17: train_run checks every argument before it writes, in Python's words -------------

@pytest.mark.parametrize("bad", [{"threads": 0}, {"threads": True}, {"reporter": 42},
                                 {"stop": "yes"}, {"on_start": 5}, {"force": "no"},
                                 {"model": {**TINY_MODEL, "vocab_size": 3}}],
                         ids=["threads-0", "threads-bool", "reporter", "stop", "on-start",
                              "force", "vocab-size"])
def test_train_run_refuses_a_bad_argument_before_writing(bad, data, tmp_path):
    name = next(iter(bad))
    arguments = {"data": data, "model": TINY_MODEL, "threads": 1,
                 "train": {**TINY_TRAIN, "max_iters": 1}, **bad}
    with pytest.raises(ConfigError, match="vocab_size" if name == "model" else name):
        train_run(tmp_path / "run", **arguments)
    assert not (tmp_path / "run").exists()


def test_train_run_words_its_advice_for_python(template, data):
    with pytest.raises(GlassGPTError) as raised:
        train_run(template, data=data, model=TINY_MODEL, train=TINY_TRAIN)
    message = str(raised.value)
    assert "resume=True" in message and "force=True" in message and "--" not in message


# --- item 24: eval shows training's bar, its whole work known before the first batch ----------

def test_eval_reports_its_whole_work_before_the_first_batch(template):
    calls: list[tuple[int, int]] = []
    result = evaluate_run(template, batch_size=2, max_batches=3, threads=1,
                          progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (0, 6) and calls[-1] == (6, 6), calls  # an ETA from the start
    assert result.tokens == 6 * 8


def test_eval_draws_its_bar_on_stderr_only_on_a_terminal(template, capsys, monkeypatch):
    from rich.console import Console

    code, err = glassgpt("eval", template, "--device", "cpu", "--threads", "1", capsys=capsys)
    assert code == 0 and err.splitlines() == [line for line in err.splitlines()
                                              if line.startswith("evaluated")], err
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    code, err = glassgpt("eval", template, "--device", "cpu", "--threads", "1", "--batch-size",
                         "2", "--max-batches", "3", capsys=capsys)
    assert code == 0 and "6/6 windows" in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err), err
