"""`glassgpt demo` and `glassgpt attention`, called in-process through `glassgpt.cli.main`, at
tiny sizes: what they print, what they write, and their one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import quick_experiment
from glassgpt.cli import demos, main
from glassgpt.config import GPTConfig
from glassgpt.errors import CommandLineError
from glassgpt.experiments import EXPERIMENTS, Check, ExperimentResult
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import load_model, save_model
from glassgpt.tokenizers import CharTokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def glassgpt(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_demo_shapes_prints_table_and_writes_json(tmp_path: Path, capsys,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = glassgpt(capsys, "demo", "shapes", "--out", "pics", "--json", "shapes.json",
                              "--batch-size", "2", "--seq-len", "5", "--d-model", "24",
                              "--n-heads", "3")
    assert code == 0, err
    assert "(2, 3, 5, 8)" in out and "merge heads" in out
    assert "✓ the walk equals the module" in out
    assert "experiments showed" not in out  # the summary is for `demo all`
    data = json.loads((tmp_path / "shapes.json").read_text())
    shapes = data["experiments"]["shapes"]
    assert data["seed"] == 0 and data["quick"] is False
    steps = {row["step"]: row["shape"] for row in shapes["tables"][0]["rows"]}
    assert steps["softmax over keys"] == "(2, 3, 5, 5)"
    assert all(check["holds"] for check in shapes["checks"])
    assert (tmp_path / "pics" / "shapes_weights.png").read_bytes()[:8] == PNG_MAGIC


def test_demo_all_quick_runs_every_experiment_and_sums_up(tmp_path: Path, capsys,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every experiment really runs at its quick size, once per session: each experiment's own
    tests read the same runs (conftest.quick_experiment)."""
    asked = []

    def shared_quick_run(name, out_dir, *, seed, quick, threads, **options):
        asked.append((name, seed, quick, threads, options))
        return quick_experiment(name, out_dir, seed=seed, **options)

    monkeypatch.setattr(demos, "run_experiment", shared_quick_run)
    monkeypatch.chdir(tmp_path)
    code, out, err = glassgpt(capsys, "demo", "all", "--quick", "--out", "pics", "--json",
                              "all.json", "--seed", "0", "--threads", "1")
    assert code == 0, out[-2000:] + err
    assert asked == [(name, 0, True, 1, {}) for name in EXPERIMENTS]
    data = json.loads((tmp_path / "all.json").read_text())
    assert list(data["experiments"]) == ["shapes", "parity", "multihead", "layernorm", "params",
                                         "residual", "dropout", "sharing", "positions", "norms",
                                         "mlps", "kvheads", "qknorm", "induction", "windows",
                                         "features"]
    assert data["seed"] == 0 and data["quick"] is True
    for name, result in data["experiments"].items():
        assert result["checks"] and all(c["holds"] for c in result["checks"]), name
        for picture in result["pictures"]:
            assert (tmp_path / picture).read_bytes()[:8] == PNG_MAGIC
    params = data["experiments"]["params"]["numbers"]
    assert params["gpt2_small_total"] == 124_439_808
    assert "124,439,808" in out
    assert "[block] * L" in out  # printed as written, not eaten as rich markup
    assert out.rstrip().endswith("16/16 experiments showed what they claim")
    run = Path("pics") / "induction_run"  # the run `demo induction` saves, copied into --out
    assert data["experiments"]["induction"]["numbers"]["run"] == str(run)
    assert f"run: {run} (open it with `glassgpt view {run}`" in out
    assert {p.name for p in (tmp_path / run).iterdir()} == {"config.json", "model.safetensors",
                                                           "tokenizer.json"}


