"""Weight snapshots while training (issue 55, item 1): the log-spaced steps, the files and their
index, a snapshot opened as any checkpoint (`step:N`), bit-equal to the weights a run trained to
that step holds, and the rest of the run reproduced exactly by resuming such a run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from glassgpt.cli import build_parser
from glassgpt.data import prepare
from glassgpt.errors import CheckpointError, CommandLineError, ConfigError
from glassgpt.rundir.checkpoint import Run
from glassgpt.rundir.snapshots import list_snapshots, read_index, snapshot_steps
from glassgpt.storage.layout import MODEL_FILE, SNAPSHOTS_DIR
from glassgpt.training.lifecycle import train_run

MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}
# lr_decay_iters fixed, so that a run stopped early at step k follows the same schedule.
TRAIN = {"batch_size": 2, "eval_iters": 1, "log_interval": 1, "device": "cpu",
         "eval_interval": 6, "lr_decay_iters": 12, "warmup_iters": 2}
TEXT = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(100))


def test_steps_follow_the_stated_rule() -> None:
    assert snapshot_steps(5, 12) == [0, 1, 2, 5, 12]
    assert snapshot_steps(10, 2000) == [0, 1, 4, 11, 28, 67, 157, 368, 858, 2000]
    assert snapshot_steps(0, 100) == [] and snapshot_steps(1, 7) == [7]
    assert snapshot_steps(12, 5) == [0, 1, 2, 3, 4, 5]  # more asked than steps: every step
    for count, total in ((20, 10_000), (64, 300), (300, 300), (7, 6)):
        steps = snapshot_steps(count, total)
        assert len(steps) == min(count, total + 1) and steps[0] == 0 and steps[-1] == total
        assert all(b > a for a, b in zip(steps, steps[1:], strict=False))
        n = len(steps)  # within one step of the curve, log-spaced in step + 1
        assert all(0 <= max(i, (total + 1) ** (i / (n - 1)) - 1) - step < 1
                   for i, step in enumerate(steps))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`whole`: 12 steps with 5 snapshots; `part`: the same recipe stopped at step 5, then
    resumed to 12 (`resumed`)."""
    root = tmp_path_factory.mktemp("snapshots")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare(root / "data", root / "text.txt")
    common = dict(data=root / "data", model=MODEL, threads=1)
    train_run(root / "whole", train={**TRAIN, "max_iters": 12, "snapshots": 5}, **common)
    train_run(root / "part", train={**TRAIN, "max_iters": 5, "snapshots": 5}, **common)
    shutil.copytree(root / "part", root / "resumed")
    train_run(root / "resumed", resume=True, train={"max_iters": 12, "snapshots": 5},
              threads=1)
    return {"whole": root / "whole", "part": root / "part", "resumed": root / "resumed",
            "data": root / "data"}


def test_a_run_keeps_its_snapshots_and_says_what_they_cost(runs: dict[str, Path]) -> None:
    assert list_snapshots(runs["whole"]) == [0, 1, 2, 5, 12]
    index = read_index(runs["whole"])
    assert index["steps"] == [0, 1, 2, 5, 12] and index["asked"] == 5
    files = sorted((runs["whole"] / SNAPSHOTS_DIR).glob("step_*.safetensors"))
    assert index["bytes"] == sum(path.stat().st_size for path in files)
    assert 0 < index["save_seconds"] < index["train_seconds"]
    assert index["cost_fraction"] == pytest.approx(index["save_seconds"]
                                                   / index["train_seconds"])


def test_a_snapshot_is_bit_equal_to_the_weights_at_its_step(runs: dict[str, Path]) -> None:
    whole, part = runs["whole"] / SNAPSHOTS_DIR, runs["part"]
    # the last snapshot is the run's last weights; the one at step 5 a run trained to 5
    assert _equal(load_file(whole / "step_00000012.safetensors"),
                  load_file(runs["whole"] / MODEL_FILE))
    assert _equal(load_file(whole / "step_00000005.safetensors"), load_file(part / MODEL_FILE))
    model, _ = Run(runs["whole"]).load_model(checkpoint="step:5")
    last, _ = Run(part).load_model(checkpoint="last")
    assert _equal(model.state_dict(), last.state_dict())
    assert Run(runs["whole"]).describe_weights("step:5") == "the snapshot at step 5"


def test_resuming_the_run_at_a_snapshot_step_reproduces_the_rest(runs: dict[str, Path]
                                                                 ) -> None:
    assert list_snapshots(runs["resumed"]) == [0, 1, 2, 3, 5, 12]  # 5's schedule, then 12's
    assert _equal(load_file(runs["resumed"] / MODEL_FILE), load_file(runs["whole"] / MODEL_FILE))
    assert read_index(runs["resumed"])["train_seconds"] > read_index(runs["part"])[
        "train_seconds"]


def test_a_new_run_replacing_one_drops_its_snapshots(runs: dict[str, Path],
                                                     tmp_path: Path) -> None:
    run = shutil.copytree(runs["part"], tmp_path / "run")
    train_run(run, data=runs["data"], model=MODEL, threads=1, force=True,
              train={**TRAIN, "max_iters": 1})
    assert list_snapshots(run) == []
    assert not (run / SNAPSHOTS_DIR / "index.json").exists()


def test_a_missing_or_malformed_snapshot_is_one_clear_error(runs: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError, match=r"no snapshot at step 4; it keeps 5 snapshots "
                                              r"\(step:0, step:1, step:2, step:5, step:12\)"):
        Run(runs["whole"]).load_model(checkpoint="step:4")
    for bad in ("step:", "step:-1", "step:x", "first"):
        with pytest.raises(ConfigError, match="'best', 'last' or 'step:N'"):
            Run(runs["whole"]).weights_file(bad)
    parser = build_parser()
    args = parser.parse_args(["sample", str(runs["whole"]), "--checkpoint", "step:12"])
    assert args.checkpoint == "step:12"
    with pytest.raises(CommandLineError, match="'best', 'last' or 'step:N'"):
        parser.parse_args(["sample", str(runs["whole"]), "--checkpoint", "step:twelve"])
    with pytest.raises(ConfigError, match="snapshots must be >= 0"):
        train_run(runs["whole"], resume=True, train={"snapshots": -1})


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k])
                                        for k in a)


def test_a_lora_tune_is_snapshotted_with_its_adapters_merged() -> None:
    """A snapshot is the model at its step: a LoRA tune's base with the adapters merged, as
    `Run.load_model` merges a tuned run's, under the run's own tensor names."""
    import copy

    import torch

    from conftest import tiny_gpt
    from glassgpt.adapters.lora import add_lora, bake_lora
    from glassgpt.adapters.settings import LoraSettings
    from glassgpt.rundir.snapshots import snapshot_tensors
    from glassgpt.rundir.weights import model_tensors

    model = tiny_gpt()
    add_lora(model, LoraSettings(rank=2, targets=("q", "v", "down")))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()  # adapters that change something
    baked = copy.deepcopy(model)
    bake_lora(baked)
    snapshot = snapshot_tensors(model)
    assert _equal(snapshot, model_tensors(baked))
    assert not snapshot["blocks.0.attn.qkv.weight"].equal(model_tensors(model)[
        "blocks.0.attn.qkv.weight"])  # the adapters are in it
