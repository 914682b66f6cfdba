"""Issue 27, the outputs and the ladder: where a command's output file may land, what a library
function makes of an empty path, the bounds of `bench ladder`, Ctrl-C in-process, the quick
ladder's table, and progress for the silent minutes (demos, prepare).

Everything runs in this process through `glassgpt.cli.main` or the library, on one tiny run
trained once for the module. Each test names the problem of the issue it covers.
"""

from __future__ import annotations

import _thread
import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from glassgpt.bench import ladder
from glassgpt.cli import main
from glassgpt.data import TINYSHAKESPEARE_ENV, prepare
from glassgpt.errors import ConfigError, DataError
from helpers_dirs import assert_unchanged, snapshot

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-iters", "1", "--log-interval", "1", "--device", "cpu",
        "--threads", "1"]
TEXT = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(120))
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    assert main(["prepare", "--text", str(root / "text.txt"), "--out", str(root / "data")]) == 0
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"), *TINY,
                 "--max-iters", "2", "--eval-interval", "2"]) == 0
    return {"root": root, "run": root / "run", "data": root / "data",
            "text": root / "text.txt"}


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


# --- 2. an output never lands on a file of a run ------------------------------------------

@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "forced"])
def test_attention_out_never_replaces_a_file_of_the_run(place, force, capsys):
    before = snapshot(place["run"])
    out = place["run"] / "model.safetensors"
    assert main(["attention", str(place["run"]), "--prompt", "To be", "--out", str(out),
                 *force]) == 2
    assert "model.safetensors" in one_error_line(capsys)
    assert_unchanged(before, snapshot(place["run"]))


# --- 4. an existing output file is replaced only with --force ------------------------------