def test_demo_all_summary_names_what_was_not_shown(tmp_path: Path, capsys,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_experiment(name: str, out_dir: Path, **_) -> ExperimentResult:
        return ExperimentResult(name=name, summary="fake",
                                checks=[Check("the point", holds=name != "residual")])

    monkeypatch.setattr(demos, "run_experiment", fake_experiment)
    code, out, _ = glassgpt(capsys, "demo", "all", "--out", str(tmp_path))
    assert code == 1
    assert f"{len(EXPERIMENTS) - 1}/{len(EXPERIMENTS)} experiments showed what they claim" in out
    assert "expected outcome not shown by: residual" in out


@pytest.mark.parametrize(("args", "message"), [
    (["demo", "nope"], "invalid choice: 'nope'"),
    (["demo", "parity", "--seq-len", "3"],
     "--seq-len only applies to `glassgpt demo shapes`, not to `glassgpt demo parity`"),
    (["demo", "params", "--d-model", "32", "--n-heads", "2"],
     "--d-model and --n-heads only apply to `glassgpt demo shapes`, not to `glassgpt demo "
     "params`"),
    (["demo", "shapes", "--d-model", "10", "--n-heads", "4"],
     "d_model=10 is not divisible by n_heads=4"),
    (["demo", "parity", "--snapshots", "5"],
     "--snapshots only applies to `glassgpt demo features`, not to `glassgpt demo parity`"),
    (["demo", "features", "--snapshots", "2"], "--snapshots must be at least 3"),
])
def test_demo_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, args: list[str],
                                              message: str) -> None:
    code, _, err = glassgpt(capsys, *args, "--out", str(tmp_path / "pics"))
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_demo_features_takes_snapshots(tmp_path: Path, capsys,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_experiment(name: str, out_dir: Path, **options) -> ExperimentResult:
        seen.update(options)
        return ExperimentResult(name=name, summary="fake")

    monkeypatch.setattr(demos, "run_experiment", fake_experiment)
    code, _, _ = glassgpt(capsys, "demo", "features", "--snapshots", "12", "--quick",
                          "--out", str(tmp_path))
    assert code == 0 and seen["snapshots"] == 12


def test_demo_induction_replaces_no_run_dir_it_did_not_make_before_it_trains(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demos, "run_experiment", lambda *a, **k: pytest.fail("it trained"))
    mine = tmp_path / "pics" / "induction_run"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    for force in ([], ["--force"]):  # not even --force: no glassgpt run is there
        code, _, err = glassgpt(capsys, "demo", "induction", "--out", str(tmp_path / "pics"),
                                *force)
        assert code == 2 and "induction_run" in err, err
        assert len(err.strip().splitlines()) == 1
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_saved_run_replaces_an_earlier_run_only_with_force(tiny_run: Path,
                                                             tmp_path: Path) -> None:
    new_run = tmp_path / "staged" / "induction_run"
    save_model(new_run, GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=1,
                                      n_embd=8)), CharTokenizer.from_text("abcdefgh"))
    out = tmp_path / "out"
    assert demos.deliver_run(new_run, out, force=False) == out / "induction_run"  # a new one
    saved = (out / "induction_run" / "config.json").read_bytes()
    shutil.rmtree(out / "induction_run")
    shutil.copytree(tiny_run, out / "induction_run")  # a run made before, by someone else
    with pytest.raises(CommandLineError, match="already exists; pass --force"):
        demos.deliver_run(new_run, out, force=False)
    assert (out / "induction_run" / "config.json").read_bytes() != saved  # left as it was
    demos.deliver_run(new_run, out, force=True)
    assert (out / "induction_run" / "config.json").read_bytes() == saved
    assert load_model(out / "induction_run")[0].config.vocab_size == 8


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding a tiny random character-level model: 2 layers x 4 heads."""
    tokenizer = CharTokenizer.from_text("to be or not, that is the question")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=4,
                          n_embd=16))
    run_dir = tmp_path_factory.mktemp("attention") / "run"
    save_model(run_dir, model, tokenizer)
    return run_dir


def test_attention_says_what_it_drew(tiny_run: Path, tmp_path: Path, capsys) -> None:
    code, out, err = glassgpt(capsys, "attention", str(tiny_run), "--prompt", "to be or not",
                              "--out", str(tmp_path / "all.png"))
    assert code == 0, err
    assert out == f"attention maps of 2 layers x 4 heads over 12 tokens written to " \
                  f"{tmp_path / 'all.png'}\n"
    assert (tmp_path / "all.png").read_bytes()[:8] == PNG_MAGIC
    code, out, err = glassgpt(capsys, "attention", str(tiny_run), "--prompt", "t", "--layer",
                              "1", "--head", "3", "--out", str(tmp_path / "one.png"))
    assert code == 0, err
    assert out == f"attention maps of layer 1, head 3 over 1 token written to " \
                  f"{tmp_path / 'one.png'}\n"
    assert (tmp_path / "one.png").stat().st_size < (tmp_path / "all.png").stat().st_size


@pytest.mark.parametrize(("layer", "head", "words"), [
    (None, None, "4 layers x 6 heads"), (1, 3, "layer 1, head 3"),
    (2, None, "6 heads of layer 2"), (None, 0, "head 0 of 4 layers"),
    (None, None, "1 layer x 1 head"),
])
def test_attention_names_the_selection(layer: int | None, head: int | None, words: str) -> None:
    L, H = (1, 1) if words.startswith("1 layer") else (4, 6)
    assert demos.drawn_panels(L, H, layer, head) == words


def test_attention_splits_a_long_prompt_per_layer(tiny_run: Path, tmp_path: Path,
                                                  capsys) -> None:
    prompt = "to be or not to be, that is the question"  # 40 tokens: 4 heads no longer fit
    code, out, err = glassgpt(capsys, "attention", str(tiny_run), "--prompt", prompt, "--out",
                              str(tmp_path / "long.png"))
    assert code == 0, err
    pictures = [tmp_path / "long_layer0.png", tmp_path / "long_layer1.png"]
    assert out.splitlines() == [
        "attention maps of 2 layers x 4 heads over 40 tokens written to 2 pictures (one grid "
        "would shrink the labels):", *(f"  {p}" for p in pictures)]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pictures)
    assert not (tmp_path / "long.png").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt", "to be", "--layer", "2"], "layer 2 does not exist: the model has layers 0..1"),
    (["--prompt", "to be", "--head", "4"], "head 4 does not exist: the model has heads 0..3"),
    (["--prompt", "zebra"], "not in the tokenizer's vocabulary: 'z'; a character tokenizer "
                            "knows only the characters of the text it was made from: remove "
                            "these, or prepare the data with --tokenizer bpe"),
    (["--prompt", "to be " * 11], "longer than block_size=64"),
])
def test_attention_bad_input_is_one_line_and_exit_2(tiny_run: Path, tmp_path: Path, capsys,
                                                   args: list[str], message: str) -> None:
    code, _, err = glassgpt(capsys, "attention", str(tiny_run), *args, "--out",
                            str(tmp_path / "x.png"))
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_attention_missing_run_dir_is_a_clear_error(tmp_path: Path, capsys) -> None:
    code, _, err = glassgpt(capsys, "attention", str(tmp_path / "nowhere"), "--prompt", "a",
                            "--out", str(tmp_path / "x.png"))
    assert code == 2
    assert "nowhere" in err and "Traceback" not in err


def test_attention_writes_beside_the_demos_pictures_by_default(tiny_run: Path, tmp_path: Path,
                                                               capsys, monkeypatch) -> None:
    """`demo` has a default --out; `attention` had none and refused to run without one."""
    monkeypatch.chdir(tmp_path)
    code, out, err = glassgpt(capsys, "attention", str(tiny_run), "--prompt", "to be")
    assert code == 0, err
    assert out.endswith(f"written to {Path('demo_out') / 'attention.png'}\n")
    assert (tmp_path / "demo_out" / "attention.png").read_bytes()[:8] == PNG_MAGIC


# --- tables in a file or a pipe -----------------------------------------------------------

def wide_report():
    from glassgpt import bench

    speeds = [bench.TrainSpeed(f"preset-with-a-long-name-{i}", "glassgpt-compiled", "bfloat16",
                               12, 64, 0.0, 0.123456, 123456.7, 1.2e6, 0.4321, 1e12)
              for i in range(2)]
    return bench.BenchReport({"cpu": "a CPU", "cores": 2, "threads": 2, "torch": "2"},
                             bench.MachineLimits(1e12, 1e10), train=speeds)


def test_tables_in_a_file_or_a_pipe_are_not_cut_at_80_columns(capsys, monkeypatch) -> None:
    """`glassgpt bench > out.txt`: rich assumed 80 columns off a terminal and folded cells."""
    from glassgpt.cli.benchmark import print_report
    from glassgpt.cli.common import output_console

    monkeypatch.delenv("COLUMNS", raising=False)
    print_report(wide_report(), output_console())
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│ preset-with-a-long-name-0")]
    assert len(rows) == 1 and len(rows[0]) > 80, out  # the whole row on one line
    assert "glassgpt-compiled" in rows[0] and "123,457" in rows[0]
    monkeypatch.setenv("COLUMNS", "60")  # a width the user asked for is kept
    assert output_console().width == 60


def test_a_demo_in_a_pipe_keeps_its_rule_short(capsys, monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    console = demos.output_console()
    demos.print_result(console, ExperimentResult(name="x", summary="y"), 0.1)
    rule = capsys.readouterr().out.splitlines()[0]
    assert len(rule) == demos.RULE_WIDTH
