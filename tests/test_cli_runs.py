"""`glassgpt prepare | train | sample | eval`, end to end through real subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glassgpt.cli import main

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-iters", "2", "--log-interval", "1"]


def glassgpt(*args: str | Path, env: dict[str, str], cwd: Path | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "glassgpt", *map(str, args)],
                            capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def in_process(*args: str | Path, capsys: pytest.CaptureFixture) -> str:
    """Run `glassgpt ARGS` in this process (where a second run of a command is only a reference
    for the one under test, a fresh interpreter adds nothing but seconds); returns stdout."""
    capsys.readouterr()
    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text("".join(f"To be or not to be, line {i}: that is the question.\n"
                            for i in range(200)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def data_dir(text, env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    result = glassgpt("prepare", "--text", text, "--out", out, env=env)
    assert "char tokenizer" in result.stdout
    return out


@pytest.fixture(scope="module")
def run_dir(data_dir, env, tmp_path_factory) -> Path:
    """A tiny run, with one setting from a --config TOML file."""
    root = tmp_path_factory.mktemp("run")
    config = root / "recipe.toml"
    config.write_text("[train]\neval_interval = 3\nlr = 0.003\n")
    run = root / "run"
    result = glassgpt("train", "--data", data_dir, "--out", run, "--max-iters", "6",
                      "--config", config, *TINY, env=env)
    assert "val loss" in result.stdout
    return run


def test_prepare_writes_a_data_directory(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["tokenizer"] == "char" and meta["train_tokens"] > meta["val_tokens"] > 0
    assert (data_dir / "train.bin").is_file() and (data_dir / "tokenizer.json").is_file()


@pytest.mark.slow
def test_prepare_bpe(text, env, tmp_path):
    glassgpt("prepare", "--text", text, "--tokenizer", "bpe", "--vocab-size", "300",
             "--out", tmp_path, env=env)
    assert json.loads((tmp_path / "meta.json").read_text())["vocab_size"] == 300


def test_train_writes_a_complete_run_directory(run_dir):
    for name in ("config.json", "model.safetensors", "best.safetensors", "tokenizer.json",
                 "train_state.json", "train_state.safetensors", "metrics.jsonl", "loss.png"):
        assert (run_dir / name).is_file(), name
    config = json.loads((run_dir / "config.json").read_text())
    assert config["train"]["eval_interval"] == 3 and config["train"]["lr"] == 0.003
    assert config["train"]["max_iters"] == 6 and config["model"]["n_layer"] == 1
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in metrics if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["iter"] for r in metrics if "val_loss" in r] == [0, 3, 6]  # nanoGPT's eval at 0


@pytest.mark.slow
def test_sample_streams_the_same_text_it_prints(run_dir, env, capsys):
    args = ["sample", run_dir, "--prompt", "To be", "--max-new-tokens", "40", "--seed", "4"]
    printed = in_process(*args, capsys=capsys)
    streamed = glassgpt(*args, "--stream", env=env).stdout
    assert printed == streamed and printed.startswith("To be")
    assert len(printed) == len("To be") + 40 + 1  # char level: one character per token


@pytest.mark.slow
def test_sample_stops_before_the_stop_text(run_dir, env, capsys):
    args = ["sample", run_dir, "--prompt", "T", "--max-new-tokens", "60", "--seed", "1",
            "--temperature", "1.5"]
    full = in_process(*args, capsys=capsys)[1:-1]  # without prompt and final newline
    stop = next(c for c in "e to" if c in full)  # a character the model does produce
    stopped = glassgpt(*args, "--stop", stop, "--stream", env=env).stdout
    assert stopped == "T" + full[:full.index(stop)] + "\n"


def test_sample_in_bfloat16_decodes_the_same_greedy_text(run_dir, capsys):
    args = ["sample", run_dir, "--prompt", "To be", "--max-new-tokens", "20", "--temperature",
            "0"]
    full = in_process(*args, capsys=capsys)
    half = in_process(*args, "--dtype", "bfloat16", capsys=capsys)
    assert half.startswith("To be") and len(half) == len(full)
    # bf16 rounds the weights: greedy text may part ways late, but starts the same.
    assert half[:8] == full[:8]


@pytest.mark.slow
def test_sample_with_a_compiled_step_prints_the_same_text(run_dir, capsys):
    args = ["sample", run_dir, "--prompt", "To be", "--max-new-tokens", "30", "--seed", "5"]
    assert in_process(*args, "--compile", capsys=capsys) == in_process(*args, capsys=capsys)


@pytest.mark.slow
def test_several_samples_and_a_prompt_longer_than_the_context(run_dir, env):
    result = glassgpt("sample", run_dir, "--prompt", "to be " * 10, "--max-new-tokens", "3",
                      "--num-samples", "2", env=env)
    assert "the model sees its last 16" in result.stderr
    assert result.stdout.count("-" * 40) == 1 and result.stdout.count("to be " * 10) == 2


@pytest.mark.slow
def test_eval_prints_loss_and_perplexity(run_dir, env, capsys):
    line = in_process("eval", run_dir, capsys=capsys)
    assert line.startswith("val loss") and "perplexity" in line
    result = json.loads(glassgpt("eval", run_dir, "--json", "--split", "train",
                                 env=env).stdout)
    assert result["split"] == "train" and result["tokens"] > 0
    assert abs(result["perplexity"] - 2.718281828 ** result["loss"]) < 1e-6


def test_fine_tuning_starts_from_another_runs_weights(run_dir, text, tmp_path, capsys):
    in_process("prepare", "--text", text, "--tokenizer-file", run_dir / "tokenizer.json",
               "--out", tmp_path / "data", capsys=capsys)
    in_process("train", "--init-from", run_dir, "--data", tmp_path / "data", "--out",
               tmp_path / "tuned", "--max-iters", "1", "--eval-iters", "1", "--dropout", "0.2",
               "--lr", "1e-9", "--warmup-iters", "0", capsys=capsys)
    base = load_file(run_dir / "model.safetensors")
    tuned = load_file(tmp_path / "tuned" / "model.safetensors")
    assert all(torch.allclose(base[k], tuned[k], atol=1e-6) for k in base)  # tiny lr: same
    config = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert config["model"]["dropout"] == 0.2 and config["model"]["n_embd"] == 16
    in_process("prepare", "--text", text, "--tokenizer", "bpe", "--vocab-size", "300", "--out",
               tmp_path / "bpe", capsys=capsys)
    assert main(["train", "--init-from", str(run_dir), "--data", str(tmp_path / "bpe"),
                 "--out", str(tmp_path / "wrong")]) == 2
    assert "--tokenizer-file" in capsys.readouterr().err


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


@pytest.mark.slow
def test_resume_continues_exactly(data_dir, env, tmp_path, capsys):
    """6 iterations in one go == 3, stop, then --resume up to 6: same losses, same weights."""
    common = [*TINY, "--data", data_dir, "--eval-interval", "3", "--lr-decay-iters", "6",
              "--dropout", "0.1"]
    in_process("train", "--out", tmp_path / "whole", "--max-iters", "6", *common, capsys=capsys)
    glassgpt("train", "--out", tmp_path / "split", "--max-iters", "3", *common, env=env)
    result = glassgpt("train", "--resume", "--out", tmp_path / "split", "--max-iters", "6",
                      env=env)
    assert "resuming" in result.stderr
    assert losses(tmp_path / "whole") == losses(tmp_path / "split")
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    split = load_file(tmp_path / "split" / "model.safetensors")
    assert all((whole[k] == split[k]).all() for k in whole)


@pytest.mark.slow
def test_an_existing_run_is_kept_unless_forced(data_dir, env, tmp_path, capsys):
    in_process("train", "--data", data_dir, "--out", tmp_path, "--max-iters", "3", *TINY,
               capsys=capsys)
    refused = glassgpt("train", "--data", data_dir, "--out", tmp_path, *TINY, env=env,
                       check=False)
    assert refused.returncode != 0 and "--resume" in refused.stderr
    assert "--force" in refused.stderr and len(losses(tmp_path)) == 3
    glassgpt("train", "--data", data_dir, "--out", tmp_path, "--max-iters", "2", "--force",
             *TINY, env=env)
    assert len(losses(tmp_path)) == 2


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_that_resumes(data_dir, env, tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "glassgpt", "train", "--data", str(data_dir), "--out", str(run),
         "--max-iters", "100000", "--eval-interval", "100000", *TINY],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in stderr
    assert "--resume" in stderr
    state = json.loads((run / "train_state.json").read_text())
    assert state["iteration"] >= 1
    glassgpt("train", "--resume", "--out", run, "--max-iters", str(state["iteration"] + 1),
             env=env)
    assert len(losses(run)) == state["iteration"] + 1


@pytest.mark.slow
def test_train_without_data_uses_tiny_shakespeare_and_a_fresh_run_dir(env, tmp_path):
    # On a CPU the default preset is cpu-small (on a GPU machine the test pins the CPU).
    result = glassgpt("train", "--max-iters", "1", "--eval-interval", "1", "--device", "cpu",
                      *TINY, env=env, cwd=tmp_path)
    assert "runs/" in result.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "model.safetensors").is_file()
    assert json.loads((run / "config.json").read_text())["extra"]["preset"] == "cpu-small"
    meta = Path(env["XDG_CACHE_HOME"]) / "glassgpt" / "data" / "tinyshakespeare-char" / "meta.json"
    assert json.loads(meta.read_text())["train_tokens"] == 1_003_854


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


BAD_INPUTS = {
    "missing text": (lambda d, r, t: ["prepare", "--text", t / "nope.txt", "--out", t / "o"],
                     "not found"),
    "empty text": (lambda d, r, t: ["prepare", "--text", write(t / "e.txt", b""), "--out", t],
                   "empty"),
    "non-UTF-8 text": (lambda d, r, t: ["prepare", "--text", write(t / "l.txt", b"caf\xe9 "),
                                        "--out", t], "not UTF-8"),
    "text shorter than the context": (
        lambda d, r, t: ["train", "--data", d, "--out", t / "r", *TINY, "--block-size", "5000"],
        "too short for block_size=5000"),
    "unknown preset": (lambda d, r, t: ["train", "--data", d, "--preset", "gpt5"], "gpt5"),
    "unknown flag": (lambda d, r, t: ["train", "--data", d, "--learning-rate", "1"],
                     "--learning-rate"),
    "batch size 0": (lambda d, r, t: ["train", "--data", d, "--out", t, "--batch-size", "0"],
                     "batch_size must be positive, got 0"),
    "block size -1": (lambda d, r, t: ["train", "--data", d, "--out", t, "--block-size", "-1"],
                      "block_size must be positive, got -1"),
    "resume of a missing run": (lambda d, r, t: ["train", "--resume", "--out", t / "nope"],
                                "not found"),
    "sampling without a checkpoint": (lambda d, r, t: ["sample", t], "no checkpoint"),
    "unknown characters in a prompt": (lambda d, r, t: ["sample", r, "--prompt", "Zebra{"],
                                       "'Z', '{'"),
    "a config file that is not TOML": (
        lambda d, r, t: ["train", "--data", d, "--out", t, "--config", write(t / "c.toml", b"[")],
        "not valid TOML"),
}
# A few go through a real process; the rest run `main` in-process: the same code path (any
# exception escaping `main` would be the traceback), without paying for a fresh interpreter.
THROUGH_A_PROCESS = ("non-UTF-8 text", "unknown flag", "sampling without a checkpoint",
                     "text shorter than the context")


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow)
                                  if case in THROUGH_A_PROCESS else case for case in BAD_INPUTS])
def test_bad_input_is_one_line_and_no_traceback(case, data_dir, run_dir, env, tmp_path, capsys,
                                                monkeypatch):
    make_args, message = BAD_INPUTS[case]
    args = [str(a) for a in make_args(data_dir, run_dir, tmp_path)]
    if case in THROUGH_A_PROCESS:
        result = glassgpt(*args, env=env, check=False)
        code, stderr = result.returncode, result.stderr
    else:
        monkeypatch.setenv("GLASSGPT_TINYSHAKESPEARE", env["GLASSGPT_TINYSHAKESPEARE"])
        code, stderr = main(args), capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert message in stderr


# --- what a new user trips over --------------------------------------------------------------

def test_debug_is_a_global_flag_wherever_it_is_given(run_dir, capsys):
    capsys.readouterr()
    assert main(["sample", str(run_dir), "--max-new-tokens", "2", "--debug"]) == 0
    with pytest.raises(Exception, match="run directory not found"):  # the traceback, asked for
        main(["sample", str(run_dir / "nope"), "--debug"])


@pytest.mark.slow
def test_a_closed_pipe_ends_sampling_quietly(run_dir, env):
    process = subprocess.Popen([sys.executable, "-m", "glassgpt", "sample", str(run_dir),
                                "--stream", "--max-new-tokens", "400", "--threads", "1"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.read(5)  # like `| head -c 5`: read a little, then go away
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141  # what `yes | head` reports: killed by SIGPIPE
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr


@pytest.mark.parametrize(("command", "message"), [
    (lambda run, data: ["sample", data], "is a data directory (token ids from `glassgpt "
                                         "prepare`), not a run; train on it first"),
    (lambda run, data: ["train", "--data", run, "--out", run.parent / "new", *TINY],
     "is a run directory, not prepared data"),
    (lambda run, data: ["prepare", "--out", run.parent / "x", "--tokenizer", "char",
                        "--vocab-size", "300"], "a vocabulary size (300) applies to BPE"),
])
def test_a_wrong_kind_of_directory_or_setting_is_named_for_what_it_is(command, message, run_dir,
                                                                      data_dir, capsys):
    capsys.readouterr()
    assert main([str(a) for a in command(run_dir, data_dir)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_hugging_face_directory_points_to_convert(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2", "n_embd": 16}')
    (hf / "model.safetensors").write_bytes(b"")
    capsys.readouterr()
    assert main(["eval", str(hf)]) == 2
    assert "is a Hugging Face model directory, not a glassgpt run; import it with " \
           "`glassgpt convert --from-hf" in capsys.readouterr().err


def test_eval_says_when_the_bound_leaves_part_of_the_split_out(run_dir, capsys):
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--split", "train", "--max-batches", "1",
                 "--batch-size", "2", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert "tokens; a part: raise --max-batches for all of it)" in captured.out
    assert "evaluated the best weights" in captured.err


@pytest.mark.parametrize(("command", "defaults"), [
    ("sample", ["(default: 500)", "(default: 0.8)", "(default: 200)", "(default: 1337)"]),
    ("eval", ["(default: 32, fewer where their logits would pass 1 GiB)", "(default: 200)",
              "(default: val)"]),
    ("prepare", ["(default 1024; BPE only)", "(default: 0.1)"]),
])
def test_help_shows_the_defaults(command, defaults, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(d in text for d in defaults), text
