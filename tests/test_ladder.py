"""`glassgpt bench ladder`: the rungs, the verdicts, the --quick run with its JSON and picture,
and the cpu-speedrun preset the ladder chose."""

from __future__ import annotations

import json

import pytest

from glassgpt.bench import ladder
from glassgpt.cli import main
from glassgpt.config import QUICK_TARGET, GPTConfig, TrainConfig, load_preset
from glassgpt.data import TINYSHAKESPEARE_ENV
from glassgpt.model import GPT, count_parameters

RUN_KEYS = {"seed", "reached", "steps", "seconds", "iterations", "total_seconds",
            "tokens_per_s", "val_loss", "full_val_loss", "curve", "overhead_share",
            "cpu_seconds"}
RUNG_KEYS = {"name", "change", "parameters", "model", "train", "threads", "runs", "skipped",
             "gain_over_previous", "gain_over_base", "verdict", "seconds_to_target",
             "seconds_range", "steps_to_target", "tokens_per_s", "final_val_loss",
             "full_val_loss", "cpu_seconds"}


def test_each_rung_adds_its_own_change_to_the_one_before():
    rungs = ladder.ladder_rungs()
    assert [r.name for r in rungs] == [name for name, *_ in ladder.LADDER]
    base = load_preset(ladder.BASE_PRESET)
    assert rungs[0].model == base["model"] and rungs[0].train == base["train"]
    for before, rung, (_, _, model_change, train_change, _) in zip(
            rungs, rungs[1:], ladder.LADDER[1:], strict=False):
        assert rung.model == {**before.model, **model_change}
        assert rung.train == {**before.train, **train_change}
    for rung in rungs:
        if not ladder.missing_switches(rung):
            config = GPTConfig.from_dict({**rung.model, "vocab_size": 65})
            assert config.block_size == 64
            assert count_parameters(GPT(config)) <= ladder.MAX_PARAMETERS


def test_every_rung_gets_the_same_evaluation_per_token():
    for rung in ladder.ladder_rungs():
        _, cfg = ladder.rung_settings(rung, 1.88, quick=False, seed=1)
        tokens = cfg.batch_size * rung.model["block_size"]
        assert cfg.eval_interval * tokens == pytest.approx(ladder.EVAL_TOKENS, rel=0.05)
        assert cfg.eval_iters * tokens == pytest.approx(ladder.EVAL_VAL_TOKENS, rel=0.05)
        assert cfg.target_loss == 1.88 and cfg.seed == 1


def result(name: str, *seconds: float | None) -> ladder.RungResult:
    runs = [ladder.RungRun(seed, s is not None, 10 if s else None, s, 10, s or 9.0, 1.0, 1.9,
                           1.9, []) for seed, s in enumerate(seconds)]
    return ladder.RungResult(name, "", 1, {}, {}, None, runs)


def test_verdicts_say_when_a_gain_is_within_noise():
    rungs = [result("base", 100.0), result("a", 50.0), result("b", 47.0),
             result("c", 30.0, 32.0, 31.0), result("d", 29.0, 31.5, 35.0),
             result("e", 20.0, 22.0, 21.0), result("f", None)]
    ladder.judge_gains(rungs)
    assert [r.verdict for r in rungs] == ["base", "faster", "close", "faster", "within noise",
                                          "faster", "target not reached"]
    assert rungs[1].gain_over_previous == 2.0 and rungs[5].gain_over_base == pytest.approx(100 / 21)
    assert rungs[6].gain_over_base is None


