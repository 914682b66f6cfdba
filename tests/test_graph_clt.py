"""Attribution graphs over a cross-layer transcoder against circuit-tracer 0.5.0's, on the same
weights.

tests/data/circuit_tracer/clt_graph/ holds a random JumpReLU CLT of the fixture model (64
features a layer, every layer's features writing into its own MLP output and every later one's)
in circuit-tracer's layout, and what circuit-tracer's `attribute`, `prune_graph` and
`compute_graph_scores` made of the fixture prompt through its replacement model over that CLT,
both with every active feature a node (clt_reference.*) and with 80 of them chosen greedily
(clt_capped.*). ../make_fixture.py and ../circuit_tracer_graph.py remake them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import glassgpt.interp.graph.build as build
from glassgpt.interp.graph import attribution_graph
from glassgpt.interp.graph.prune import graph_scores, node_influence, prune_graph
from glassgpt.interp.graph.replacement import by_layer, frozen_run, read_prompt
from glassgpt.interp.sae.circuit_tracer import load_circuit_tracer
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.rundir.checkpoint import load_model

HERE = Path(__file__).parent / "data" / "circuit_tracer"
CLT = HERE / "clt_graph"
CAPPED = {"max_feature_nodes": 80, "batch_size": 2, "update_interval": 1}


@pytest.fixture(scope="module")
def model_and_clt():
    model, _ = load_model(HERE / "run")
    clt = load_circuit_tracer(CLT / "ct_clt", model)
    assert isinstance(clt, CrossLayerTranscoder) and clt.activation == "jumprelu"
    return model, clt


def graph_of(model_and_clt, tag: str, **settings):
    model, clt = model_and_clt
    reference = load_file(CLT / f"{tag}.safetensors")
    ids = reference["input_tokens"][None]
    return attribution_graph(model, clt, ids, **settings), reference, \
        json.loads((CLT / f"{tag}.json").read_text())


def assert_circuit_tracers(graph, reference, settings, selected=None) -> None:
    """Nodes, adjacency (1e-4), influence, pruning and scores as circuit-tracer's."""
    chosen = reference["selected_features"] if selected is None else selected
    assert torch.equal(graph.active_features, reference["active_features"][chosen])
    torch.testing.assert_close(graph.activation_values,
                               reference["activation_values"][chosen], atol=1e-5, rtol=0)
    assert torch.equal(graph.logit_tokens, reference["logit_tokens"])
    expected = reference["adjacency_matrix"]
    assert graph.n_nodes == expected.shape[0]
    torch.testing.assert_close(graph.adjacency_matrix, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(node_influence(graph), reference["node_influence"],
                               atol=1e-6, rtol=0)
    pruned = prune_graph(graph, 0.8, 0.98)
    assert torch.equal(pruned.node_mask, reference["prune_node_mask"].bool())
    assert torch.equal(pruned.edge_mask.nonzero().to(torch.int32), reference["prune_kept_edges"])
    replacement, completeness = graph_scores(graph)
    assert replacement == pytest.approx(settings["replacement_score"], abs=1e-6)
    assert completeness == pytest.approx(settings["completeness_score"], abs=1e-6)


def test_the_clt_graph_equals_circuit_tracers(model_and_clt) -> None:
    graph, reference, settings = graph_of(model_and_clt, "clt_reference")
    assert graph.n_features == settings["n_active_features"] == 224
    assert_circuit_tracers(graph, reference, settings)
    # what layer 0's features write into layer 1's MLP output is in the reference: without
    # those writes (read as transcoders of their own layer), edges move by 0.5
    model, clt = model_and_clt
    own_layer_only = copy.deepcopy(clt)
    with torch.no_grad():
        own_layer_only.W_dec[0][:, 1] = 0
    other = attribution_graph(model, own_layer_only, reference["input_tokens"][None])
    assert (other.adjacency_matrix - reference["adjacency_matrix"]).abs().max() > 0.1


def test_the_capped_clt_graph_selects_circuit_tracers_features(model_and_clt) -> None:
    graph, reference, settings = graph_of(model_and_clt, "clt_capped", **CAPPED)
    assert settings["attribute_kwargs"] | CAPPED == settings["attribute_kwargs"]
    assert graph.n_features == 80 and graph.n_active == 224
    assert_circuit_tracers(graph, reference, settings)


def test_autograd_and_the_written_out_backward_agree_on_a_clt(model_and_clt, monkeypatch
                                                               ) -> None:
    model, clt = model_and_clt
    ids = load_file(CLT / "clt_reference.safetensors")["input_tokens"][None]
    written = attribution_graph(model, clt, ids)
    monkeypatch.setattr(build, "knows", lambda prompt: False)  # the autograd path
    torch.testing.assert_close(attribution_graph(model, clt, ids).adjacency_matrix,
                               written.adjacency_matrix, atol=1e-5, rtol=0)


def test_a_clt_feature_edge_is_what_removing_it_changes(model_and_clt) -> None:
    """In float64: zero a layer-0 feature (its writes into layers 0 and 1 go with it) and a
    logit's input moves by exactly its edge."""
    model, clt = model_and_clt
    model, clt = model.double(), clt.double()
    try:
        ids = load_file(CLT / "clt_reference.safetensors")["input_tokens"][None]
        graph = attribution_graph(model, clt, ids)
        prompt = read_prompt(model, clt, ids)
        source = int((graph.active_features[:, 0] == 0).nonzero()[0])
        layer, position, feature = graph.active_features[source].tolist()
        acts = [a.clone() for a in prompt.acts]
        acts[layer][position, feature] = 0
        logit = graph.logit_tokens[0]

        def logit_input(run) -> float:
            last = run.logits[0, -1].detach()
            return float(last[logit] - last.mean())

        change = logit_input(frozen_run(prompt)) - logit_input(frozen_run(prompt, acts=acts))
        edge = float(graph.adjacency_matrix[graph.logit_index(0), source])
        assert change == pytest.approx(edge, abs=1e-10) and abs(edge) > 1e-6
    finally:
        model.float(), clt.float()


def test_a_clt_that_does_not_fit_the_model_is_refused_by_name(model_and_clt) -> None:
    from glassgpt.errors import InputError

    model, _ = model_and_clt
    with pytest.raises(InputError, match="spans 3 layers of width 32; this model has 2"):
        by_layer(model, CrossLayerTranscoder(3, 32, 8))
    with pytest.raises(InputError, match="reads blocks.0.hook_resid_pre at layer 0"):
        by_layer(model, CrossLayerTranscoder(2, 32, 8, input_hook="blocks.{L}.hook_resid_pre"))


def test_the_graph_command_takes_a_clt_directory(model_and_clt, tmp_path, capsys) -> None:
    from glassgpt.cli import main
    from glassgpt.interp.graph import AttributionGraph

    out = tmp_path / "clt.safetensors"
    assert main(["graph", str(HERE / "run"), "--transcoders", str(CLT / "ct_clt"), "--prompt",
                 "0A5ZQ8mGA9b<", "--out", str(out)]) == 0
    assert "224 active features" in capsys.readouterr().out
    saved = AttributionGraph.load(out)
    reference = load_file(CLT / "clt_reference.safetensors")
    assert torch.equal(saved.input_ids, reference["input_tokens"])
    torch.testing.assert_close(saved.adjacency_matrix, reference["adjacency_matrix"],
                               atol=1e-4, rtol=0)
