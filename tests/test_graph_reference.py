"""glassgpt's attribution graph against circuit-tracer 0.5.0's, on the same weights.

circuit-tracer pins TransformerLens < 4 and cannot be installed beside glassgpt, so its output
is kept in tests/data/circuit_tracer/: a 2-layer GPT-2-style model (LayerNorm gains and biases
drawn far from 1 and 0), a ReLU transcoder for each MLP, and what circuit-tracer's `attribute`,
`prune_graph` and `compute_graph_scores` made of a 12-token prompt through its own replacement
model over TransformerLens (the model exported with glassgpt's `--to-lens` checkpoint). The
folder's two scripts remake it (circuit_tracer_graph.py says how).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from glassgpt.interp.graph import attribution_graph, load_transcoders
from glassgpt.interp.graph.prune import graph_scores, node_influence, prune_graph
from glassgpt.rundir.checkpoint import load_model

HERE = Path(__file__).parent / "data" / "circuit_tracer"


@pytest.fixture(scope="module")
def both():
    model, _ = load_model(HERE / "run")
    reference = load_file(HERE / "reference.safetensors")
    ids = reference["input_tokens"][None]
    graph = attribution_graph(model, load_transcoders([HERE / "tc"]), ids)
    return graph, reference


def test_the_nodes_are_circuit_tracers(both) -> None:
    graph, reference = both
    assert torch.equal(graph.active_features, reference["active_features"])
    torch.testing.assert_close(graph.activation_values, reference["activation_values"],
                               atol=1e-5, rtol=0)
    assert torch.equal(graph.logit_tokens, reference["logit_tokens"])
    torch.testing.assert_close(graph.logit_probabilities, reference["logit_probabilities"],
                               atol=1e-6, rtol=0)
    assert graph.n_nodes == reference["adjacency_matrix"].shape[0] == 309


def test_the_adjacency_equals_circuit_tracers_within_1e_4(both) -> None:
    graph, reference = both
    expected = reference["adjacency_matrix"]
    assert expected.abs().max() > 10  # edges of every size, not a matrix of near-zeros
    torch.testing.assert_close(graph.adjacency_matrix, expected, atol=1e-4, rtol=0)


def test_pruning_and_scores_equal_circuit_tracers(both) -> None:
    graph, reference = both
    torch.testing.assert_close(node_influence(graph), reference["node_influence"],
                               atol=1e-6, rtol=0)
    pruned = prune_graph(graph, 0.8, 0.98)
    assert torch.equal(pruned.node_mask, reference["prune_node_mask"].bool())
    kept = pruned.edge_mask.nonzero().to(torch.int32)
    assert torch.equal(kept, reference["prune_kept_edges"])
    torch.testing.assert_close(pruned.cumulative_scores, reference["prune_cumulative_scores"],
                               atol=1e-6, rtol=0)
    with safe_open(HERE / "reference.safetensors", "pt") as file:
        metadata = file.metadata()
    replacement, completeness = graph_scores(graph)
    assert replacement == pytest.approx(float(metadata["replacement_score"]), abs=1e-6)
    assert completeness == pytest.approx(float(metadata["completeness_score"]), abs=1e-6)
    settings = json.loads((HERE / "reference.json").read_text())
    assert settings["circuit_tracer_version"] == "0.5.0"
    assert settings["n_kept_nodes"] == int(pruned.node_mask.sum())


# circuit-tracer's `attribute(max_feature_nodes=100, batch_size=2, update_interval=1)` on the
# same weights and prompt: 100 of the 270 active features, chosen greedily over 50 rankings (the
# 100 ranked once would differ in 2; the closest call at a round's cut is 1e-3 apart, far
# beyond float32's rounding).
CAPPED = {"max_feature_nodes": 100, "batch_size": 2, "update_interval": 1}


@pytest.fixture(scope="module")
def capped():
    model, _ = load_model(HERE / "run")
    reference = load_file(HERE / "capped.safetensors")
    ids = reference["input_tokens"][None]
    graph = attribution_graph(model, load_transcoders([HERE / "tc"]), ids, **CAPPED)
    return graph, reference


def test_the_capped_graph_selects_circuit_tracers_features(capped) -> None:
    graph, reference = capped
    selected = reference["selected_features"]
    assert len(selected) == CAPPED["max_feature_nodes"] == graph.n_features
    assert graph.n_active == len(reference["active_features"]) == 270
    assert torch.equal(graph.active_features, reference["active_features"][selected])
    torch.testing.assert_close(graph.activation_values, reference["activation_values"][selected],
                               atol=1e-5, rtol=0)
    # not simply the first 100, nor the 100 with the largest activations
    assert not torch.equal(selected, torch.arange(100))
    largest = reference["activation_values"].topk(100).indices.sort().values
    assert not torch.equal(selected, largest)


def test_the_capped_adjacency_pruning_and_scores_are_circuit_tracers(capped) -> None:
    graph, reference = capped
    expected = reference["adjacency_matrix"]
    assert graph.n_nodes == expected.shape[0] == 100 + 2 * 12 + 12 + 3
    torch.testing.assert_close(graph.adjacency_matrix, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(node_influence(graph), reference["node_influence"],
                               atol=1e-6, rtol=0)
    pruned = prune_graph(graph, 0.8, 0.98)
    assert torch.equal(pruned.node_mask, reference["prune_node_mask"].bool())
    assert torch.equal(pruned.edge_mask.nonzero().to(torch.int32), reference["prune_kept_edges"])
    settings = json.loads((HERE / "capped.json").read_text())
    assert settings["attribute_kwargs"] | CAPPED == settings["attribute_kwargs"]
    replacement, completeness = graph_scores(graph)
    assert replacement == pytest.approx(settings["replacement_score"], abs=1e-6)
    assert completeness == pytest.approx(settings["completeness_score"], abs=1e-6)
