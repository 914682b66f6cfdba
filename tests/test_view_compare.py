"""The Compare panel of `glassgpt view RUN2 --compare RUN`: its API through Starlette's
TestClient, every number checked against the two models' own logits and caches, the command
line's refusals, then the panel in Chromium (click Compare, the tokens, the maps, a head's
attention before and after, no console errors).

The base is test_view_browser's tiny run (2 layers, 2 heads, width 16); the "tuned" run is a copy
whose weights the test changes in one known place: layer 1 head 0's rows of W_Q. So its weight
maps and its heads' outputs move there and nowhere else, and only that head's pattern changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.interp.core.hooked import run_with_cache
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import load_model, save_model
from glassgpt.view.compare import load_comparison
from glassgpt.view.server import create_app, load_for_view
from test_view_browser import (  # noqa: F401
    browser,
    run_dir,
    served,
    type_prompt,
    values,
    wait_for,
)

PROMPT = "to be or not"
LAYER, HEAD = 1, 0  # the head the "tune" changed


@pytest.fixture(scope="module")
def tuned_dir(run_dir, tmp_path_factory) -> Path:  # noqa: F811
    """The base run with layer 1 head 0's query weights moved, saved as a run of its own."""
    model, tokenizer = load_model(run_dir)
    attn = model.blocks[LAYER].attn
    d = attn.head_dim
    torch.manual_seed(1)
    with torch.no_grad():
        attn.qkv.weight[HEAD * d:(HEAD + 1) * d] += 2.0 * torch.randn(d, attn.d_model)
    path = tmp_path_factory.mktemp("tuned") / "run"
    save_model(path, model, tokenizer)
    return path


@pytest.fixture(scope="module")
def models(run_dir, tuned_dir):  # noqa: F811
    """The two models as the library loads them, apart from the view's."""
    return load_model(tuned_dir)[0], load_model(run_dir)[0]


@pytest.fixture(scope="module")
def view(tuned_dir):
    return load_for_view(tuned_dir)


@pytest.fixture(scope="module")
def comparison(view, run_dir):  # noqa: F811
    return load_comparison(view, run_dir)


@pytest.fixture(scope="module")
def client(view, comparison):
    with TestClient(create_app(view, comparison=comparison), base_url="http://127.0.0.1") as c:
        yield c


def idx_of(view) -> torch.Tensor:
    return view.encode(PROMPT).idx


# --- the API -----------------------------------------------------------------------------------

def test_the_view_says_it_compares(client):
    assert client.get("/api/compare/available").json() == {"available": True}


def test_tokens_are_the_difference_of_the_two_models_log_softmax(client, view, models):
    tuned, base = models
    idx = idx_of(view)  # (1, T)
    answer = client.post("/api/compare/tokens", json={"prompt": PROMPT}).json()
    assert answer["tokens"] == [t["text"] for t in view.tokens(PROMPT)["tokens"]]
    want = {}
    with torch.no_grad():
        for name, model in (("tuned", tuned), ("base", base)):
            logits = model(idx)[0][0].double()  # (T, V)
            logp = torch.log_softmax(logits, -1)[:-1]  # position t predicts token t + 1
            want[name] = logp.gather(1, idx[0, 1:, None])[:, 0]
    T = idx.shape[1]
    assert len(answer["tuned"]) == len(answer["base"]) == len(answer["difference"]) == T - 1
    for key in ("tuned", "base"):
        assert answer[key] == pytest.approx(want[key].tolist(), abs=1e-4)
    difference = want["tuned"] - want["base"]
    assert answer["difference"] == pytest.approx(difference.tolist(), abs=1e-4)
    assert difference.abs().max() > 1e-3  # the tune changed something
    assert answer["mean_difference"] == pytest.approx(float(difference.mean()), abs=1e-6)