def _no_ladder_training(monkeypatch) -> None:
    """The ladder refuses before it trains, or this test fails at once (not after minutes)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the ladder started training")

    monkeypatch.setattr(ladder, "run_ladder", refuse)
    monkeypatch.setattr("glassgpt.training.runs.training_data", lambda *a, **k: None)


@pytest.mark.parametrize("command", ["attention", "demo --json", "bench --json",
                                     "ladder --plot", "ladder default plot"])
def test_an_existing_output_file_is_kept_without_force(place, command, tmp_path, monkeypatch,
                                                       capsys):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / ("ladder.png" if command == "ladder default plot" else "mine.out")
    mine.write_text("the user's own file")
    _no_ladder_training(monkeypatch)
    argv = {"attention": ["attention", str(place["run"]), "--prompt", "To", "--out", str(mine)],
            "demo --json": ["demo", "shapes", "--json", str(mine), "--out", str(tmp_path)],
            "bench --json": ["bench", "ladder", "--quick", "--json", str(mine), "--plot",
                             str(tmp_path / "new.png")],
            "ladder --plot": ["bench", "ladder", "--quick", "--plot", str(mine)],
            "ladder default plot": ["bench", "ladder", "--quick"]}[command]
    assert main(argv) == 2
    assert "--force" in one_error_line(capsys)
    assert mine.read_text() == "the user's own file"


def test_force_replaces_an_existing_output_file(tmp_path, capsys):
    mine = tmp_path / "numbers.json"
    mine.write_text("old")
    assert main(["demo", "shapes", "--json", str(mine), "--out", str(tmp_path),
                 "--force"]) == 0
    assert json.loads(mine.read_text())["experiments"]["shapes"]


def test_a_demo_never_draws_over_a_picture_it_did_not_just_make(tmp_path, capsys):
    """A picture already in --out (the user's, or an earlier demo's) is kept without --force:
    the demo draws into a folder of its own inside --out and moves only what may be replaced."""
    mine = tmp_path / "shapes_weights.png"
    mine.write_bytes(b"the user's own picture")
    assert main(["demo", "shapes", "--out", str(tmp_path)]) == 2
    assert "--force" in one_error_line(capsys)
    assert mine.read_bytes() == b"the user's own picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes_weights.png"]  # no leftovers
    assert main(["demo", "shapes", "--out", str(tmp_path), "--force"]) == 0
    assert mine.read_bytes().startswith(b"\x89PNG")


# --- 6. an empty path in the library ------------------------------------------------------

def test_library_functions_refuse_an_empty_path(place, tmp_path, monkeypatch):
    from glassgpt.training.lifecycle import train_run

    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match="empty path"):
        prepare("", place["text"])
    with pytest.raises(ConfigError, match="empty path"):
        train_run("", data=place["data"], model={"n_layer": 1, "n_head": 2, "n_embd": 16,
                                                 "block_size": 16},
                  train={"max_iters": 1, "batch_size": 2, "eval_iters": 1, "device": "cpu"},
                  threads=1)
    assert_unchanged(before, snapshot(tmp_path))


# --- 10 and 13: a ladder that cannot finish, or cannot be reached --------------------------

@pytest.mark.parametrize("flags", [["--seeds", "1000000000"], ["--recheck-close", "1000000"],
                                   ["--target-loss=-1"], ["--target-loss", "0"],
                                   ["--target-loss", "nan"]])
def test_a_ladder_that_cannot_finish_is_refused_before_it_trains(flags, tmp_path, monkeypatch,
                                                                 capsys):
    _no_ladder_training(monkeypatch)
    assert main(["bench", "ladder", "--quick", "--plot", str(tmp_path / "l.png"), *flags]) == 2
    err = one_error_line(capsys)
    assert ("--target-loss" in err) if "target" in flags[0] else (str(ladder.MAX_SEEDS) in err)


def test_the_ladder_library_refuses_the_same():
    for kwargs in ({"seeds": 10**9}, {"recheck_close": 10**9}, {"target_loss": -1.0}):
        with pytest.raises(ConfigError):
            ladder.run_ladder(None, **kwargs)


# --- 22. Ctrl-C reaches the caller of an in-process main ----------------------------------

def test_an_interrupt_reaches_an_in_process_caller_and_the_process_exits_130(monkeypatch,
                                                                             capsys):
    from glassgpt.cli import prepare as prepare_command

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_command, "run_prepare", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["prepare", "--out", "somewhere"])
    assert capsys.readouterr().err == "interrupted\n"
    monkeypatch.setattr(sys, "argv", ["glassgpt", "prepare", "--out", "somewhere"])
    assert main() == 130  # the console script: quietly, with 130
    assert capsys.readouterr().err == "interrupted\n"


def test_ctrl_c_in_in_process_training_saves_then_reaches_the_caller(place, tmp_path, capsys):
    run = tmp_path / "run"

    def press_ctrl_c() -> None:
        deadline = time.monotonic() + 60
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        _thread.interrupt_main()  # what Ctrl-C does: SIGINT's handler, in the main thread

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        main(["train", "--data", str(place["data"]), "--out", str(run), *TINY,
              "--max-iters", "1000000", "--eval-interval", "1000000"])
    err = capsys.readouterr().err
    assert "checkpoint saved" in err and "Traceback" not in err
    assert (run / "train_state.json").is_file()


# --- 23. the quick ladder says something, in 80 columns ----------------------------------

def test_the_quick_ladder_reaches_its_target_from_the_base_rung(tmp_path, monkeypatch,
                                                                shakespeare_path):
    monkeypatch.setenv(TINYSHAKESPEARE_ENV, str(shakespeare_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "ladder.json"
    assert main(["bench", "ladder", "--quick", "--rungs", "nanogpt", "--json", str(out),
                 "--plot", str(tmp_path / "ladder.png")]) == 0
    (rung,) = json.loads(out.read_text())["rungs"]
    assert rung["seconds_to_target"] is not None, rung["runs"][0]["curve"]


def fake_report() -> ladder.LadderReport:
    rungs = []
    for i, (name, *_) in enumerate(ladder.LADDER):
        run = ladder.RungRun(1, True, 15, 1.5 + i, 15, 2.0, 1000.0, 3.4, 3.45,
                             [(0.0, 4.2), (1.5, 3.4)], 0.2, 2.0)
        rungs.append(ladder.RungResult(name, "a change", 15_000, {}, {}, None, [run]))
    rungs[-2].runs, rungs[-2].skipped = [], "left out of --quick (compiling takes a minute)"
    ladder.judge_gains(rungs)
    machine = {"cpu": "a CPU", "cores": 2, "torch": "2", "load_before": 0.1, "load_after": 0.2}
    return ladder.LadderReport(machine, 3.5, True, rungs, 12.0)


def test_the_ladder_table_fits_80_columns(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(ladder, "run_ladder", lambda *a, **k: fake_report())
    monkeypatch.setattr(ladder, "plot_ladder", lambda report, path: path)
    monkeypatch.setattr("glassgpt.training.runs.training_data", lambda *a, **k: None)
    assert main(["bench", "ladder", "--quick", "--plot", str(tmp_path / "l.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    table = [line for line in lines if line.startswith("│")]
    for name, *_ in ladder.LADDER:  # each rung on one row, its name whole
        assert any(re.match(rf"│ {re.escape(name)} +│", line) for line in table), name


def test_help_and_docs_give_the_same_measured_time_for_the_quick_ladder(capsys):
    docs = (DOCS / "time-to-loss.md").read_text()
    time_in_docs = re.search(r"bench ladder --quick +# the same rungs at a toy size: (.+)",
                             docs).group(1).strip()
    assert re.search(r"\d", time_in_docs), time_in_docs  # a measured time, not "seconds"
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"ladder[^.;]*" + re.escape(time_in_docs), help_text), help_text


# --- 24. progress for the silent minutes --------------------------------------------------

class _Copier(nn.Module):
    """idx (B, T) -> logits (B, T, 1, V): the smallest model train_copier trains."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table(idx).unsqueeze(2)  # (B, T, 1, V)


