"""The training lifecycle (glassgpt.training.lifecycle.train_run) and what it promises a user
(issues 19, 20): nothing lost (`--force` replaces only at the new run's first commit, a closed
stdout saves), nothing hangs (a FIFO where a file belongs), resume with the run's own command line,
one shape for threads, fine-tuning defaults, and one line for each bad input.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_gpt
from glassgpt.cli import build_parser, main
from glassgpt.config import TrainConfig
from glassgpt.data import PreparedData, prepare
from glassgpt.errors import CheckpointError, ConfigError, DataError, GlassGPTError
from glassgpt.machine import devices
from glassgpt.rundir.checkpoint import Run, load_model, load_train_state, save_model
from glassgpt.storage import layout
from glassgpt.storage.files import read_json_object
from glassgpt.tokenizers import load_tokenizer_files, read_tokenizer_file
from glassgpt.training import runs
from glassgpt.training.lifecycle import finetune_config, recipe_warnings, train_run
from glassgpt.training.metrics import read_metrics
from helpers_cli import glassgpt, one_error_line
from helpers_dirs import assert_unchanged, snapshot

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
        "--batch-size", "2", "--eval-iters", "1", "--log-interval", "1", "--device", "cpu"]
TINY_MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}
TINY_TRAIN = {"batch_size": 2, "eval_iters": 1, "log_interval": 1, "device": "cpu"}
TEXT = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(100))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lifecycle")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare(root / "data", root / "text.txt")
    return root / "data"


@pytest.fixture(scope="module")
def template(data, tmp_path_factory) -> Path:
    """A tiny run of 2 iterations, trained through the library call."""
    run = tmp_path_factory.mktemp("template") / "run"
    done = train_run(run, data=data, model=TINY_MODEL,
                     train={**TINY_TRAIN, "max_iters": 2, "eval_interval": 2})
    assert done.action == "train" and done.result.iteration == 2
    assert done.start.preset == "cpu-small" and done.threads == torch.get_num_threads()
    return run


# --- D1: --force keeps the old run until the new one commits; a closed stdout saves -----------

class Cut(BaseException):
    """A crash (kill -9, power loss) before the new run's first commit."""


def test_force_keeps_the_old_run_until_the_new_run_commits(template, data, tmp_path, capsys,
                                                           monkeypatch):
    run = shutil.copytree(template, tmp_path / "run")
    before = snapshot(run, skip=(layout.LOCK_FILE,))
    from glassgpt.training import trainer as train_module

    def crash(*args, **kwargs):
        raise Cut
    monkeypatch.setattr(train_module, "estimate_loss", crash)  # the evaluation at step 0
    with pytest.raises(Cut):
        main(["train", "--data", str(data), "--out", str(run), "--force", "--max-iters", "3",
              *TINY])
    monkeypatch.undo()
    assert_unchanged(before, snapshot(run, skip=(layout.LOCK_FILE,)))
    load_model(run)
    # Without the crash, the first commit (at step 0) replaces the run as a whole.
    code, err = glassgpt("train", "--data", data, "--out", run, "--force", "--max-iters", "3",
                         "--eval-interval", "100", *TINY, capsys=capsys)
    assert code == 0, err
    assert [r["iter"] for r in read_metrics(run) if "val_loss" in r] == [0, 3]
    assert load_train_state(run).best_iteration in (0, 3)


@pytest.mark.slow
def test_a_closed_stdout_saves_and_says_so_on_stderr(data, tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "glassgpt", "--debug", "train", "--data", str(data), "--out",
         str(run), "--max-iters", "100000", "--eval-interval", "5", *TINY],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().startswith("step 0:")
    process.stdout.close()  # `| head -1`
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 141, stderr
    assert "Traceback" not in stderr and "stdout was closed" in stderr
    assert f"glassgpt train --resume --out {run}" in stderr
    assert load_train_state(run).iteration >= 5
    load_model(run)


# --- D2, D3: prepare refuses any file it would write; an empty path is one line ---------------

@pytest.mark.parametrize("name", ["train.bin", "tokenizer.json", "val.bin"])
def test_prepare_refuses_a_directory_holding_a_file_it_would_write(name, data, tmp_path,
                                                                   capsys):
    out = tmp_path / "s"
    out.mkdir()
    (out / name).write_text("mine")
    before = snapshot(out)
    code, err = glassgpt("prepare", "--text", data.parent / "text.txt", "--out", out,
                         capsys=capsys)
    assert code == 2 and f"already holds {name}; pass --force" in one_error_line(err)
    assert_unchanged(before, snapshot(out))


