"""Faults during training: kill -9, SIGINT/SIGTERM, a non-finite loss, a disk that refuses writes.

Whatever happens, the run directory holds one complete checkpoint that loads, and resuming it ends
on the same weights (bitwise, on a CPU) as a run that was never interrupted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.data import prepare
from glassgpt.model import GPT
from glassgpt.rundir import directory as rundir
from glassgpt.rundir.checkpoint import TrainState, load_model, load_train_state, save_checkpoint
from glassgpt.storage import files, layout
from glassgpt.tokenizers import CharTokenizer
from glassgpt.training import metrics
from helpers_dirs import Crash, crash_after

# A tiny model that checkpoints after every step, so that a kill often lands in a write.
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-iters", "1", "--log-interval", "1", "--eval-interval", "1",
        "--device", "cpu", "--seed", "3"]
MAX_ITERS = 40
KILL_TRIALS = 4


def glassgpt_process(*args: object, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "glassgpt", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def checkpoint_hashes(run: Path) -> dict[str, str]:
    return {name: hashlib.sha256((run / name).read_bytes()).hexdigest()
            for name in layout.CHECKPOINT_FILES if (run / name).is_file()}


def saved_iteration(run: Path) -> int:
    """The iteration of the committed checkpoint, or -1 while there is none (read-only)."""
    try:
        return json.loads((run / layout.STATE_JSON_FILE).read_text())["iteration"]
    except (FileNotFoundError, json.JSONDecodeError):
        return -1


def tensors_of(run: Path) -> dict[str, torch.Tensor]:
    return {**load_file(run / layout.MODEL_FILE),
            **{f"state.{k}": v for k, v in load_file(run / layout.STATE_TENSORS_FILE).items()}}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    text = root / "text.txt"
    text.write_text("".join(f"To be or not to be, line {i}: that is the question.\n"
                            for i in range(200)), encoding="utf-8")
    prepare(root / "data", text)
    return root / "data"


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> Path:
    """The reference: the same run, never interrupted (in-process, the same code as the CLI)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "--data", str(data), "--out", str(run), "--max-iters", str(MAX_ITERS),
                 *TINY]) == 0
    return run


# --- kill -9 -------------------------------------------------------------------------------

def kill_at_a_random_moment(process: subprocess.Popen, run: Path, rng: random.Random) -> bool:
    """Wait until the process has committed a new checkpoint, then SIGKILL it after a random
    pause. False if it finished first."""
    start = saved_iteration(run)
    while saved_iteration(run) <= start:
        if process.poll() is not None:
            return False
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.2))
    process.kill()  # SIGKILL: no handler runs, no buffer is flushed
    process.wait()
    return True


def kill_in_a_checkpoint_write(process: subprocess.Popen, run: Path) -> bool:
    """SIGKILL the process as soon as a checkpoint write is seen under way (pending files or
    the journal on disk). False if it finished first."""
    start = saved_iteration(run)
    while not (saved_iteration(run) > start and write_under_way(run)):
        if process.poll() is not None:
            return False
        time.sleep(0.0005)
    process.kill()
    process.wait()
    return True


def write_under_way(run: Path) -> bool:
    return any(run.glob("*" + layout.PENDING_SUFFIX)) or (run / layout.RUN_JOURNAL).exists()


def test_kill_9_at_random_moments_loses_nothing(data, uninterrupted, env, tmp_path):
    rng = random.Random(20261129)
    run = tmp_path / "run"
    survived, in_a_write, iterations = 0, 0, [0]
    for trial in range(KILL_TRIALS):
        resume = ["--resume"] if trial else ["--data", data, *TINY]
        process = glassgpt_process("train", "--out", run, "--max-iters", MAX_ITERS, *resume,
                                   env=env)
        killed = (kill_in_a_checkpoint_write(process, run) if trial % 2 else
                  kill_at_a_random_moment(process, run, rng))
        if not killed:
            break
        in_a_write += write_under_way(run)  # the kill cut a checkpoint write short
        load_model(run)  # finishes or drops the cut write, then loads: it must not raise
        state = load_train_state(run)
        assert state.iteration >= iterations[-1], "a checkpoint went back in time"
        iterations.append(state.iteration)
        survived += 1
    assert survived >= KILL_TRIALS - 1, f"the run finished after {survived} kills"
    assert main(["train", "--resume", "--out", str(run)]) == 0
    assert_bitwise_equal(tensors_of(run), tensors_of(uninterrupted))
    print(f"\n{survived} kill -9 trials survived ({in_a_write} during a checkpoint write), "
          f"checkpoints at iterations {iterations[1:]}; final weights bitwise equal")


