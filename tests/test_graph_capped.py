"""max_feature_nodes (circuit-tracer's cap: glassgpt.interp.graph.select), the `--max-feature-nodes`
flag of `glassgpt graph`, and the line saying why a graph kept few features
(export.few_features_line). tests/test_graph_reference.py holds the cap to circuit-tracer's own
choice on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glassgpt.cli import main
from glassgpt.errors import InputError
from glassgpt.interp.graph import AttributionGraph, attribution_graph, load_transcoders
from glassgpt.interp.graph.export import few_features_line, pruned_json
from glassgpt.interp.graph.prune import graph_scores, prune_graph, source_shares
from test_graph import GPT2_LIKE, hand_graph, model_and_transcoders, transcoder

IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])


@pytest.fixture(scope="module")
def both():
    """A float64 model's graph of every active feature, and of a third of them."""
    model, transcoders = model_and_transcoders(torch.float64, **GPT2_LIKE)
    full = attribution_graph(model, transcoders, IDS)
    cap = full.n_features // 3
    capped = attribution_graph(model, transcoders, IDS, max_feature_nodes=cap, batch_size=4,
                               update_interval=1)
    return full, capped


def test_a_capped_graph_is_the_full_graph_restricted_to_the_chosen_features(both) -> None:
    full, capped = both
    assert capped.n_features == full.n_features // 3 and capped.n_active == full.n_features
    assert full.n_active_features is None and capped.n_active_features == full.n_features
    where = {tuple(f): i for i, f in enumerate(full.active_features.tolist())}
    chosen = torch.tensor([where[tuple(f)] for f in capped.active_features.tolist()])
    assert torch.equal(chosen, chosen.sort().values)  # in (layer, position, feature) order
    torch.testing.assert_close(capped.activation_values, full.activation_values[chosen])
    kept = torch.cat([chosen, torch.arange(full.n_features, full.n_nodes)])  # + errors ...
    torch.testing.assert_close(capped.adjacency_matrix,
                               full.adjacency_matrix[kept][:, kept], atol=1e-12, rtol=0)


def test_the_cap_keeps_the_features_with_most_influence_on_the_logits(both) -> None:
    """Each chosen feature reaches the logits through the rows chosen before it: at the end,
    the least influential chosen feature is at least as influential as most of the unchosen."""
    full, capped = both
    from glassgpt.interp.graph.prune import node_influence
    scores = node_influence(full)[:full.n_features]
    where = {tuple(f): i for i, f in enumerate(full.active_features.tolist())}
    chosen = torch.tensor([where[tuple(f)] for f in capped.active_features.tolist()])
    left = torch.ones(full.n_features, dtype=torch.bool)
    left[chosen] = False
    assert scores[chosen].mean() > 3 * scores[left].mean()


def test_a_cap_at_or_above_the_active_features_changes_nothing(both) -> None:
    full, _ = both
    model, transcoders = model_and_transcoders(torch.float64, **GPT2_LIKE)
    same = attribution_graph(model, transcoders, IDS, max_feature_nodes=full.n_features)
    assert same.n_active_features is None
    torch.testing.assert_close(same.adjacency_matrix, full.adjacency_matrix, atol=0, rtol=0)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_the_cap_must_be_a_positive_count(bad) -> None:
    model, transcoders = model_and_transcoders(torch.float64, **GPT2_LIKE)
    with pytest.raises(InputError, match="max_feature_nodes must be a positive count"):
        attribution_graph(model, transcoders, IDS, max_feature_nodes=bad)


def test_a_capped_graph_saves_its_active_count_prunes_and_exports(both, tmp_path) -> None:
    _, capped = both
    loaded = AttributionGraph.load(capped.save(tmp_path / "capped.safetensors"))
    assert loaded.n_active_features == capped.n_active_features == capped.n_active
    torch.testing.assert_close(loaded.adjacency_matrix, capped.adjacency_matrix)
    pruned = prune_graph(loaded)
    data = pruned_json(loaded, pruned, (0.8, 0.98))
    features = [n for n in data["nodes"] if n["kind"] == "feature"]
    assert 0 < len(features) <= capped.n_features
    assert data["scores"]["replacement"] == pytest.approx(graph_scores(loaded)[0])


