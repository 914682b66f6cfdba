"""`glassgpt view` of a model with local layers (a sliding window, Gemma's switches): the JSON
says which layers are local, the keys a window hides are marked (None, never a weight of 0),
and "Inside one head" uses the scale, soft-cap and band the model itself uses.

A tiny run trained a few steps through the CLI, seen through the in-process API (Starlette's
TestClient), every number checked against the model's own hook points (`run_with_cache`).
"""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from conftest import TINY_TEXT
from glassgpt.attention import build_attention_mask
from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.data import prepare
from glassgpt.interp.core.hooked import run_with_cache
from glassgpt.interp.methods.heads import head_steps
from glassgpt.model import GPT
from glassgpt.tokenizers import CharTokenizer
from glassgpt.view.inspector import RunView
from glassgpt.view.maps import out_of_window
from glassgpt.view.server import create_app, load_for_view

W = 4  # layer 0 is local with this window, layer 1 global
PROMPT = "to be or not to"  # 15 characters: most keys of a late query lie outside the window
WINDOWED = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
            "--batch-size", "4", "--max-iters", "3", "--eval-interval", "3", "--eval-iters", "2",
            "--log-interval", "1", "--device", "cpu", "--position", "rope", "--norm", "rmsnorm",
            "--sliding-window", str(W), "--local-layers", "0", "--rope-local-theta", "100",
            "--query-pre-attn-scalar", "4", "--attn-softcap", "5"]


@pytest.fixture(scope="module")
def view(tmp_path_factory) -> RunView:
    root = tmp_path_factory.mktemp("windows")
    text = root / "text.txt"
    text.write_text(TINY_TEXT, encoding="utf-8")
    prepare(root / "data", text)
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"),
                 *WINDOWED]) == 0
    return load_for_view(root / "run")


@pytest.fixture(scope="module")
def client(view):
    with TestClient(create_app(view), base_url="http://127.0.0.1") as test_client:
        yield test_client


@pytest.fixture(scope="module")
def cache(view) -> dict[str, torch.Tensor]:
    """The model's own scores and weights of both layers for PROMPT."""
    names = [f"blocks.{layer}.attn.hook_{point}" for layer in (0, 1)
             for point in ("attn_scores", "pattern")]
    _, found = run_with_cache(view.model, view.encode(PROMPT).idx, names=names)
    return {name: found[name][0].float() for name in names}  # (H, T, T) each


