"""`glassgpt graph --json`: circuit-tracer's graph file (the JSON its `create_graph_files` writes,
what its local server and Neuronpedia read), equal to circuit-tracer 0.5.0's own file of the
same graph.

tests/data/circuit_tracer/graph_files/ holds circuit-tracer's files of the fixture's graph
(reference.json at the default thresholds, wide.json at 0.99 / 0.995 where 42 features stay,
clt.json of the graph over test_graph_clt.py's cross-layer transcoder), their
graph-metadata.json, and graph_schema.json, the schema circuit-tracer's own pydantic model
of the file gives (frontend/graph_models.Model.model_json_schema()); circuit_tracer_graph.py in
that folder remakes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from safetensors.torch import load_file

from glassgpt.cli import main
from glassgpt.interp.graph import attribution_graph, load_transcoders
from glassgpt.interp.graph.graph_files import graph_file, write_graph_files
from glassgpt.interp.graph.prune import prune_graph
from glassgpt.rundir.checkpoint import load_model

HERE = Path(__file__).parent / "data" / "circuit_tracer"
FILES = HERE / "graph_files"
THRESHOLDS = {"reference": (0.8, 0.98), "wide": (0.99, 0.995)}


@pytest.fixture(scope="module")
def graph():
    model, _ = load_model(HERE / "run")
    ids = load_file(HERE / "reference.safetensors")["input_tokens"]
    return attribution_graph(model, load_transcoders([HERE / "tc"]), ids[None])


def ours(graph, slug: str, folder: Path) -> dict[str, Any]:
    """glassgpt's file of the fixture graph as circuit-tracer's fixture names it: the token
    ids' text their numbers (its id tokenizer), scan "glassgpt-bench"."""
    node_threshold, edge_threshold = THRESHOLDS[slug]
    pruned = prune_graph(graph, node_threshold, edge_threshold)
    data = graph_file(graph, pruned, slug=slug, scan="glassgpt-bench",
                      prompt=" ".join(str(int(t)) for t in graph.input_ids),
                      node_threshold=node_threshold, decode=str)
    return json.loads(write_graph_files(data, folder / f"{slug}.json").read_text())


def assert_same(mine: Any, theirs: Any, where: str = "") -> None:
    """Equal field by field: the same keys, lengths, strings, ints, bools and nulls; floats
    within 1e-5 (both are float32 values of the same graph)."""
    assert type(mine) is type(theirs) or {type(mine), type(theirs)} == {int, float}, where
    if isinstance(theirs, dict):
        assert list(mine) == list(theirs), where
        for key in theirs:
            assert_same(mine[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list):
        assert len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, float):
        assert mine == pytest.approx(theirs, abs=1e-5), where
    else:
        assert mine == theirs, where


@pytest.mark.parametrize("slug", ["reference", "wide"])
def test_the_graph_file_equals_circuit_tracers(graph, tmp_path, slug) -> None:
    theirs = json.loads((FILES / f"{slug}.json").read_text())
    mine = ours(graph, slug, tmp_path)
    kinds = {node["feature_type"] for node in theirs["nodes"]}
    assert len(theirs["links"]) >= 35 and {"embedding", "logit"} <= kinds
    if slug == "wide":  # features, errors, tokens and logits: every kind of node
        assert "cross layer transcoder" in kinds and "mlp reconstruction error" in kinds
    assert_same(mine, theirs)


def test_the_folder_lists_its_graphs_as_circuit_tracers_does(graph, tmp_path) -> None:
    for slug in THRESHOLDS:
        ours(graph, slug, tmp_path)
    ours(graph, "reference", tmp_path)  # written again: its entry replaced, not doubled
    theirs = json.loads((FILES / "graph-metadata.json").read_text())
    mine = json.loads((tmp_path / "graph-metadata.json").read_text())
    assert [g["slug"] for g in mine["graphs"]] == ["wide", "reference"]
    assert_same(sorted(mine["graphs"], key=lambda g: g["slug"]),
                sorted((g for g in theirs["graphs"] if g["slug"] in THRESHOLDS),
                       key=lambda g: g["slug"]))


def test_the_clt_graphs_file_equals_circuit_tracers(tmp_path) -> None:
    from glassgpt.interp.sae.circuit_tracer import load_circuit_tracer

    model, _ = load_model(HERE / "run")
    clt = load_circuit_tracer(HERE / "clt_graph" / "ct_clt", model)
    ids = load_file(HERE / "clt_graph" / "clt_reference.safetensors")["input_tokens"]
    graph = attribution_graph(model, clt, ids[None])
    data = graph_file(graph, prune_graph(graph), slug="clt", scan="glassgpt-fixture/clt",
                      prompt=" ".join(str(int(t)) for t in ids), node_threshold=0.8,
                      decode=str)
    mine = json.loads(write_graph_files(data, tmp_path / "clt.json").read_text())
    theirs = json.loads((FILES / "clt.json").read_text())
    assert {n["layer"] for n in theirs["nodes"]
            if n["feature_type"] == "cross layer transcoder"} == {"0", "1"}
    assert_same(mine, theirs)


def test_the_file_has_the_keys_and_types_of_circuit_tracers_model(graph, tmp_path) -> None:
    schema = json.loads((FILES / "graph_schema.json").read_text())
    mine = ours(graph, "wide", tmp_path)
    jsonschema.validate(mine, schema)
    models = schema["$defs"]
    assert set(mine) == set(schema["properties"])
    assert set(mine["metadata"]) == set(models["Metadata"]["properties"])
    assert set(mine["qParams"]) == set(models["QParams"]["properties"])
    for node in mine["nodes"]:
        assert set(node) == set(models["Node"]["properties"])
    assert all(set(link) == {"source", "target", "weight"} for link in mine["links"])
    ids = {node["node_id"] for node in mine["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in mine["links"])
    with pytest.raises(jsonschema.ValidationError):  # the schema does hold a file to its types
        jsonschema.validate({**mine, "nodes": [{**mine["nodes"][0], "layer": 1}]}, schema)


def test_the_graph_command_writes_a_folder_circuit_tracers_server_reads(tmp_path, capsys
                                                                      ) -> None:
    folder = tmp_path / "graphs"

    def graph_json(name: str, *flags: str) -> int:
        return main(["graph", str(HERE / "run"), "--transcoders", str(HERE / "tc"), "--prompt",
                     "0A5Z", "--json", str(folder / name), *flags])

    assert graph_json("first.json") == 0 and graph_json("second.json") == 0
    assert "start-server --graph_file_dir" in capsys.readouterr().out
    listed = json.loads((folder / "graph-metadata.json").read_text())["graphs"]
    assert [g["slug"] for g in listed] == ["first", "second"]
    data = json.loads((folder / "first.json").read_text())
    assert data["metadata"]["prompt_tokens"] == list("0A5Z")
    assert data["metadata"]["scan"] == "run" and listed[0] == data["metadata"]
    assert graph_json("first.json") == 2  # a file already there stays
    assert graph_json("first.json", "--force") == 0
    capsys.readouterr()
    assert graph_json("graph") == 2
    assert "a graph file is named SLUG.json" in capsys.readouterr().err
    (folder / "graph-metadata.json").write_text('{"my": "notes"}')
    assert graph_json("third.json") == 2
    err = capsys.readouterr().err
    assert "is not the list of graphs" in err and err.count("\n") == 1
    assert not (folder / "third.json").exists()
