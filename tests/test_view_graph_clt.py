"""The Graph panel over a cross-layer transcoder (`glassgpt view RUN --transcoders CLT_DIR`),
through its API: the graph is the library's graph over the CLT, each CLT layer joins the
Features panel as a transcoder of its own layer, and a feature's page lists the MLP outputs its
decoder writes into. The run and the CLT are tests/data/circuit_tracer's (a 2-layer model and a
random JumpReLU CLT in circuit-tracer's layout, test_graph_clt.py's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from glassgpt.interp import run_with_cache
from glassgpt.interp.graph import attribution_graph
from glassgpt.interp.graph.export import pruned_json
from glassgpt.interp.graph.prune import prune_graph
from glassgpt.interp.sae.circuit_tracer import load_circuit_tracer
from glassgpt.view.features import load_dictionaries
from glassgpt.view.graph import load_graphs
from glassgpt.view.server import create_app, load_for_view
from test_view_graph import close

HERE = Path(__file__).parent / "data" / "circuit_tracer"
CLT_DIR = HERE / "clt_graph" / "ct_clt"
PROMPT = "0A5ZQ8mGA9b<"


@pytest.fixture(scope="module")
def view():
    return load_for_view(HERE / "run")


@pytest.fixture(scope="module")
def client(view):
    dicts = load_dictionaries(view, [])
    graphs = load_graphs(view, [CLT_DIR], dicts)
    with TestClient(create_app(view, dictionaries=dicts, graphs=graphs),
                    base_url="http://127.0.0.1") as c:
        yield c


@pytest.fixture(scope="module")
def clt(view):
    return load_circuit_tracer(CLT_DIR, view.model)


def test_the_view_takes_a_clt_and_its_layers_join_the_features_panel(client) -> None:
    answer = client.get("/api/graph/available").json()
    assert answer["available"] is True and answer["crosslayer"] is True
    assert [t["hook"] for t in answer["transcoders"]] == ["blocks.0.hook_mlp_out",
                                                          "blocks.1.hook_mlp_out"]
    names = [t["name"] for t in answer["transcoders"]]
    assert names == ["ct_clt/layer0", "ct_clt/layer1"]
    listed = client.get("/api/dictionaries").json()["dictionaries"]
    assert [d["name"] for d in listed] == names
    assert all(d["architecture"] == "jumprelu_transcoder" and d["d_sae"] == 64 for d in listed)


def test_the_graph_is_the_librarys_graph_over_the_clt(client, view, clt) -> None:
    graph = attribution_graph(view.model, clt, view.encode(PROMPT).idx)
    answer = client.post("/api/graph", json={"prompt": PROMPT, "node_threshold": 0.95}).json()
    mapping = answer.pop("dictionaries")
    answer.pop("why")
    close(answer, pruned_json(graph, prune_graph(graph, 0.95, 0.98), (0.95, 0.98),
                              view.token_text))
    features = [n for n in answer["nodes"] if n["kind"] == "feature"]
    assert {n["layer"] for n in features} == {0, 1}  # features of both layers stayed
    assert all(mapping[n["dictionary"]] == f"ct_clt/layer{n['layer']}" for n in features)


def test_a_clt_features_page_lists_the_layers_it_writes_into(client, view, clt) -> None:
    ids = view.encode(PROMPT).idx
    for layer in range(2):
        top = client.post("/api/features", json={"prompt": PROMPT,
                                                 "sae": f"ct_clt/layer{layer}"}).json()
        # the page's latents are the CLT's own features of that layer
        _, cache = run_with_cache(view.model, ids, [clt.input_hook_at(layer)])
        with torch.no_grad():
            acts = clt.encode_layer(cache[clt.input_hook_at(layer)][0], layer)  # (T, 64)
        best = top["positions"][5][0]
        assert best["value"] == pytest.approx(float(acts[5].max()), rel=1e-4)
        assert best["id"] == int(acts[5].argmax())
        page = client.post("/api/feature", json={"sae": f"ct_clt/layer{layer}",
                                                 "feature": best["id"]}).json()
        norms = clt.decoder_rows(layer)[best["id"]].detach().norm(dim=-1)
        assert [w["layer"] for w in page["writes_to"]] == list(range(layer, 2))
        assert [w["norm"] for w in page["writes_to"]] == pytest.approx(norms.tolist())
        assert page["logits"]["up"]  # through its own layer's decoder, as a transcoder's


def test_a_clt_features_edge_splits_over_heads(client, view, clt) -> None:
    from glassgpt.interp.graph.heads import edge_heads
    from glassgpt.interp.graph.replacement import read_prompt

    answer = client.post("/api/graph", json={"prompt": PROMPT, "node_threshold": 0.95}).json()
    index = {n["id"]: n["index"] for n in answer["nodes"]}
    edge = next(e for e in answer["edges"] if e["source"].startswith("F0."))
    got = client.post("/api/graph/edge", json={"prompt": PROMPT, "source": edge["source"],
                                               "target": edge["target"]}).json()
    ids = view.encode(PROMPT).idx
    graph = attribution_graph(view.model, clt, ids)
    want = edge_heads(read_prompt(view.model, clt, ids), graph, index[edge["target"]],
                      index[edge["source"]])
    assert got["weight"] == pytest.approx(want.weight, rel=1e-5) == edge["weight"]
    assert got["direct"] == pytest.approx(want.direct, rel=1e-4, abs=1e-6)
