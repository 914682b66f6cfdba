"""A run's timeline (issue 55, item 2): every snapshot's head scores equal the same scores read
on that snapshot loaded as a run, the losses and ICL score follow their stated definitions, the
LLC is estimated through its one call site, and `glassgpt timeline` writes the JSON and the
picture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from glassgpt.cli import main
from glassgpt.data import prepare
from glassgpt.errors import CheckpointError, InputError
from glassgpt.interp.methods.attribution import logit_attribution
from glassgpt.interp.methods.scores import head_scores
from glassgpt.interp.timeline.llc import LLCSettings
from glassgpt.interp.timeline.settings import TimelineSettings
from glassgpt.interp.timeline.timeline import (
    check_replaceable,
    halfway_step,
    icl_indices,
    run_timeline,
)
from glassgpt.rundir.checkpoint import Run
from glassgpt.training.lifecycle import train_run

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16}
TRAIN = {"batch_size": 2, "eval_iters": 1, "log_interval": 1, "device": "cpu",
         "eval_interval": 6, "max_iters": 6, "snapshots": 3}
TEXT = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(100))
SETTINGS = TimelineSettings(sequences=6, score_batch=2, probe_half=4)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("timeline")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare(root / "data", root / "text.txt")
    train_run(root / "run", data=root / "data", model=MODEL, train=TRAIN, threads=1)
    return root / "run"


@pytest.mark.slow
def test_each_snapshot_reads_as_the_snapshot_loaded_as_a_run(run: Path) -> None:
    timeline = run_timeline(run, SETTINGS)
    assert timeline.steps == [0, 1, 6]
    probe, answer = torch.tensor([timeline.probe["tokens"]]), timeline.probe["answer"]
    assert probe[0, :3].tolist() == probe[0, 4:7].tolist() and answer == probe[0, 3].item()
    windows = timeline_windows(run)
    for step, record in zip(timeline.steps, timeline.records, strict=True):
        model, _ = Run(run).load_model(checkpoint=f"step:{step}")
        scores = head_scores(model, batch=2, seed=0)
        for kind in ("previous_token", "duplicate_token", "induction"):
            assert record["scores"][kind] == getattr(scores, kind).tolist()
        attribution = logit_attribution(model, probe, answer)
        assert record["attribution"]["heads"] == attribution.heads.tolist()
        with torch.no_grad():
            logits, _ = model(windows[:, :-1])  # (N, T, V)
        losses = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none")
        assert record["val_loss"] == pytest.approx(losses.mean().item(), rel=1e-6)
        late, early = timeline.icl["late_index"], timeline.icl["early_index"]
        assert record["icl_score"] == pytest.approx(
            (losses[:, late - 1].mean() - losses[:, early - 1].mean()).item(), abs=1e-6)


def timeline_windows(run: Path) -> torch.Tensor:
    from glassgpt.interp.timeline.timeline import data_windows

    return data_windows(Run(run), SETTINGS)["val"]


def test_the_icl_indices_scale_olssons_to_the_context() -> None:
    assert icl_indices(1024, TimelineSettings()) | {"definition": ""} == {
        "late_index": 500, "early_index": 50, "context": 1024, "definition": ""}
    found = icl_indices(64, TimelineSettings())
    assert (found["late_index"], found["early_index"]) == (31, 3)
    assert "500th minus 50th token of 1024" in found["definition"]
    assert icl_indices(32, TimelineSettings(icl_late=1.0))["late_index"] == 32
    with pytest.raises(InputError, match="no room"):
        icl_indices(4, TimelineSettings(icl_early=0.1, icl_late=0.2))


def test_the_phase_change_is_the_halfway_crossing() -> None:
    assert halfway_step([0, 10, 20, 40, 80], [0.1, 0.12, 0.3, 0.8, 0.7]) == 40
    assert halfway_step([0, 10, 20], [0.2, 0.25, 0.22]) is None  # moved less than 0.1


@pytest.mark.slow
def test_timeline_writes_its_json_and_picture(run: Path, capsys) -> None:
    assert main(["timeline", str(run), "--plot", "--sequences", "4", "--score-batch", "2"]) == 0
    content = json.loads((run / "timeline.json").read_text())
    assert content["steps"] == [0, 1, 6] and (run / "timeline.png").stat().st_size > 0
    assert content["icl"]["context"] == 16 and "Olsson" in content["icl"]["definition"]
    assert "phase change" in capsys.readouterr().out


@pytest.mark.slow
def test_the_llc_is_estimated_at_each_snapshot_with_its_settings(run: Path) -> None:
    llc = LLCSettings(num_chains=2, num_draws=3, batch_size=2, num_init_loss_batches=1)
    timeline = run_timeline(run, TimelineSettings(sequences=4, score_batch=1, llc=True,
                                                  llc_settings=llc))
    estimates = timeline.series("llc")
    assert len(estimates) == 3 and all(len(e["step_losses"]) == 2 for e in estimates)
    assert estimates[0]["settings"]["num_draws"] == 3 and "describe" in estimates[0]
    assert timeline.to_json()["settings"]["llc_settings"]["num_chains"] == 2


def test_a_run_without_snapshots_is_one_clear_error(run: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    train_run(bare, data=Run(run).data_dir, model=MODEL, threads=1,
              train={**TRAIN, "max_iters": 1, "snapshots": 0})
    with pytest.raises(CheckpointError, match="keeps no snapshots; train it with --snapshots"):
        run_timeline(bare, SETTINGS)
    with pytest.raises(InputError, match="definition must be one of"):
        run_timeline(run, TimelineSettings(definition="mine"))


def test_the_file_holds_json_any_reader_parses_and_windows_are_checked() -> None:
    from glassgpt.interp.timeline.timeline import check_windows, finite_or_null

    assert finite_or_null({"a": [1.0, float("nan")], "b": (float("inf"), 2)}) == {
        "a": [1.0, None], "b": [None, 2]}
    assert check_windows({"val": torch.zeros(3, 9, dtype=torch.long)}, block_size=8) == 8
    for bad in ({"val": torch.zeros(3, 9)}, {"val": torch.zeros(3, 10, dtype=torch.long)},
                {"a": torch.zeros(3, 9, dtype=torch.long), "b": torch.zeros(3, 5,
                                                                         dtype=torch.long)}, {}):
        with pytest.raises(InputError):
            check_windows(bad, block_size=8)


def test_a_timeline_glassgpt_did_not_write_is_never_replaced(run: Path, tmp_path: Path,
                                                             capsys) -> None:
    """timeline.json and timeline.png are replaced only when glassgpt wrote them, checked by
    the JSON's format before any snapshot is read."""
    check_replaceable(tmp_path, plot=True)  # nothing there: fine
    (tmp_path / "timeline.json").write_text('{"format": "glassgpt-timeline/1"}')
    (tmp_path / "timeline.png").write_bytes(b"ours")
    check_replaceable(tmp_path, plot=True)  # glassgpt's: replaced
    (tmp_path / "timeline.json").unlink()
    with pytest.raises(InputError, match="timeline.png is there without"):
        check_replaceable(tmp_path, plot=True)
    check_replaceable(tmp_path, plot=False)  # the picture is not written: left alone
    mine = shutil.copytree(run, tmp_path / "mine")
    (mine / "timeline.json").write_text('{"my": "notes"}')
    assert main(["timeline", str(mine), "--sequences", "4", "--score-batch", "2"]) != 0
    assert "is not a timeline glassgpt wrote" in capsys.readouterr().err
    assert (mine / "timeline.json").read_text() == '{"my": "notes"}'

