"""`glassgpt demo` and `glassgpt attention` through a real subprocess, at tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glassgpt.checkpoint import save_model
from glassgpt.config import GPTConfig
from glassgpt.model import GPT
from glassgpt.tokenizers import CharTokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def glassgpt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glassgpt", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_demo_shapes_prints_table_and_writes_json(tmp_path: Path) -> None:
    out = glassgpt("demo", "shapes", "--out", "pics", "--json", "shapes.json", "--batch-size", "2",
                   "--seq-len", "5", "--d-model", "24", "--n-heads", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "(2, 3, 5, 8)" in out.stdout and "merge heads" in out.stdout
    assert "✓ the walk equals the module" in out.stdout
    data = json.loads((tmp_path / "shapes.json").read_text())
    shapes = data["experiments"]["shapes"]
    assert data["seed"] == 0 and data["quick"] is False
    steps = {row["step"]: row["shape"] for row in shapes["tables"][0]["rows"]}
    assert steps["softmax over keys"] == "(2, 3, 5, 5)"
    assert all(check["holds"] for check in shapes["checks"])
    assert (tmp_path / "pics" / "shapes_weights.png").read_bytes()[:8] == PNG_MAGIC


def test_demo_all_quick_runs_every_experiment(tmp_path: Path) -> None:
    out = glassgpt("demo", "all", "--quick", "--out", "pics", "--json", "all.json", "--seed",
                   "1", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
    data = json.loads((tmp_path / "all.json").read_text())
    assert list(data["experiments"]) == ["shapes", "parity", "multihead", "layernorm", "params",
                                         "residual", "dropout", "sharing"]
    assert data["seed"] == 1 and data["quick"] is True
    for name, result in data["experiments"].items():
        assert result["checks"] and all(c["holds"] for c in result["checks"]), name
        for picture in result["pictures"]:
            assert (tmp_path / picture).read_bytes()[:8] == PNG_MAGIC
    params = data["experiments"]["params"]["numbers"]
    assert params["gpt2_small_total"] == 124_439_808
    assert "124,439,808" in out.stdout
    assert "[block] * L" in out.stdout  # printed as written, not eaten as rich markup


@pytest.mark.parametrize(("args", "message"), [
    (["demo", "nope"], "invalid choice: 'nope'"),
    (["demo", "params", "--d-model", "32"], "--d-model only apply to `glassgpt demo shapes`"),
    (["demo", "shapes", "--d-model", "10", "--n-heads", "4"],
     "d_model=10 is not divisible by n_heads=4"),
])
def test_demo_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str],
                                              message: str) -> None:
    out = glassgpt(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.fixture()
def tiny_run(tmp_path: Path) -> Path:
    """A run directory holding a tiny random character-level model."""
    tokenizer = CharTokenizer.from_text("to be or not, that is the question")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=2, n_head=2,
                          n_embd=16))
    run_dir = tmp_path / "run"
    save_model(run_dir, model, tokenizer)
    return run_dir


def test_attention_draws_every_layer_and_head_or_one_panel(tiny_run: Path,
                                                           tmp_path: Path) -> None:
    full = glassgpt("attention", str(tiny_run), "--prompt", "to be or not", "--out", "all.png",
                    cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    assert "2 layers x 2 heads over 12 tokens" in full.stdout
    assert (tmp_path / "all.png").read_bytes()[:8] == PNG_MAGIC
    one = glassgpt("attention", str(tiny_run), "--prompt", "to be or not", "--layer", "1",
                   "--head", "0", "--out", "one.png", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert (tmp_path / "one.png").stat().st_size < (tmp_path / "all.png").stat().st_size


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt", "to be", "--layer", "2"], "layer 2 does not exist: the model has layers 0..1"),
    (["--prompt", "zebra"], "not in the tokenizer's vocabulary"),
    (["--prompt", "to be " * 10], "longer than block_size=32"),
])
def test_attention_bad_input_is_one_line_and_exit_2(tiny_run: Path, tmp_path: Path,
                                                   args: list[str], message: str) -> None:
    out = glassgpt("attention", str(tiny_run), *args, "--out", "x.png", cwd=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


def test_attention_missing_run_dir_is_a_clear_error(tmp_path: Path) -> None:
    out = glassgpt("attention", str(tmp_path / "nowhere"), "--prompt", "a", "--out", "x.png",
                   cwd=tmp_path)
    assert out.returncode == 2
    assert "nowhere" in out.stderr and "Traceback" not in out.stderr