def test_the_changes_are_zero_everywhere_but_the_changed_head(client, models):
    tuned, base = models
    answer = client.post("/api/compare/changes", json={"prompt": PROMPT}).json()
    d = base.blocks[LAYER].attn.head_dim
    rows = slice(HEAD * d, (HEAD + 1) * d)
    before = base.blocks[LAYER].attn.qkv.weight[rows].detach().double()
    after = tuned.blocks[LAYER].attn.qkv.weight[rows].detach().double()
    moved = float((after - before).norm() / before.norm())
    for name, values_ in answer["weights"].items():
        for layer, row in enumerate(values_):
            for head, value in enumerate(row):
                if name == "q" and (layer, head) == (LAYER, HEAD):
                    assert value == pytest.approx(moved, abs=1e-4)
                else:
                    assert value == 0, (name, layer, head)
    assert len(answer["weights"]["mlp"]) == 2 and answer["weights"]["mlp"][0] == [0.0]
    assert answer["elsewhere"] == []
    outputs = answer["outputs"]
    assert outputs[LAYER][HEAD] > 0.01
    assert [v for layer, row in enumerate(outputs) for head, v in enumerate(row)
            if (layer, head) != (LAYER, HEAD)] == [0, 0, 0]
    assert answer["top_outputs"][0]["layer"] == LAYER and answer["top_outputs"][0]["head"] == HEAD


def test_a_head_outputs_change_is_its_hook_results(client, view, models):
    tuned, base = models
    name = f"blocks.{LAYER}.attn.hook_result"
    after = run_with_cache(tuned, idx_of(view), name)[1][name][0, :, HEAD].double()  # (T, C)
    before = run_with_cache(base, idx_of(view), name)[1][name][0, :, HEAD].double()
    answer = client.post("/api/compare/changes", json={"prompt": PROMPT}).json()
    assert answer["outputs"][LAYER][HEAD] == pytest.approx(
        float((after - before).norm() / before.norm()), abs=1e-4)


@pytest.mark.parametrize("layer, head, changed", [(LAYER, HEAD, True), (LAYER, 1, False),
                                                  (0, HEAD, False)])
def test_attention_before_and_after_are_each_models_pattern(client, view, models, layer, head,
                                                           changed):
    tuned, base = models
    name = f"blocks.{layer}.attn.hook_pattern"
    answer = client.post("/api/compare/attention", json={"prompt": PROMPT, "layer": layer,
                                                         "head": head}).json()
    for key, model in (("after", tuned), ("before", base)):
        want = run_with_cache(model, idx_of(view), name)[1][name][0, head]  # (T, T)
        assert torch.tensor(answer[key]).double() == pytest.approx(want.double(), abs=1e-4)
    assert (answer["largest_change"] > 1e-3) == changed


@pytest.mark.parametrize("route, body, says", [
    ("attention", {"prompt": PROMPT, "layer": 2, "head": 0}, "layer 2, head 0 does not exist"),
    ("attention", {"prompt": PROMPT, "layer": 0, "head": -1}, "heads 0..1"),
    ("attention", {"prompt": PROMPT, "layer": 0}, "'head' is missing"),
    ("attention", {"prompt": PROMPT, "layer": "0", "head": 0}, "layer must be an integer"),
    ("tokens", {"prompt": ""}, "empty"),
    ("changes", {"prompt": PROMPT, "k": 3}, "unknown field 'k'"),
])
def test_bad_requests_are_refused_in_one_line(client, route, body, says):
    response = client.post(f"/api/compare/{route}", json=body)
    assert response.status_code == 400
    assert says in response.json()["error"] and "\n" not in response.json()["error"]


def test_a_view_without_compare_says_how_to_start_one(view):
    with TestClient(create_app(view), base_url="http://127.0.0.1") as c:
        assert c.get("/api/compare/available").json() == {"available": False}
        for route in ("tokens", "changes"):
            response = c.post(f"/api/compare/{route}", json={"prompt": PROMPT})
            assert response.status_code == 400
            assert "glassgpt view RUN2 --compare RUN" in response.json()["error"]


# --- the command line --------------------------------------------------------------------------

def test_the_command_line_refuses_a_base_of_another_shape(tuned_dir, tmp_path, capsys):
    _, tokenizer = load_model(tuned_dir)
    wider = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=2, n_head=2,
                      n_embd=32)
    save_model(tmp_path / "wider", GPT(wider), tokenizer)
    code = main(["view", str(tuned_dir), "--port", "0", "--compare", str(tmp_path / "wider")])
    error = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in error
    assert "--compare: the runs differ in n_embd (16 here, 32 in the base)" in error


