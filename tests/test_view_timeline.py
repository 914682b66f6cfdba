"""The view's Timeline panel (Starlette's TestClient, no browser; the slider itself is driven in
Chromium by tests/test_view_browser.py).

A tiny run trained here with `--snapshots 3`: every panel the slider moves answers, at a step,
with the numbers of that snapshot loaded as a run (`load_model(checkpoint="step:N")`), not the
run's own; the models kept loaded stay within their bound; GET /api/timeline lists the steps and
reads timeline.json, and says how to make it when there is none.
"""

from __future__ import annotations

import json

import pytest
import torch
from starlette.testclient import TestClient

from glassgpt.cli import main
from glassgpt.interp.methods.attribution import logit_attribution
from glassgpt.interp.methods.lens import attention_maps, next_token_top_k
from glassgpt.rundir.checkpoint import load_model
from glassgpt.rundir.snapshots import list_snapshots
from glassgpt.storage.layout import TIMELINE_FILE
from glassgpt.view import causal, timeline
from glassgpt.view.inspector import RunView
from glassgpt.view.server import create_app, load_for_view

PROMPT = "to be or not"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("timeline")
    text = root / "text.txt"
    text.write_text("".join(f"To be or not to be, line {i}: that is the question.\n"
                            for i in range(60)), encoding="utf-8")
    assert main(["prepare", "--text", str(text), "--out", str(root / "data")]) == 0
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"),
                 "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
                 "--batch-size", "4", "--max-iters", "8", "--eval-interval", "4",
                 "--eval-iters", "1", "--lr", "1e-2", "--warmup-iters", "0",
                 "--snapshots", "3", "--device", "cpu", "--threads", "1"]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def view(run_dir) -> RunView:
    return load_for_view(run_dir, threads=1)


@pytest.fixture(scope="module")
def client(view):
    with TestClient(create_app(view), base_url="http://127.0.0.1") as test_client:
        yield test_client


def snapshot(run_dir, step: int):
    return load_model(run_dir, checkpoint=f"step:{step}")


def ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(text)])  # (1, T)


def test_the_timeline_lists_the_snapshots_and_says_how_to_score_them(client, run_dir):
    answer = client.get("/api/timeline").json()
    steps = list_snapshots(run_dir)
    assert answer["steps"] == steps and len(steps) == 3 and steps[0] == 0
    assert answer["checkpoint"] == "best"
    assert answer["timeline"] is None
    assert "glassgpt timeline" in answer["timeline_note"]


def test_each_panel_answers_with_the_snapshots_own_numbers(client, run_dir, view):
    step = list_snapshots(run_dir)[1]
    model, tokenizer = snapshot(run_dir, step)
    idx = ids(tokenizer, PROMPT)
    T = idx.shape[1]
    maps = attention_maps(model, idx)[:, 0]  # (L, H, T, T)
    own = attention_maps(view.model, idx)[:, 0]
    assert (maps - own).abs().max() > 1e-3  # the snapshot is not the run's own weights
    at = {"prompt": PROMPT, "step": step}
    shown = client.post("/api/attention", json={**at, "layer": 1, "head": 0}).json()
    torch.testing.assert_close(torch.tensor(shown["weights"][0][T - 1]), maps[1, 0, T - 1],
                               rtol=0, atol=1e-4)
    inside = client.post("/api/head", json={**at, "layer": 1, "head": 1,
                                            "position": T - 1}).json()
    row = next(s for s in inside["steps"] if s["name"] == "weights")["values"]
    torch.testing.assert_close(torch.tensor(row), maps[1, 1, T - 1], rtol=0, atol=1e-4)
    top = next_token_top_k(model, idx, k=3)
    bars = client.post("/api/predictions", json={**at, "k": 3}).json()
    assert bars["ids"][-1][T - 1] == top.ids[0, T - 1].tolist()
    pushes = client.post("/api/attribution", json={**at, "position": T - 1}).json()
    expected = logit_attribution(model, idx, pushes["token"]["id"], pos=T - 1)
    assert pushes["logit"] == pytest.approx(expected.logit, abs=1e-4)
    torch.testing.assert_close(torch.tensor(pushes["values"], dtype=torch.float64),
                               expected.values.detach().double(), rtol=1e-4, atol=1e-4)
    badges = client.post("/api/overview", json=at).json()["scores"]
    scores = causal.scores_of(model, view.validation_ids()).scores
    torch.testing.assert_close(torch.tensor(badges["induction"]), scores.induction,
                               rtol=0, atol=1e-4)


def test_patching_and_sampling_run_at_the_step(client, run_dir):
    step = list_snapshots(run_dir)[0]
    patched = client.post("/api/patching", json={"clean": PROMPT, "step": step}).json()
    mine = client.post("/api/patching", json={"clean": PROMPT}).json()
    assert patched["logit_diff"] != mine["logit_diff"]
    stream = client.post("/api/sample", json={"prompt": PROMPT, "step": step,
                                              "max_new_tokens": 4, "seed": 1})
    assert stream.status_code == 200 and "event: done" in stream.text


