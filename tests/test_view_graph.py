"""The Graph panel of `glassgpt view RUN --transcoders DIR`: its API through Starlette's
TestClient, every number checked against glassgpt.interp.graph, then the panel in Chromium
(one browser session, the tests in order): drawn nodes, the threshold slider, an edge's heads,
a feature node opening its page, no console errors, nothing wider than the window.

The run is test_view_browser's tiny one (2 layers, width 16); its transcoders, one a layer,
have random weights and a negative encoder bias, so that some features fire and some do not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from glassgpt.cli import main
from glassgpt.interp.graph import attribution_graph, load_transcoders
from glassgpt.interp.graph.export import FEW_FEATURES, few_features_line, node_id, pruned_json
from glassgpt.interp.graph.heads import edge_heads
from glassgpt.interp.graph.prune import prune_graph
from glassgpt.interp.graph.replacement import read_prompt
from glassgpt.interp.sae import SAE, SAEConfig
from glassgpt.view.features import load_dictionaries
from glassgpt.view.graph import TOP_HEADS, load_graphs
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
LAYERS = 2


def transcoder(path: Path, layer: int, d_in: int = 16, seed: int = 0) -> Path:
    torch.manual_seed(seed + layer)
    cfg = SAEConfig(d_in=d_in, d_sae=32, architecture="transcoder", apply_b_dec_to_input=False,
                    d_out=16)
    cfg.metadata.hook_name = f"blocks.{layer}.ln2.hook_normalized"
    cfg.metadata.hook_name_out = f"blocks.{layer}.hook_mlp_out"
    sae = SAE(cfg)
    with torch.no_grad():
        sae.b_enc.fill_(-0.5)  # some features fire, not all
    sae.save(path)
    return path


@pytest.fixture(scope="module")
def transcoders_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("transcoders")
    for layer in range(LAYERS):
        transcoder(root / f"layer{layer}", layer)
    return root


@pytest.fixture(scope="module")
def view(run_dir):  # noqa: F811
    return load_for_view(run_dir)


@pytest.fixture(scope="module")
def loaded(view, transcoders_dir):
    dicts = load_dictionaries(view, [])
    return dicts, load_graphs(view, [transcoders_dir], dicts)


@pytest.fixture(scope="module")
def client(view, loaded):
    dicts, graphs = loaded
    with TestClient(create_app(view, dictionaries=dicts, graphs=graphs),
                    base_url="http://127.0.0.1") as c:
        yield c


@pytest.fixture(scope="module")
def library(view, transcoders_dir):
    """The library's own graph of PROMPT and its frozen run, built apart from the view's."""
    transcoders = load_transcoders([transcoders_dir])
    ids = view.encode(PROMPT).idx
    return attribution_graph(view.model, transcoders, ids), read_prompt(view.model,
                                                                          transcoders, ids)


def close(got: Any, want: Any) -> None:
    """Equal, floats to 1e-5 (the view built its graph in a run of its own)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for key in want:
            close(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            close(g, w)
    else:
        assert got == want


def pruned(view, library, node: float = 0.8, edge: float = 0.98) -> dict[str, Any]:
    graph, _ = library
    return pruned_json(graph, prune_graph(graph, node, edge), (node, edge), view.token_text)


# --- the API -----------------------------------------------------------------------------------

def test_the_view_says_it_has_transcoders_and_they_join_the_features_panel(client,
                                                                           transcoders_dir):
    answer = client.get("/api/graph/available").json()
    assert answer["available"] is True
    names = [t["name"] for t in answer["transcoders"]]
    assert [t["hook"] for t in answer["transcoders"]] == [f"blocks.{layer}.hook_mlp_out"
                                                          for layer in range(LAYERS)]
    listed = client.get("/api/dictionaries").json()["dictionaries"]
    # Named by folder, as --sae dictionaries are; a folder of several: folder/layerL.
    assert [d["name"] for d in listed] == names == [f"{transcoders_dir.name}/layer{layer}"
                                                    for layer in range(LAYERS)]
    assert all(d["architecture"] == "transcoder" for d in listed)


def test_the_graph_is_the_librarys_and_names_its_dictionaries(client, view, library, loaded):
    _, graphs = loaded
    answer = client.post("/api/graph", json={"prompt": PROMPT}).json()
    mapping = answer.pop("dictionaries")
    assert answer.pop("why") is None  # its features were kept
    close(answer, pruned(view, library))
    assert mapping == graphs.names
    features = [n for n in answer["nodes"] if n["kind"] == "feature"]
    assert features and all(n["dictionary"] in mapping for n in features)
    assert {n["kind"] for n in answer["nodes"]} >= {"feature", "token", "logit"}


def test_the_graph_says_why_where_it_kept_few_features(client, library):
    graph, _ = library
    for threshold in (0.1, 0.8):
        answer = client.post("/api/graph", json={"prompt": PROMPT,
                                                 "node_threshold": threshold}).json()
        assert answer["why"] == few_features_line(graph, prune_graph(graph, threshold))
        features = sum(n["kind"] == "feature" for n in answer["nodes"])
        assert (answer["why"] is None) == (features >= FEW_FEATURES)
    assert few_features_line(graph, prune_graph(graph, 0.1)) is not None  # a line was said


def test_a_higher_node_threshold_keeps_at_least_as_many_features(client):
    # Features only: the threshold prunes them, and an error or token node is drawn wherever
    # an edge of it stayed, which fewer features can leave more of.
    counts = [sum(n["kind"] == "feature" for n in client.post(
        "/api/graph", json={"prompt": PROMPT, "node_threshold": t}).json()["nodes"])
        for t in (0.1, 0.3, 0.5, 0.8, 1.0)]
    assert counts == sorted(counts) and counts[0] < counts[-1]


def test_an_edges_heads_are_edge_heads(client, library):
    graph, prompt = library
    answer = client.post("/api/graph", json={"prompt": PROMPT}).json()
    index = {n["id"]: n["index"] for n in answer["nodes"]}
    into_feature = next(e for e in answer["edges"] if e["target"].startswith("F"))
    into_logit = next(e for e in answer["edges"] if e["target"].startswith("L"))
    for edge in (into_feature, into_logit):
        got = client.post("/api/graph/edge", json={"prompt": PROMPT, "source": edge["source"],
                                                   "target": edge["target"]}).json()
        want = edge_heads(prompt, graph, index[edge["target"]], index[edge["source"]])
        assert (got["source"], got["target"]) == (edge["source"], edge["target"])
        assert got["weight"] == pytest.approx(want.weight, rel=1e-5) == edge["weight"]
        assert got["direct"] == pytest.approx(want.direct, rel=1e-4, abs=1e-6)
        top = [(layer, head) for layer, head, _ in want.top(TOP_HEADS)]
        listed = [(h["layer"], h["head"]) for h in got["heads"]]
        assert set(top) <= set(listed)
        for h in got["heads"]:
            assert h["share"] == pytest.approx(float(want.shares[h["layer"], h["head"]]),
                                               rel=1e-4, abs=1e-6)
        shares = [abs(h["share"]) for h in got["heads"]]
        assert shares == sorted(shares, reverse=True)
        assert "two heads" in got["note"]
    # By index, the same edge.
    by_index = client.post("/api/graph/edge", json={
        "prompt": PROMPT, "source": index[into_logit["source"]],
        "target": index[into_logit["target"]]}).json()
    assert by_index["weight"] == pytest.approx(into_logit["weight"])


@pytest.mark.parametrize("route, body, says", [
    ("graph", {"prompt": PROMPT, "node_threshold": 0}, "node_threshold"),
    ("graph", {"prompt": PROMPT, "edge_threshold": 1.5}, "edge_threshold"),
    ("graph", {"prompt": PROMPT, "node_threshold": "high"}, "node_threshold must be a number"),
    ("graph", {"prompt": ""}, "empty"),
    ("graph/edge", {"prompt": PROMPT, "source": "F9.9@9", "target": "T@0"}, "no node 'F9.9@9'"),
    ("graph/edge", {"prompt": PROMPT, "source": 10**6, "target": 0}, "node 1000000"),
    ("graph/edge", {"prompt": PROMPT, "source": "T@0", "target": "T@1"}, "token"),
    ("graph/edge", {"prompt": PROMPT, "source": "T@0"}, "'target' is missing"),
])
def test_bad_requests_are_refused_in_one_line(client, route, body, says):
    response = client.post(f"/api/{route}", json=body)
    assert response.status_code == 400
    assert says in response.json()["error"] and "\n" not in response.json()["error"]


def test_a_view_without_transcoders_says_how_to_start_one(view):
    with TestClient(create_app(view), base_url="http://127.0.0.1") as c:
        assert c.get("/api/graph/available").json() == {"available": False,
                                                        "crosslayer": False, "transcoders": []}
        response = c.post("/api/graph", json={"prompt": PROMPT})
    assert response.status_code == 400 and "--transcoders" in response.json()["error"]


# --- the command line --------------------------------------------------------------------------

@pytest.mark.parametrize("bad, says", [("width", "width 8"), ("missing", "layer 1")])
def test_the_command_line_refuses_transcoders_that_do_not_fit(run_dir, tmp_path, capsys,  # noqa: F811
                                                               bad, says):
    given = [transcoder(tmp_path / "t0", 0, d_in=8 if bad == "width" else 16)]
    if bad == "width":
        given.append(transcoder(tmp_path / "t1", 1))
    code = main(["view", str(run_dir), "--port", "0", "--transcoders", *map(str, given)])
    error = capsys.readouterr().err.strip()
    assert code != 0 and "--transcoders" in error and says in error and "\n" not in error


def test_the_command_line_takes_transcoders_that_fit(run_dir, transcoders_dir, capsys):  # noqa: F811
    # They pass every check: the command stops only at the address it cannot listen on.
    code = main(["view", str(run_dir), "--host", "256.0.0.1", "--transcoders",
                 str(transcoders_dir)])
    error = capsys.readouterr().err
    assert code != 0 and "cannot listen on 256.0.0.1" in error and "transcoder" not in error


# --- the panel in a browser --------------------------------------------------------------------

@pytest.fixture(scope="module")
def page(view, loaded, browser) -> Iterator[Any]:  # noqa: F811
    """The view with its transcoders, served on a thread of this process, in a 1400 px window."""
    dicts, graphs = loaded
    with served(browser, create_app(view, dictionaries=dicts, graphs=graphs)) as driver:
        yield driver


def drawn(driver, what: str = "dataset.id") -> list[str]:
    return values(driver, "#graph .graph-node", what)


def node_threshold_drawn(driver) -> str | None:
    return driver.execute_script("const s = document.querySelector('#graph svg');"
                                 "return s ? s.dataset.nodeThreshold : null")


def click(driver, selector: str) -> None:
    """A click event on the first element `selector` finds (an SVG element has no .click())."""
    driver.execute_script(f"document.querySelector('{selector}').dispatchEvent("
                          f"new MouseEvent('click', {{bubbles: true}}))")


def test_the_panel_draws_the_graphs_nodes(page, view, library):
    assert page.find_element("id", "graph-body").is_displayed()
    assert not page.find_element("id", "graph-none").is_displayed()
    type_prompt(page, PROMPT)
    page.find_element("id", "graph-draw").click()
    want = pruned(view, library)
    wait_for(page, lambda d: len(drawn(d)) == len(want["nodes"]), "the graph drawn")
    assert sorted(drawn(page)) == sorted(n["id"] for n in want["nodes"])
    assert len(values(page, "#graph .graph-edge")) == len(want["edges"])
    assert f"replacement score {want['scores']['replacement']:.3f}" in \
        values(page, "#graph-scores")[0]


def test_nodes_in_one_cell_do_not_overlap(page):
    boxes = page.execute_script(
        "return [...document.querySelectorAll('#graph .graph-node.feature circle, "
        "#graph .graph-node.error path')].map((e) => { const r = e.getBoundingClientRect();"
        "return [r.left, r.top, r.right, r.bottom]; })")
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] + 0.5 or b[2] <= a[0] + 0.5 or a[3] <= b[1] + 0.5 \
                or b[3] <= a[1] + 0.5