EMPTY_PATHS = {
    "train --out": ["train", "--out", ""], "train --data": ["train", "--data", ""],
    "train --config": ["train", "--config", ""], "train --init-from": ["train", "--init-from", ""],
    "prepare --out": ["prepare", "--out", ""], "prepare --text": ["prepare", "--text", "",
                                                                  "--out", "x"],
    "prepare --tokenizer-file": ["prepare", "--tokenizer-file", "", "--out", "x"],
    "sample RUN_DIR": ["sample", ""], "eval --data": ["eval", "r", "--data", ""],
    "convert --to-hf": ["convert", "r", "--to-hf", ""],
    "convert --from-hf": ["convert", "--from-hf", "", "--out", "x"],
    "view RUN_DIR": ["view", ""], "attention --out": ["attention", "r", "--out", ""],
}


@pytest.mark.parametrize("argv", EMPTY_PATHS.values(), ids=EMPTY_PATHS.keys())
def test_an_empty_path_is_refused_with_one_line(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = glassgpt(*argv, capsys=capsys)
    assert code == 2 and "an empty path" in one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_a_buffer_beyond_the_machine_is_one_line(data, tmp_path, capsys):
    code, err = glassgpt("prepare", "--text", data.parent / "text.txt", "--out", tmp_path / "d",
                         "--buffer-mb", "1e12", capsys=capsys)
    assert code == 2 and "does not fit this machine" in one_error_line(err)
    assert not (tmp_path / "d").exists()


class FullDisk(io.StringIO):
    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fileno(self) -> int:
        return self.fd


def test_a_failed_write_to_stdout_is_one_line(template, tmp_path, capsys, monkeypatch):
    """`glassgpt sample RUN > /dev/full`."""
    with open(tmp_path / "out", "w") as sink:
        monkeypatch.setattr(sys, "stdout", FullDisk(sink.fileno()))
        code = main(["sample", str(template), "--max-new-tokens", "2", "--device", "cpu"])
    assert code == 1
    err = capsys.readouterr().err
    (error,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "cannot write the output: No space left" in error and "Traceback" not in err


# --- hangs: a FIFO where a file belongs is refused at once -----------------------------------

@contextmanager
def no_hang(seconds: int = 10) -> Iterator[None]:
    def hung(*_):
        raise TimeoutError("blocked on a FIFO")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


RUN_READERS = {
    "tokenizer.json": lambda run: Run(run).tokenizer(),
    "config.json": Run,
    "best.safetensors": lambda run: load_model(run, checkpoint="best"),
    "model.safetensors": lambda run: load_model(run, checkpoint="last"),
    "train_state.json": lambda run: load_train_state(run),
    "train_state.safetensors": lambda run: load_train_state(run),
    "metrics.jsonl": read_metrics,
    ".glassgpt.lock": lambda run: runs.files.check_unlocked(run, CheckpointError),
}


@pytest.mark.parametrize("name", RUN_READERS)
def test_a_fifo_in_a_run_is_refused_at_once(name, template, tmp_path):
    run = shutil.copytree(template, tmp_path / "run")
    (run / name).unlink(missing_ok=True)
    os.mkfifo(run / name)
    with no_hang(), pytest.raises(GlassGPTError, match="is not a regular file"):
        RUN_READERS[name](run)


DATA_READERS = {
    "meta.json": PreparedData, "train.bin": PreparedData, "val.bin": PreparedData,
    "tokenizer.json": lambda d: read_tokenizer_file(d / "tokenizer.json"),
}


@pytest.mark.parametrize("name", DATA_READERS)
def test_a_fifo_in_a_data_directory_is_refused_at_once(name, data, tmp_path):
    copy = shutil.copytree(data, tmp_path / "data")
    (copy / name).unlink()
    os.mkfifo(copy / name)
    with no_hang(), pytest.raises(GlassGPTError, match="is not a regular file"):
        DATA_READERS[name](copy)


def test_a_fifo_given_as_a_file_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with no_hang():
        with pytest.raises(GlassGPTError, match="is not a regular file"):
            load_tokenizer_files([tmp_path / "fifo"])  # --tokenizer-file
        with pytest.raises(GlassGPTError, match="is not a regular file"):
            runs.read_config_file(tmp_path / "fifo")  # --config


# --- resume with the run's own command line (issue 20 item 7) ------------------------------

def test_resume_takes_the_runs_own_command_line_and_refuses_a_change(data, tmp_path, capsys):
    run, recipe = tmp_path / "run", tmp_path / "recipe.toml"
    recipe.write_text("[train]\neval_interval = 2\n")
    line = ["train", "--data", data, "--out", run, "--preset", "cpu-small", "--config", recipe,
            *TINY]
    assert glassgpt(*line, "--max-iters", "2", capsys=capsys)[0] == 0
    code, err = glassgpt(*line, "--max-iters", "4", "--resume", capsys=capsys)
    assert code == 0 and "resuming at iteration 2 of 4" in err, err
    for change, named in ((["--preset", "shakespeare-char"], "--preset shakespeare-char"),
                          (["--lr", "0.5"], "lr=0.5 (the run has 0.001)"),
                          (["--n-embd", "32"], "n_embd=32 (the run has 16)")):
        before = snapshot(run)
        argv = [a for a in line if a not in ("--preset", "cpu-small")] + change
        code, err = glassgpt(*argv, "--max-iters", "6", "--resume", capsys=capsys)
        assert code == 2 and named in one_error_line(err)
        assert_unchanged(before, snapshot(run))


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2,
                    reason="thread counts to choose between need two cores")
def test_n_steps_then_resume_equals_2n_steps_with_threads_auto(data, tmp_path, capsys,
                                                                monkeypatch):
    """--threads auto (the default) times the first steps at 1 thread and at all cores; a
    resumed run continues with the count its checkpoint ran with, so the sums match bitwise.
    The timing verdict is fixed here (all cores win), as it is on a quiet machine."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # auto is the tuner's to decide

    def all_cores_win(tuner):
        tuner._set(max(tuner.candidates))
        tuner.baseline, tuner.probes = float("inf"), tuner.probes + 1
    monkeypatch.setattr(devices.ThreadTuner, "_choose", all_cores_win)
    common = [*TINY, "--data", data, "--eval-interval", "8", "--lr-decay-iters", "16"]

    def train(*argv):
        torch.set_num_threads(1)  # what a fresh process starts with here
        assert glassgpt("train", *argv, *common, capsys=capsys)[0] == 0

    try:
        train("--out", tmp_path / "whole", "--max-iters", "16")
        train("--out", tmp_path / "split", "--max-iters", "8")
        train("--out", tmp_path / "split", "--max-iters", "16", "--resume")
    finally:
        torch.set_num_threads(1)
    assert load_train_state(tmp_path / "split").threads == max(2, 1)
    whole = load_file(tmp_path / "whole" / layout.MODEL_FILE)
    split = load_file(tmp_path / "split" / layout.MODEL_FILE)
    assert all(torch.equal(whole[k], split[k]) for k in whole)


# --- fine-tuning: sensible defaults, and warnings ------------------------------------------

def test_fine_tuning_defaults_follow_the_source_recipe(template, tmp_path):
    source = Run(template)  # trained with cpu-small's recipe: lr 1e-3, warm-up 100
    cfg = finetune_config(source, "cpu-small", None, {"max_iters": 100})
    assert cfg.lr == pytest.approx(1e-4) and cfg.warmup_iters == 10
    assert cfg.eval_interval <= 100 and cfg.device == "auto"  # the machine is not inherited
    assert recipe_warnings(cfg) == []
    given = finetune_config(source, "cpu-small", None, {"max_iters": 100, "lr": 3e-4,
                                                        "warmup_iters": 0})
    assert given.lr == 3e-4 and given.warmup_iters == 0
    warned = recipe_warnings(TrainConfig(max_iters=100, warmup_iters=100, eval_interval=250))
    assert len(warned) == 2 and "warmup_iters (100) >= max_iters (100)" in warned[0]
    assert "eval_interval (250) > max_iters (100)" in warned[1]


def test_a_fine_tune_through_the_library_reports_what_it_did(template, data, tmp_path):
    done = train_run(tmp_path / "tuned", data=data, init_from=template,
                     train={"max_iters": 2, "device": "cpu", "batch_size": 2, "eval_iters": 1},
                     threads=1)
    assert done.action == "fine-tune" and done.result.iteration == 2 and done.threads == 1
    config = read_json_object(tmp_path / "tuned" / layout.CONFIG_FILE, CheckpointError)
    assert config["extra"]["init_from"] == str(template)
    assert config["train"]["lr"] == pytest.approx(1e-4)


def test_train_help_shows_the_defaults_a_bare_train_uses(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-iters INT optimizer steps in total" in text
    assert "(default 2000)" in text and "peak learning rate (default 0.001)" in text
    assert "(default 5000)" not in text  # TrainConfig's own, which a bare train never uses


def test_validation_before_anything_is_replaced(template, data, tmp_path):
    run = shutil.copytree(template, tmp_path / "run")
    before = snapshot(run)
    with pytest.raises(ConfigError):
        train_run(run, data=data, force=True, model={**TINY_MODEL, "n_head": 3},
                  train=TINY_TRAIN)
    with pytest.raises(DataError):
        train_run(run, data=tmp_path / "nowhere", force=True, model=TINY_MODEL,
                  train=TINY_TRAIN)
    assert_unchanged(before, snapshot(run))


def test_evaluate_run_opens_the_run_once_and_reports_its_threads(template, monkeypatch):
    opened = []
    real = Run.__init__

    def counting(self, run_dir):
        opened.append(run_dir)
        real(self, run_dir)
    monkeypatch.setattr(Run, "__init__", counting)
    result = runs.evaluate_run(template, max_batches=1, batch_size=2, threads=1)
    assert len(opened) == 1 and result.threads == 1


def test_a_converted_run_can_be_fine_tuned_with_the_presets_recipe(data, tmp_path):
    tokenizer = PreparedData(data).tokenizer
    save_model(tmp_path / "converted", tiny_gpt(vocab_size=tokenizer.vocab_size, **TINY_MODEL),
               tokenizer)
    cfg = finetune_config(Run(tmp_path / "converted"), "cpu-small", None, {"max_iters": 50})
    assert cfg.lr == pytest.approx(1e-4) and cfg.warmup_iters == 5
    assert json.loads((tmp_path / "converted" / layout.CONFIG_FILE).read_text())["train"] is None


# --- the commands docs/cli.md shows ---------------------------------------------------------------

DOC_TINY = {"train": [*TINY, "--max-iters", "2", "--eval-interval", "2"],
            "sample": ["--max-new-tokens", "3", "--device", "cpu"],
            "eval": ["--max-batches", "1", "--device", "cpu"], "prepare": []}


def doc_commands(page: Path, heading: str) -> list[list[str]]:
    """The `glassgpt ...` lines of the first bash block after `heading`."""
    text = page.read_text(encoding="utf-8").split(heading, 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split()[1:] for line in block.splitlines() if line.startswith("glassgpt ")]


def test_the_tour_in_the_cli_docs_runs(tmp_path, capsys, monkeypatch):
    """Each command of docs/cli.md's tour, in order, at a tiny size (flags appended last win)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.txt").write_text(TEXT + "ROMEO: But, soft!\n", encoding="utf-8")
    commands = doc_commands(Path(__file__).parents[1] / "docs" / "cli.md", "## A tour")
    assert len(commands) >= 6
    for argv in commands:
        argv = [a.strip('"') for a in argv]
        tiny = DOC_TINY[argv[0]]
        if "--resume" in argv:
            tiny = [*tiny, "--max-iters", "4"]
        code, err = glassgpt(*argv, *tiny, capsys=capsys)
        assert code == 0, (argv, err)
    assert load_train_state(tmp_path / "runs" / "mine").iteration == 4
    # Recorded absolute: a resume checks its --init-from against it from any directory.
    assert Run(tmp_path / "runs" / "tuned").extra["init_from"] == str(tmp_path / "runs" / "mine")


@pytest.mark.slow
def test_the_python_example_in_the_api_docs_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.txt").write_text(TEXT, encoding="utf-8")
    page = (Path(__file__).parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    section = page.split("## Training from Python", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/api.md", "exec"), namespace)
    assert namespace["done"].action == "resume" and namespace["done"].result.iteration == 40
    assert namespace["tuned"].action == "fine-tune"