def test_quick_ladder_writes_its_table_json_and_picture(tmp_path, monkeypatch, capsys,
                                                       shakespeare_path):
    monkeypatch.setenv(TINYSHAKESPEARE_ENV, str(shakespeare_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out, picture = tmp_path / "ladder.json", tmp_path / "ladder.png"
    # The base, Muon, and the last rung (every model switch at once), to keep the test short.
    rungs = ["nanogpt", "muon", "compile", ladder.LADDER[-1][0]]
    assert main(["bench", "ladder", "--quick", "--json", str(out), "--plot", str(picture),
                 "--rungs", *rungs]) == 0
    printed = capsys.readouterr().out
    assert "Time to val loss" in printed and "nanogpt" in printed
    report = json.loads(out.read_text())
    assert report["quick"] and report["target_loss"] == QUICK_TARGET
    assert [r["name"] for r in report["rungs"]] == rungs
    ran = [r for r in report["rungs"] if r["skipped"] is None]
    assert len(ran) == 3
    for rung in report["rungs"]:
        assert set(rung) == RUNG_KEYS
        for run in rung["runs"]:
            assert set(run) == RUN_KEYS
            assert run["curve"][0][1] > QUICK_TARGET  # iteration 0: not yet
            if run["reached"]:  # stopped at the first evaluation at or below the target
                evals = [loss for _, loss in run["curve"]]
                assert evals[-1] <= QUICK_TARGET < min(evals[:-1])
                assert run["steps"] % ladder.QUICK_TRAIN["eval_interval"] == 0
                assert 0 < run["seconds"] <= run["total_seconds"]
    assert any(r["seconds_to_target"] for r in ran)  # some rung reached the target
    assert next(r for r in report["rungs"] if r["name"] == "compile")["skipped"]
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--seeds", "0"], ["--rungs", "warp-drive"]])
def test_bad_ladder_flags_are_one_line_errors(argv, capsys):
    assert main(["bench", "ladder", "--quick", *argv]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cpu_speedrun_preset_is_the_ladders_best_rung_and_stops_at_the_target():
    preset = load_preset(ladder.SPEEDRUN_PRESET)
    best = ladder.ladder_rungs()[-1]
    assert preset["model"] == best.model
    train = TrainConfig.from_dict(preset["train"])
    # Its own 15,360-token evaluation reads about 0.02 below the whole val split: it stops
    # lower, so that `glassgpt eval` of the run says the ladder's target there.
    assert train.target_loss == ladder.SPEEDRUN_TARGET < ladder.TARGET_LOSS
    recipe = {k: v for k, v in best.train.items() if k not in ("eval_interval", "eval_iters")}
    recipe.update(ladder.SPEEDRUN_LEAVES_OUT)
    assert {k: preset["train"][k] for k in recipe} == recipe
    assert set(preset["train"]) - set(recipe) == {"eval_interval", "eval_iters", "target_loss"}
    config = GPTConfig.from_dict({**preset["model"], "vocab_size": 65})
    assert config.block_size == 64 and count_parameters(GPT(config)) <= ladder.MAX_PARAMETERS


def test_train_with_the_speedrun_preset_stops_at_its_target_and_says_where(tmp_path, capsys,
                                                                           small_text):
    """`glassgpt train --preset cpu-speedrun` at a toy size, with a target it reaches at the
    first evaluation: it stops there and the summary says at which iteration."""
    from glassgpt.data import prepare

    prepare(tmp_path / "data", small_text)
    argv = ["train", "--preset", "cpu-speedrun", "--data", str(tmp_path / "data"), "--out",
            str(tmp_path / "run"), "--n-layer", "1", "--n-embd", "32", "--block-size", "16",
            "--batch-size", "4", "--eval-interval", "3", "--eval-iters", "1",
            "--target-loss", "100", "--threads", "1", "--schedule", "wsd",
            "--decay-fraction", "0.3"]
    assert main(argv) == 0
    # Met by the evaluation at step 0 already: it stops there, before any step (issue 27).
    assert "target val loss already met at iteration 0" in capsys.readouterr().out
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["train"]["optimizer"] == "muon" and config["model"]["position"] == "rope"
    assert config["train"]["schedule"] == "wsd"
    assert main(["eval", str(tmp_path / "run"), "--max-batches", "1"]) == 0


def test_recheck_close_gives_close_rungs_and_the_one_before_more_seeds(monkeypatch):
    """With one seed, "muon" is within 10% of "tuned-lr": --recheck-close 3 trains both from
    three seeds and judges by their ranges; the rungs that were clearly faster keep one."""
    seconds = {"nanogpt": [100.0], "tuned-lr": [50.0, 40.0, 60.0], "muon": [48.0, 52.0, 45.0]}
    calls = []

    def fake_train(rung, data, target, quick, seed):
        calls.append((rung.name, seed))
        s = seconds[rung.name][seed - 1]
        return ladder.RungRun(seed, True, 10, s, 10, s, 1.0, 1.8, 1.8, [(s, 1.8)]), 1

    monkeypatch.setattr(ladder, "train_rung", fake_train)
    report = ladder.run_ladder(None, seed=1, recheck_close=3,
                               only=["nanogpt", "tuned-lr", "muon"])
    assert sorted(calls) == [("muon", 1), ("muon", 2), ("muon", 3), ("nanogpt", 1),
                             ("tuned-lr", 1), ("tuned-lr", 2), ("tuned-lr", 3)]
    assert [r.verdict for r in report.rungs] == ["base", "faster", "within noise"]