def test_moving_the_node_slider_redraws_the_graph(page, view, library):
    before = len(drawn(page))
    want = pruned(view, library, node=1.0)
    assert len(want["nodes"]) != before
    page.execute_script("const s = document.getElementById('graph-node'); s.value = '1';"
                        "s.dispatchEvent(new Event('input', {bubbles: true}))")
    wait_for(page, lambda d: node_threshold_drawn(d) == "1", "the graph at threshold 1")
    assert sorted(drawn(page)) == sorted(n["id"] for n in want["nodes"])


def test_the_panel_says_why_where_few_features_were_kept(page, library):
    graph, _ = library
    want = few_features_line(graph, prune_graph(graph, 0.1))
    page.execute_script("const s = document.getElementById('graph-node'); s.value = '0.1';"
                        "s.dispatchEvent(new Event('input', {bubbles: true}))")
    wait_for(page, lambda d: node_threshold_drawn(d) == "0.1", "the graph at threshold 0.1")
    assert values(page, "#graph-why") == [want] and values(page, "#graph-why", "hidden") == [
        False]
    page.execute_script("const s = document.getElementById('graph-node'); s.value = '1';"
                        "s.dispatchEvent(new Event('input', {bubbles: true}))")
    wait_for(page, lambda d: node_threshold_drawn(d) == "1", "the graph at threshold 1")
    assert values(page, "#graph-why", "hidden") == [True]


