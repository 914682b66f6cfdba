"""glassgpt's attribution graph of a model with a final logit soft-cap (Gemma 2's
`final_logit_softcapping`), against circuit-tracer 0.5.0's on the same weights.

The model is tests/data/circuit_tracer's 2-layer GPT-2-style one with `logit_softcap` = 10 (its
largest logit, 15.8 uncapped, is 9.5 capped), read by circuit-tracer through glassgpt's
`--to-lens` checkpoint, whose config carries the cap as `output_logits_soft_cap` (TransformerLens
applies it: its logits equal glassgpt's within 5e-6); the transcoders are the folder's tc/.
circuit-tracer chooses the logit nodes by the probabilities of the capped logits (9 tokens reach
0.95 here, where 3 do without the cap) and a logit node's row is of the logit before the cap minus
the mean such logit; its own check of the edges lifts the cap (`zero_softcap`). The folder's
scripts remake softcap/ (circuit_tracer_graph.py says how).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import glassgpt.interp.graph.build as build
from glassgpt.interp.graph import attribution_graph, load_transcoders
from glassgpt.interp.graph.prune import graph_scores, node_influence, prune_graph
from glassgpt.interp.graph.replacement import frozen_run, logit_inputs, read_prompt
from glassgpt.interp.sae.circuit_tracer import load_circuit_tracer
from glassgpt.rundir.checkpoint import load_model

HERE = Path(__file__).parent / "data" / "circuit_tracer"
SOFTCAP = HERE / "softcap"


@pytest.fixture(scope="module")
def capped():
    model, _ = load_model(SOFTCAP / "run")
    transcoders = load_transcoders([HERE / "tc"])
    reference = load_file(SOFTCAP / "reference.safetensors")
    ids = reference["input_tokens"][None]
    return model, transcoders, ids, reference


def test_the_cap_is_the_models_and_it_picks_circuit_tracers_logit_nodes(capped) -> None:
    model, transcoders, ids, reference = capped
    assert model.config.logit_softcap == 10.0
    graph = attribution_graph(model, transcoders, ids)
    assert torch.equal(graph.active_features, reference["active_features"])
    assert torch.equal(graph.logit_tokens, reference["logit_tokens"])
    torch.testing.assert_close(graph.logit_probabilities, reference["logit_probabilities"],
                               atol=1e-6, rtol=0)
    assert graph.n_logits == 9  # the capped softmax's; the uncapped one needs 3
    with torch.no_grad():
        logits, _ = model(ids)
    capped_probs = logits[0, -1].softmax(-1)[graph.logit_tokens]
    torch.testing.assert_close(graph.logit_probabilities, capped_probs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("path", ["written-out", "autograd"])
def test_the_adjacency_pruning_and_scores_equal_circuit_tracers(capped, path, monkeypatch
                                                               ) -> None:
    model, transcoders, ids, reference = capped
    if path == "autograd":
        monkeypatch.setattr(build, "knows", lambda prompt: False)
    graph = attribution_graph(model, transcoders, ids)
    expected = reference["adjacency_matrix"]
    assert graph.n_nodes == expected.shape[0] == 270 + 2 * 12 + 12 + 9
    assert expected[-9:].abs().max() > 10  # logit rows of every size
    torch.testing.assert_close(graph.adjacency_matrix, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(node_influence(graph), reference["node_influence"],
                               atol=1e-6, rtol=0)
    pruned = prune_graph(graph, 0.8, 0.98)
    assert torch.equal(pruned.node_mask, reference["prune_node_mask"].bool())
    assert torch.equal(pruned.edge_mask.nonzero().to(torch.int32), reference["prune_kept_edges"])
    torch.testing.assert_close(pruned.cumulative_scores, reference["prune_cumulative_scores"],
                               atol=1e-6, rtol=0)
    settings = json.loads((SOFTCAP / "reference.json").read_text())
    assert settings["circuit_tracer_version"] == "0.5.0"
    replacement, completeness = graph_scores(graph)
    assert replacement == pytest.approx(settings["replacement_score"], abs=1e-6)
    assert completeness == pytest.approx(settings["completeness_score"], abs=1e-6)


def test_removing_a_feature_moves_each_pre_cap_logit_by_its_edge(capped) -> None:
    """circuit-tracer's own check (its feature_intervention, every layer constrained, under
    zero_softcap) held its edges within 6e-6 of what removing each of the 270 features did to
    the demeaned pre-cap logits, and missed by 0.26 with the cap left on; glassgpt's frozen
    run gives its own edges the same way."""
    removals = json.loads((SOFTCAP / "removals.json").read_text())
    assert removals["cap_lifted"]["n_features_removed"] == 270
    assert removals["cap_lifted"]["logit_max_abs_miss"] < 1e-5
    assert removals["cap_lifted"]["feature_max_abs_miss"] < 1e-5
    assert removals["cap_kept"]["logit_max_abs_miss"] > 0.1
    model, transcoders, ids, _ = capped
    graph = attribution_graph(model, transcoders, ids)
    prompt = read_prompt(model, transcoders, ids)
    row, tokens = torch.zeros(len(graph.logit_tokens), dtype=torch.long), graph.logit_tokens

    def logit_values(run) -> torch.Tensor:
        return logit_inputs(run, row, tokens).detach()

    before = logit_values(frozen_run(prompt))
    capped_last = prompt.logits[-1]
    assert (before - (capped_last[tokens] - capped_last.mean())).abs().max() > 0.1
    for source in range(0, graph.n_features, 9):  # 30 of the 270
        layer, position, feature = graph.active_features[source].tolist()
        acts = [a.clone() for a in prompt.acts]
        acts[layer][position, feature] = 0
        change = before - logit_values(frozen_run(prompt, acts=acts))
        edges = graph.adjacency_matrix[graph.logit_slice, source]
        torch.testing.assert_close(change, edges, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["written-out", "autograd"])
def test_a_clt_graph_of_the_capped_model_equals_circuit_tracers(capped, path, monkeypatch
                                                               ) -> None:
    """The folder's cross-layer transcoder over the capped model (circuit-tracer's CLT loaded by
    its own loader, the model from the `--to-lens --circuit-tracer` export): the same 9 logit
    nodes, adjacency, pruning and scores; circuit-tracer's removal check held within 6e-6."""
    model, _, ids, _ = capped
    clt = load_circuit_tracer(HERE / "clt_graph" / "ct_clt", model)
    reference = load_file(SOFTCAP / "clt_reference.safetensors")
    settings = json.loads((SOFTCAP / "clt_reference.json").read_text())
    if path == "autograd":
        monkeypatch.setattr(build, "knows", lambda prompt: False)
    graph = attribution_graph(model, clt, ids)
    assert torch.equal(graph.active_features, reference["active_features"])
    assert torch.equal(graph.logit_tokens, reference["logit_tokens"]) and graph.n_logits == 9
    torch.testing.assert_close(graph.logit_probabilities, reference["logit_probabilities"],
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(graph.adjacency_matrix, reference["adjacency_matrix"],
                               atol=1e-4, rtol=0)
    pruned = prune_graph(graph, 0.8, 0.98)
    assert torch.equal(pruned.node_mask, reference["prune_node_mask"].bool())
    assert torch.equal(pruned.edge_mask.nonzero().to(torch.int32), reference["prune_kept_edges"])
    replacement, completeness = graph_scores(graph)
    assert replacement == pytest.approx(settings["replacement_score"], abs=1e-6)
    assert completeness == pytest.approx(settings["completeness_score"], abs=1e-6)
    removals = json.loads((SOFTCAP / "clt_removals.json").read_text())["cap_lifted"]
    assert removals["n_features_removed"] == 224
    assert max(removals["logit_max_abs_miss"], removals["feature_max_abs_miss"]) < 1e-5