# --- the command line --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def transcoders_folder(trained_run, tmp_path_factory) -> Path:
    from glassgpt.rundir.checkpoint import load_model

    model, _ = load_model(trained_run.run)
    folder = tmp_path_factory.mktemp("transcoders")
    for layer in range(model.config.n_layer):
        transcoder(layer, model.config.n_embd).save(folder / f"layer{layer}")
    return folder


def graph_cli(run: Path, folder: Path, *flags: object) -> int:
    return main(["graph", str(run), "--transcoders", str(folder), "--prompt", "to be or",
                 *map(str, flags)])


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_the_flag_must_be_positive(trained_run, transcoders_folder, capsys, bad) -> None:
    assert graph_cli(trained_run.run, transcoders_folder, "--max-feature-nodes", bad) == 2
    err = capsys.readouterr().err
    assert f"--max-feature-nodes must be positive, got {bad}" in err and err.count("\n") == 1


def test_the_flag_caps_the_saved_graph(trained_run, transcoders_folder, tmp_path,
                                       capsys) -> None:
    out, js = tmp_path / "g.safetensors", tmp_path / "g.json"
    assert graph_cli(trained_run.run, transcoders_folder, "--max-feature-nodes", "5",
                     "--out", out, "--json", js) == 0
    printed = capsys.readouterr().out
    graph = AttributionGraph.load(out)
    assert graph.n_features == 5 < graph.n_active
    assert f"{graph.n_active} active features (5 of them nodes: --max-feature-nodes)" in printed
    replacement, completeness = graph_scores(graph)
    assert f"replacement score {replacement:.3f}, completeness score {completeness:.3f}" \
        in printed
    data = json.loads(js.read_text())
    kept = {tuple(int(v) for v in n["node_id"].split("_")) for n in data["nodes"]
            if n["feature_type"] == "cross layer transcoder"}  # layer, feature, position
    nodes = {(layer, feature, position) for layer, position, feature in
             graph.active_features.tolist()}
    assert kept <= nodes and len(nodes) == 5


def test_the_start_line_says_how_many_of_the_active_features_get_rows(both) -> None:
    from glassgpt.cli.graph import start_line

    full, _ = both
    K, T, F = full.n_logits, full.n_pos, full.n_features
    logits = f"{K} logit{'s' if K != 1 else ''}"
    assert start_line(full, 7 + K) == (f"attributing {7 + K:,} rows of the adjacency (7 of "
                                       f"{F:,} active features, the most influential at {T} "
                                       f"tokens and {logits})")
    assert start_line(full, F + K) == (f"attributing {F + K:,} rows of the adjacency ({F:,} "
                                       f"active features at {T} tokens and {logits})")


def test_the_default_cap_is_circuit_tracers_and_leaves_a_small_graph_whole(
        trained_run, transcoders_folder, tmp_path, capsys) -> None:
    from glassgpt.interp.graph.select import DEFAULT_MAX_FEATURE_NODES as MAX_FEATURE_NODES

    assert MAX_FEATURE_NODES == 7500  # circuit-tracer's CLI default
    out = tmp_path / "g.safetensors"
    assert graph_cli(trained_run.run, transcoders_folder, "--out", out) == 0
    graph = AttributionGraph.load(out)
    assert graph.n_active_features is None and graph.n_features < MAX_FEATURE_NODES
    assert "of them nodes" not in capsys.readouterr().out


# --- why a graph kept few features -------------------------------------------------------------

def errors_only() -> AttributionGraph:
    """hand_graph with the logit reading the error node alone: the feature reaches nothing."""
    graph = hand_graph()
    graph.adjacency_matrix[5] = 0
    graph.adjacency_matrix[5, 2] = 1.0
    return graph


def test_a_graph_whose_influence_is_all_in_error_nodes_says_why() -> None:
    graph = errors_only()
    pruned = prune_graph(graph)
    assert source_shares(graph, pruned.influence) == (1.0, 0.0)
    line = few_features_line(graph, pruned)
    assert line == ("no feature was kept: the error nodes carry 100% of the logits' influence "
                    "and the token embeddings 0% (the transcoders miss most of what the MLPs "
                    "write); train the transcoders longer or wider, or lower the node threshold "
                    "(--node-threshold)")