def test_the_run_own_weights_answer_without_a_step(client, view):
    idx = ids(view.tokenizer, PROMPT)
    shown = client.post("/api/attention", json={"prompt": PROMPT, "layer": 0, "head": 1,
                                                "step": None}).json()
    maps = attention_maps(view.model, idx)[:, 0]
    T = idx.shape[1]
    torch.testing.assert_close(torch.tensor(shown["weights"][0][T - 1]), maps[0, 1, T - 1],
                               rtol=0, atol=1e-4)


def test_the_models_kept_loaded_stay_within_their_bound(view, run_dir, monkeypatch):
    snapshots = timeline.Snapshots(view)
    assert snapshots.most == timeline.MOST_SNAPSHOT_VIEWS  # a tiny model: the most of them
    assert timeline.kept_views(2 * 2**30) == 1 and timeline.kept_views(300 * 2**20) == 3
    snapshots.most = 1
    steps = list_snapshots(run_dir)
    for step in [*steps, steps[0]]:
        shown = snapshots.view_at(step)
        assert shown.checkpoint == f"step:{step}" and list(snapshots.views) == [step]
    assert snapshots.view_at(None) is view


@pytest.mark.parametrize("step, message", [
    (3, "kept no snapshot at step 3; its snapshots are at steps 0,"),
    ("1", "step must be an integer or null"),
    (True, "step must be an integer or null"),
])
def test_a_step_that_is_not_kept_is_one_line(client, step, message):
    answer = client.post("/api/attention", json={"prompt": PROMPT, "layer": 0, "step": step})
    assert answer.status_code == 400 and message in answer.json()["error"]


def test_a_run_without_snapshots_says_how_to_keep_them(tmp_path, view):
    bare = RunView(view.model, view.tokenizer, tmp_path / "nothing")
    with TestClient(create_app(bare), base_url="http://127.0.0.1") as client:
        assert client.get("/api/timeline").json()["steps"] == []
        answer = client.post("/api/overview", json={"prompt": PROMPT, "step": 0})
        assert answer.status_code == 400 and "--snapshots N" in answer.json()["error"]


def test_timeline_json_is_read_for_the_page_and_a_broken_one_is_a_note(client, run_dir):
    steps = list_snapshots(run_dir)
    heads = [[[0.1 * (s + l + h) for h in range(2)] for l in range(2)] for s in range(3)]
    pushes = [[[-0.5 * (s - l + h) for h in range(2)] for l in range(2)] for s in range(3)]
    records = [{"step": step, "train_loss": 4.0 - i, "val_loss": 4.5 - i, "icl_score": -0.1 * i,
                "scores": {"previous_token": heads[i], "duplicate_token": heads[i],
                           "induction": heads[i]},
                "attribution": {"heads": pushes[i], "mlps": [0.0, 0.0], "logit": 1.0},
                **({"llc": {"llc_mean": 2.5, "llc_std": 0.25}} if i == 2 else {})}
               for i, step in enumerate(steps)]
    written = {"format": "glassgpt-timeline/1", "steps": steps, "snapshots": records,
               "splits": ["train", "val"],
               "phase_change": {"step": steps[1], "definition": "half way"},
               "icl": {"definition": "loss at token index 8 minus loss at token index 1"}}
    path = run_dir / TIMELINE_FILE
    path.write_text(json.dumps(written), encoding="utf-8")
    try:
        answer = client.get("/api/timeline").json()
        assert answer["timeline_note"] is None
        shown = answer["timeline"]
        assert shown["steps"] == steps and shown["losses"] == {"train": [4.0, 3.0, 2.0],
                                                               "val": [4.5, 3.5, 2.5]}
        assert shown["heads"] == {"previous_token": heads, "duplicate_token": heads,
                                  "induction": heads, "attribution": pushes}
        assert shown["llc"] == [None, None, 2.5] and shown["llc_std"] == [None, None, 0.25]
        assert shown["phase_change"] == steps[1] and shown["phase_definition"] == "half way"
        assert shown["icl_definition"].startswith("loss at token index 8")
        path.write_text('{"snapshots": [{"step": "x"}]}', encoding="utf-8")
        answer = client.get("/api/timeline").json()
        assert answer["timeline"] is None
        assert answer["timeline_note"].startswith("timeline.json cannot be read")
    finally:
        path.unlink()


def test_the_panel_draws_what_glassgpt_timeline_wrote(client, run_dir):
    """timeline.json as `glassgpt timeline` writes it (glassgpt.interp.timeline's format):
    the panel's steps, losses and each head's lines are the file's numbers."""
    assert main(["timeline", str(run_dir), "--sequences", "4", "--score-batch", "2"]) == 0
    path = run_dir / TIMELINE_FILE
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
        shown = client.get("/api/timeline").json()["timeline"]
        records = written["snapshots"]
        assert shown["steps"] == written["steps"] == list_snapshots(run_dir)
        assert list(shown["losses"]) == written["splits"] == ["train", "val"]
        for split in written["splits"]:
            assert shown["losses"][split] == [record[f"{split}_loss"] for record in records]
        assert shown["icl_score"] == [record["icl_score"] for record in records]
        for kind in ("previous_token", "duplicate_token", "induction"):
            assert shown["heads"][kind] == [record["scores"][kind] for record in records]
        assert shown["heads"]["attribution"] == [r["attribution"]["heads"] for r in records]
        assert shown["phase_change"] == written["phase_change"]["step"]
        assert shown["icl_definition"] == written["icl"]["definition"]
    finally:
        path.unlink()