def test_the_demos_training_steps_can_be_watched():
    from glassgpt.experiments.results import listening_to_steps
    from glassgpt.experiments.tasks import train_copier

    heard = []
    with listening_to_steps(lambda: heard.append(1)):
        train_copier(_Copier(8), (1,), 8, 6, 5, 2, 1e-2, torch.Generator().manual_seed(0))
    assert len(heard) == 5


def test_prepare_reports_the_text_it_has_read(place, tmp_path):
    calls = []
    prepare(tmp_path / "data", place["text"], progress=lambda done, total: calls.append(
        (done, total)))
    size = len(TEXT.encode())
    assert calls and calls[-1] == (2 * size, 2 * size)  # two passes: fit, then encode
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:], strict=False))


# --- prepare --force replaces only data glassgpt prepared ---------------------------------

def test_prepare_force_never_replaces_another_tools_data(place, tmp_path, capsys):
    theirs = tmp_path / "nanogpt_data"
    theirs.mkdir()
    (theirs / "train.bin").write_bytes(b"\x01\x00" * 64)
    (theirs / "val.bin").write_bytes(b"\x02\x00" * 16)
    (theirs / "meta.json").write_text('{"vocab_size": 65}')
    before = snapshot(theirs)
    assert main(["prepare", "--text", str(place["text"]), "--out", str(theirs), "--force"]) == 2
    assert "--force does not replace it" in one_error_line(capsys)
    assert_unchanged(before, snapshot(theirs))
    ours = tmp_path / "ours"  # glassgpt's own data, even one written before the format mark
    prepare(ours, place["text"])
    meta = json.loads((ours / "meta.json").read_text())
    del meta["format"]
    (ours / "meta.json").write_text(json.dumps(meta))
    assert main(["prepare", "--text", str(place["text"]), "--out", str(ours), "--force"]) == 0