def test_a_graph_with_features_kept_says_nothing() -> None:
    model, transcoders = model_and_transcoders(torch.float64, **GPT2_LIKE)
    graph = attribution_graph(model, transcoders, IDS)
    pruned = prune_graph(graph)
    assert int(pruned.node_mask[:graph.n_features].sum()) >= 3
    assert few_features_line(graph, pruned) is None


def test_the_shares_are_the_error_and_token_nodes_influence() -> None:
    graph = hand_graph()  # influence: error 1/16, tokens 3/32 + 11/32 (test_graph's hand sums)
    pruned = prune_graph(graph)
    errors, tokens = source_shares(graph, pruned.influence)
    assert errors == pytest.approx((1 / 16) / (1 / 16 + 14 / 32))
    assert tokens == pytest.approx((14 / 32) / (1 / 16 + 14 / 32))
    line = few_features_line(graph, pruned)  # its one feature kept: "only 1 feature was kept"
    assert line.startswith("only 1 feature was kept: the error nodes carry 12% of the logits' "
                           "influence and the token embeddings 88% (most of it flows from the "
                           "tokens through attention alone)")


def test_the_command_says_why_when_the_transcoders_write_nothing(trained_run, tmp_path,
                                                                  capsys) -> None:
    from glassgpt.rundir.checkpoint import load_model

    model, _ = load_model(trained_run.run)
    folder = tmp_path / "silent"
    for layer in range(model.config.n_layer):
        sae = transcoder(layer, model.config.n_embd)
        with torch.no_grad():
            sae.W_dec.zero_()  # its features fire and write nothing: the error is the MLP
        sae.save(folder / f"layer{layer}")
    assert graph_cli(trained_run.run, folder) == 0
    printed = capsys.readouterr().out
    assert "no feature was kept: the error nodes carry" in printed
    assert "train the transcoders longer or wider" in printed
    graph = attribution_graph(model, load_transcoders([folder]),
                              torch.tensor([[0, 1, 2]]))
    assert graph.n_features > 0  # they were active, not absent


# --- `glassgpt bench graph --real-size`, at a toy size -----------------------------------------

def test_the_real_size_row_prints_its_figures_at_a_toy_size(monkeypatch, capsys,
                                                            tmp_path: Path) -> None:
    import glassgpt.bench.graph as bench

    toy = bench.RealGraphSize(n_layer=2, n_embd=16, n_head=2, n_kv_head=1, head_dim=8,
                              mlp_hidden=32, vocab_size=32, d_sae=64, active=4, prompt_len=8,
                              max_feature_nodes=10, batch_size=4)
    monkeypatch.setattr(bench, "REAL", toy)
    out = tmp_path / "real.json"
    assert main(["bench", "graph", "--real-size", "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # the title wraps at the table's width
    saved = json.loads(out.read_text())
    # The table's rows and figures, never how fast: that is one machine's finding.
    assert "2 layers, width 16, 2 heads / 1 KV, vocabulary 32; 64-latent transcoders; 8-token" \
        in printed
    assert saved["feature_nodes"] == 10 < saved["active_features"]
    assert saved["nodes"] == 10 + 2 * 8 + 8 + saved["nodes"] - 10 - 24 > 34
    assert saved["features_per_token"] == pytest.approx(saved["active_features"] / (2 * 7))
    assert 1 <= saved["features_per_token"] <= 16  # about `active` fire: 4 of 64
    for row, figure in (("active features (a token)", f"{saved['active_features']:,} "
                                                      f"({saved['features_per_token']:.0f})"),
                        ("feature nodes (at most), all nodes", f"10 (10), {saved['nodes']:,}"),
                        ("attribution graph, s", f"{saved['graph_s']:.1f}"),
                        ("peak resident memory, GiB", f"{saved['peak_rss_gib']:.2f}"),
                        ("kept after pruning (0.8 / 0.98)", f"{saved['kept_nodes']:,}")):
        assert row in printed and figure in printed
    assert saved["peak_rss_gib"] > 0.05 and saved["dtype"] in ("bfloat16", "float32")
    assert 0 < saved["replacement_score"] <= 1 and 0 < saved["completeness_score"] <= 1
    assert main(["bench", "train", "--real-size"]) == 2
    assert "--real-size sizes `bench graph`" in capsys.readouterr().err