def post(client, path: str, **body) -> dict:
    answer = client.post(f"/api/{path}", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_card_says_which_layers_are_local_and_their_rotary_bases(client):
    layers = client.get("/api/card").json()["layers"]
    assert layers == [{"layer": 0, "attention": "local", "window": W, "rope_theta": 100.0},
                      {"layer": 1, "attention": "global", "window": None,
                       "rope_theta": 10000.0}]


@pytest.mark.parametrize("kind", ["weights", "scores"])
def test_a_local_layers_map_marks_the_keys_outside_its_window(client, cache, kind):
    local = post(client, "attention", prompt=PROMPT, layer=0, kind=kind)
    assert (local["attention"], local["window"]) == ("local", W)
    point = "pattern" if kind == "weights" else "attn_scores"
    for head, rows in zip(local["heads"], local["weights"], strict=True):
        for i, row in enumerate(rows):
            assert len(row) == i + 1  # keys 0..i, as for a global layer
            band = max(0, i - W + 1)
            assert row[:band] == [None] * band  # hidden: marked, not a number
            shown = torch.tensor(row[band:])
            torch.testing.assert_close(shown, cache[f"blocks.0.attn.hook_{point}"][head, i,
                                                                                   band:i + 1],
                                       rtol=0, atol=5e-5)
            if kind == "weights":
                assert abs(float(shown.sum()) - 1) < 1e-3
    overall = post(client, "attention", prompt=PROMPT, layer=1, kind=kind)
    assert (overall["attention"], overall["window"]) == ("global", None)
    assert all(v is not None for rows in overall["weights"] for row in rows for v in row)


def test_the_overview_and_one_tokens_row_mark_the_same_cells(client):
    overview = post(client, "overview", prompt=PROMPT)
    local, overall = overview["weights"]
    assert local[0][-1][:len(PROMPT) - W] == [None] * (len(PROMPT) - W)
    assert None not in local[0][-1][len(PROMPT) - W:] and None not in overall[0][-1]
    attends = post(client, "attends", prompt=PROMPT, position=10)["weights"]
    assert attends[0][1][:7] == [None] * 7 and None not in attends[0][1][7:]
    assert None not in attends[1][1]


def test_inside_one_head_is_the_band_with_the_models_scale_and_softcap(client, view, cache):
    answer = post(client, "head", prompt=PROMPT, layer=0, head=1, position=10)
    steps = {step["name"]: step for step in answer["steps"]}
    assert (answer["window"], answer["first_key"], answer["softcap"]) == (W, 7, 5.0)
    assert answer["scale"] == pytest.approx(0.5)  # query_pre_attn_scalar 4, not head_dim 8
    # the keys 7..10 only, with the model's own scaled, soft-capped scores and weights
    torch.testing.assert_close(torch.tensor(steps["scores"]["values"]),
                               cache["blocks.0.attn.hook_attn_scores"][1, 10, 7:11],
                               rtol=0, atol=5e-5)
    weights = torch.tensor(steps["weights"]["values"])
    torch.testing.assert_close(weights, cache["blocks.0.attn.hook_pattern"][1, 10, 7:11],
                               rtol=0, atol=5e-5)
    assert abs(float(weights.sum()) - 1) < 1e-3
    assert steps["keys"]["shape"][0] == steps["values"]["shape"][0] == W
    assert steps["mask"]["values"] == [7 <= t <= 10 for t in range(len(PROMPT))]
    assert "sqrt(4)" in steps["scores"]["title"] and "query_pre_attn_scalar" in \
        steps["scores"]["title"] and "5 * tanh(s / 5)" in steps["scores"]["title"]
    assert "sqrt(8)" not in steps["scores"]["title"].split("in place of")[0]
    assert f"W = {W}" in steps["mask"]["title"]
    glob = post(client, "head", prompt=PROMPT, layer=1, head=0, position=10)
    glob_steps = {step["name"]: step for step in glob["steps"]}
    assert glob["first_key"] == 0 and len(glob_steps["weights"]["values"]) == 11
    assert "window" not in glob_steps["mask"]["title"]


def test_the_librarys_head_steps_weigh_nothing_outside_the_band(view):
    idx = view.encode(PROMPT).idx
    steps = head_steps(view.model, idx, 0, 0, 12)
    band = torch.arange(len(PROMPT))
    inside = (band > 12 - W) & (band <= 12)
    assert torch.equal(steps.visible, inside)
    assert torch.all(steps.weights[~inside] == 0)
    assert abs(float(steps.weights[inside].sum()) - 1) < 1e-5


def band_scores(T: int, window: int | None) -> torch.Tensor:
    """Scores (T, T) as a layer with `window` masks them: -inf where the model hides a key."""
    mask = build_attention_mask(T, T, True, None, torch.device("cpu"), window)[0, 0]
    return torch.zeros(T, T).masked_fill(~mask, float("-inf"))


def test_a_pooled_thumbnail_hides_a_cell_only_when_its_whole_block_is_hidden():
    assert out_of_window(band_scores(8, None)) is None
    assert out_of_window(band_scores(8, 8)) is None
    hidden = out_of_window(band_scores(6, 2))  # (6, 6): key j hidden from query i when i - j >= 2
    assert hidden[5].tolist() == [True, True, True, True, False, False]
    pooled = out_of_window(band_scores(100, 10), cells=48)
    assert pooled.shape == (48, 48)
    assert pooled[47, 0] and not pooled[47, 47] and not pooled[0, 0]


def test_the_other_gemma_switches_are_named_in_the_walks_and_counted_as_norms():
    tokenizer = CharTokenizer.from_text("abcdefgh ")
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=12, n_layer=2, n_head=2,
                       n_embd=16, position="rope", norm="rmsnorm", activation="geglu",
                       post_norms=True, norm_offset=True, embed_scale=True, bias=False,
                       query_pre_attn_scalar=8)  # = head_dim: the same scale, said so
    view = RunView(GPT(config), tokenizer)
    parts = view.card()["parameters"]["parts"]
    assert "other" not in parts and parts["norm"] == (4 * 2 + 1) * 16  # four a block, ln_f
    mlp = {step["name"]: step["title"] for step in view.mlp("abc fed", 1, 3)["steps"]}
    assert "gelu_tanh" in mlp["pre"] and "SiLU" not in mlp["pre"]
    assert mlp["mlp_out"].startswith("ln2_post(")
    head = {step["name"]: step["title"] for step in view.head("abc fed", 0, 0, 5)["steps"]}
    assert head["scores"] == "q . k / sqrt(8) (query_pre_attn_scalar = d): scaled scores"
    assert "before ln1_post" in head["contribution"]