def test_a_crash_at_any_point_of_a_checkpoint_write_keeps_one_whole_checkpoint(tmp_path,
                                                                                monkeypatch):
    """Crash at each file operation of a commit in turn: the run then loads either the old
    checkpoint or the new one, every file from the same one."""
    old, new = tiny_model(seed=1), tiny_model(seed=2)
    save_at_iteration(tmp_path / "template", old, iteration=1)

    points = 0
    while True:
        run = tmp_path / f"crash{points}"
        shutil.copytree(tmp_path / "template", run)
        crash_after(monkeypatch, points)
        try:
            save_at_iteration(run, new, iteration=2)
            finished = True
        except Crash:
            finished = False
        monkeypatch.undo()
        on_disk = directory_hashes(run)
        loaded = load_train_state(run).iteration
        model, _ = load_model(run)
        expected = new if loaded == 2 else old
        assert loaded in (1, 2)
        assert_bitwise_equal(dict(model.state_dict()), dict(expected.state_dict()))
        assert directory_hashes(run) == on_disk  # reading changed nothing
        rundir.recover_interrupted_commit(run)  # what the next writer does first, under its lock
        # these saves keep no best, and a run trained here has no chat template nor adapters
        written = set(layout.CHECKPOINT_FILES) - {layout.BEST_FILE, layout.CHAT_TEMPLATE_FILE,
                                                  layout.ADAPTER_CONFIG_FILE,
                                                  layout.ADAPTER_WEIGHTS_FILE}
        assert sorted(p.name for p in run.iterdir()) == sorted(written)
        assert load_train_state(run).iteration == loaded
        if finished:
            break
        points += 1
    assert points >= 8  # pending writes, journal, renames: every one of them was cut


def directory_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def tiny_model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=8))


def save_at_iteration(run: Path, model: GPT, iteration: int) -> None:
    save_checkpoint(run, model, CharTokenizer(list("abcdefgh")), {}, None,
                    TrainState(iteration=iteration))


# --- signals -------------------------------------------------------------------------------

@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_saves_a_checkpoint_and_exits_cleanly(stop, data, env, tmp_path):
    run = tmp_path / "run"
    process = glassgpt_process("train", "--data", data, "--out", run, *TINY,
                               "--max-iters", 100_000, "--eval-interval", 100_000, env=env)
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert saved_iteration(run) == 0  # only the checkpoint at step 0: the signal saves the next
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "checkpoint saved" in stderr
    assert f"glassgpt train --resume --out {run}" in stderr
    assert load_train_state(run).iteration >= 1
    load_model(run)


# --- a non-finite loss ---------------------------------------------------------------------

def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(uninterrupted, tmp_path,
                                                                     capsys, monkeypatch):
    from glassgpt.training import trainer

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    real_step = trainer.train_step
    # A step that diverges (an lr past 10 is refused up front, so the loss is made NaN here).
    monkeypatch.setattr(trainer, "train_step", lambda *a, **k: real_step(*a, **k) * math.nan)
    before = checkpoint_hashes(run)
    capsys.readouterr()
    code = main(["train", "--resume", "--out", str(run), "--max-iters", str(MAX_ITERS + 5)])
    stderr = capsys.readouterr().err
    assert code != 0 and "Traceback" not in stderr
    (error,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "NaN or infinite" in error and f"iteration {MAX_ITERS + 1}" in error
    assert f"{run} is kept" in error
    assert checkpoint_hashes(run) == before
    assert load_train_state(run).iteration == MAX_ITERS


# --- disk errors ---------------------------------------------------------------------------

def full_disk_for_pending_files(monkeypatch) -> None:
    """ENOSPC when the checkpoint's second file is written (the disk filled up mid-save)."""
    real, opened = files.open_new_file, []

    def open_without_space(path):
        opened.append(path)
        if len(opened) > 1 and str(path).endswith(layout.PENDING_SUFFIX):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path)
    monkeypatch.setattr(files, "open_new_file", open_without_space)


def read_only_at_the_commit(monkeypatch) -> None:
    """EROFS when the journal is written (the file system went read-only mid-save)."""
    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    monkeypatch.setattr(files, "write_text_atomic", read_only)


@pytest.mark.parametrize("fault", [full_disk_for_pending_files, read_only_at_the_commit])
def test_a_disk_error_while_saving_keeps_the_previous_checkpoint(fault, uninterrupted, tmp_path,
                                                                  capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    before, weights = checkpoint_hashes(run), tensors_of(run)
    fault(monkeypatch)
    capsys.readouterr()
    code = main(["train", "--resume", "--out", str(run), "--max-iters", str(MAX_ITERS + 1)])
    stderr = capsys.readouterr().err
    monkeypatch.undo()
    assert code != 0 and "Traceback" not in stderr
    (error,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert f"cannot save a checkpoint in {run}" in error and "kept" in error
    assert checkpoint_hashes(run) == before
    assert not list(run.glob("*.pending"))
    assert_bitwise_equal(tensors_of(run), weights)
    assert load_train_state(run).iteration == MAX_ITERS


def test_a_full_disk_while_drawing_the_loss_curve_is_one_line(uninterrupted, tmp_path, capsys,
                                                               monkeypatch):
    """loss.png is drawn after each evaluation's checkpoint: a full disk there stops the run
    with one line, and the checkpoint just committed is whole."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)

    def no_space(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(metrics, "write_bytes_atomic", no_space)
    capsys.readouterr()
    code = main(["train", "--resume", "--out", str(run), "--max-iters", str(MAX_ITERS + 1)])
    stderr = capsys.readouterr().err
    assert code == 2 and "Traceback" not in stderr
    (error,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert f"cannot write {run / 'loss.png'}" in error and "No space left on device" in error
    assert load_train_state(run).iteration == MAX_ITERS + 1
    load_model(run)