def test_clicking_an_edge_shows_its_heads(page, library):
    graph, prompt = library
    selector = "#graph .graph-edge[data-target^=\"F\"]"
    source, target = page.execute_script(
        f"const g = document.querySelector('{selector}');"
        "return [g.dataset.source, g.dataset.target]")
    click(page, selector)
    wait_for(page, lambda d: values(d, "#graph-edge", "dataset.state") == ["shown"],
             "the edge's heads")
    index = {node_id(graph.node(i)): i for i in range(graph.n_nodes)}
    want = edge_heads(prompt, graph, index[target], index[source])
    assert values(page, "#graph-edge h3") == [f"{source} → {target}"]
    assert values(page, "#graph-edge-weight") == [
        f"weight {want.weight:.4f} · direct {want.direct:.4f}"]
    rows = page.execute_script(
        "return [...document.querySelectorAll('#graph-edge tr[data-layer]')].map((r) =>"
        "[Number(r.dataset.layer), Number(r.dataset.head), r.cells[1].textContent])")
    assert rows
    for layer, head, shown in rows:
        assert shown == f"{float(want.shares[layer, head]):.4f}"


def test_clicking_a_feature_opens_its_page(page, loaded):
    _, graphs = loaded
    feature, layer = page.execute_script(
        "const g = document.querySelector('#graph .graph-node.feature');"
        "const m = g.dataset.id.match(/^F(\\d+)\\.(\\d+)@/); return [m[2], m[1]]")
    page.execute_script("document.querySelector('#graph .graph-node.feature')"
                        ".dispatchEvent(new MouseEvent('mouseenter'))")
    said = values(page, "#graph-hover")[0]
    assert said.startswith(f"F{layer}.{feature}@") and "activation" in said \
        and "influence" in said
    click(page, "#graph .graph-node.feature")
    wait_for(page, lambda d: values(d, "#feature-page", "dataset.feature") == [feature]
             and values(d, "#feature-page", "hidden") == [False], "the feature's page")
    assert values(page, "#feature-sae", "value") == [graphs.names[f"blocks.{layer}.hook_mlp_out"]]
    assert f"Feature {feature} of" in values(page, "#feature-title")[0]


def test_the_graph_fits_the_window_and_nothing_was_logged(page):
    right, inner, scroll = page.execute_script(
        "return [document.querySelector('#graph svg').getBoundingClientRect().right,"
        "window.innerWidth, document.documentElement.scrollWidth]")
    assert inner >= 1300 and right <= inner and scroll <= inner
    assert [e for e in page.get_log("browser") if e["level"] == "SEVERE"] == []