def test_the_command_line_takes_the_run_it_was_tuned_from(tuned_dir, run_dir, capsys):  # noqa: F811
    # It passes every check: the command stops only at the address it cannot listen on.
    code = main(["view", str(tuned_dir), "--host", "256.0.0.1", "--compare", str(run_dir)])
    error = capsys.readouterr().err
    assert code != 0 and "cannot listen on 256.0.0.1" in error and "--compare" not in error


# --- the panel in a browser --------------------------------------------------------------------

@pytest.fixture(scope="module")
def page(view, comparison, browser) -> Iterator[Any]:  # noqa: F811
    """The tuned view compared with its base, served on a thread of this process, 1400 px."""
    with served(browser, create_app(view, comparison=comparison)) as driver:
        yield driver


def test_the_panel_compares_the_prompt_head_by_head(page, view):
    assert page.find_element("id", "compare-body").is_displayed()
    assert not page.find_element("id", "compare-none").is_displayed()
    type_prompt(page, PROMPT)
    page.find_element("id", "compare-button").click()
    n_tokens = len(view.encode(PROMPT).ids)
    wait_for(page, lambda d: len(values(d, "#compare-tokens .compare-token")) == n_tokens
             and len(values(d, "#compare-maps .compare-map")) == 6, "the comparison drawn")
    assert values(page, "#compare-tokens .compare-token", "dataset.position") == [
        str(p) for p in range(n_tokens)]
    # The heads' output map: its brightest cell is the head the tune changed.
    cells = page.execute_script(
        "return [...document.querySelectorAll('[data-map=\"outputs\"] .compare-cell')].map("
        "(r) => [Number(r.dataset.value), Number(r.dataset.layer), Number(r.dataset.head)])")
    assert len(cells) == 4 and max(cells)[1:] == [LAYER, HEAD]
    page.execute_script(f"document.querySelector('[data-map=\"outputs\"] .compare-cell"
                        f"[data-layer=\"{LAYER}\"][data-head=\"{HEAD}\"]').dispatchEvent("
                        "new MouseEvent('click', {bubbles: true}))")
    wait_for(page, lambda d: values(d, "#compare-attention", "dataset.state") == ["shown"],
             "the head's attention before and after")
    maps = page.execute_script(
        "return [...document.querySelectorAll('#compare-attention svg')].map((s) =>"
        "s.querySelectorAll('rect').length)")
    assert maps == [n_tokens * (n_tokens + 1) // 2] * 2  # the lower triangle, twice


def test_the_panel_fits_the_window_and_nothing_was_logged(page):
    inner, scroll = page.execute_script(
        "return [window.innerWidth, document.documentElement.scrollWidth]")
    assert inner >= 1300 and scroll <= inner
    assert [e for e in page.get_log("browser") if e["level"] == "SEVERE"] == []


def test_a_bf16_base_tune_moves_only_what_it_trained(run_dir, tmp_path):  # noqa: F811
    """A LoRA tune on a bf16 base stores the base rounded; its maps compare with the base as
    the tune saw it, so a weight the tune left alone reads 0, not the rounding."""
    from glassgpt.view.compare import Comparison

    base = load_model(run_dir)[0]
    tuned, tokenizer = load_model(run_dir)
    with torch.no_grad():
        for p in tuned.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        tuned.blocks[LAYER].attn.proj.weight[:, :4] += 1.0  # head 0's columns of W_O
    save_model(tmp_path / "tuned", tuned, tokenizer)
    view = load_for_view(tmp_path / "tuned")
    maps = Comparison(view, base, "bfloat16").changes(PROMPT)
    moved = [(name, layer, head) for name, rows in maps["weights"].items()
             for layer, row in enumerate(rows) for head, v in enumerate(row) if v != 0]
    assert moved == [("o", LAYER, HEAD)] and maps["elsewhere"] == []
    unrounded = Comparison(view, base).changes(PROMPT)  # the rounding itself, everywhere
    assert all(v > 0 for row in unrounded["weights"]["q"] for v in row)
