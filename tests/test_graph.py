"""Attribution graphs (glassgpt.interp.graph), held to circuit-tracer's own check and to sums
worked out by hand.

circuit-tracer's check: in the replacement model with attention patterns and norm scales
frozen, removing a node changes every target's input by exactly the edge between them. Here
the removal is a forward run (`frozen_run` with the node's value zeroed) and the edge comes
from the backward passes of `attribution_graph`, so the two sides share no arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, InputError
from glassgpt.interp.graph import AttributionGraph, attribution_graph, load_transcoders
from glassgpt.interp.graph.export import node_id, pruned_json
from glassgpt.interp.graph.heads import edge_heads
from glassgpt.interp.graph.prune import graph_scores, influence, normalize_matrix, prune_graph
from glassgpt.interp.graph.replacement import (
    feature_inputs,
    frozen_run,
    logit_inputs,
    read_prompt,
)
from glassgpt.interp.sae import SAE, SAEConfig
from glassgpt.model import GPT

GPT2_LIKE = dict(n_layer=3, n_head=2, n_embd=16, block_size=16, vocab_size=20)
LLAMA_LIKE = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, block_size=16, vocab_size=20,
                  norm="rmsnorm", position="rope", activation="swiglu", bias=False,
                  qk_norm=True, tie_weights=False)


def transcoder(layer: int, width: int, d_sae: int = 32, seed: int = 0,
               dtype: torch.dtype = torch.float32, reads: str = "ln2.hook_normalized") -> SAE:
    """A ReLU transcoder for layer `layer` with random weights, its encoder biased so that some
    features fire on a prompt and most do not."""
    config = SAEConfig(d_in=width, d_sae=d_sae, architecture="transcoder", d_out=width,
                       apply_b_dec_to_input=False, dtype=str(dtype).removeprefix("torch."))
    config.metadata.hook_name = f"blocks.{layer}.{reads}"
    config.metadata.hook_name_out = f"blocks.{layer}.hook_mlp_out"
    torch.manual_seed(100 + seed + layer)
    sae = SAE(config)
    with torch.no_grad():
        sae.b_enc.uniform_(-0.8, 0.0)
        sae.W_dec.mul_(0.3)
    return sae


def model_and_transcoders(dtype: torch.dtype, **config: object) -> tuple[GPT, list[SAE]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config)).to(dtype).eval()
    c = model.config
    return model, [transcoder(layer, c.n_embd, dtype=dtype) for layer in range(c.n_layer)]


def target_values(prompt, graph: AttributionGraph, run) -> torch.Tensor:
    """Every target's input (features, then logits) in copy 0 of a frozen run."""
    row = torch.zeros(1, dtype=torch.long)
    values = [feature_inputs(prompt, run, layer, row, torch.tensor([pos]), torch.tensor([f]))
              for layer, pos, f in graph.active_features.tolist()]
    values += [logit_inputs(run, row, torch.tensor([t])) for t in graph.logit_tokens.tolist()]
    return torch.cat(values).detach()


def without(prompt, graph: AttributionGraph, source: int) -> dict[str, object]:
    from glassgpt.interp.graph.heads import removed
    return removed(prompt, graph, source)


def target_rows(graph: AttributionGraph) -> list[int]:
    return [*range(graph.n_features), *range(graph.logit_slice.start, graph.n_nodes)]


@pytest.mark.parametrize("family", [GPT2_LIKE, LLAMA_LIKE], ids=["gpt2", "llama"])
def test_removing_a_node_changes_each_target_by_its_edge(family) -> None:
    """circuit-tracer's check, in float32 at its tolerances (5e-4 features, 1e-5 logits)."""
    model, transcoders = model_and_transcoders(torch.float32, **family)
    ids = torch.randint(0, 20, (1, 12), generator=torch.Generator().manual_seed(1))
    graph = attribution_graph(model, transcoders, ids, batch_size=16)
    prompt = read_prompt(model, transcoders, ids)
    assert graph.n_features > 20
    before = target_values(prompt, graph, frozen_run(prompt))
    rows = target_rows(graph)
    sources = [*range(0, graph.n_features, max(1, graph.n_features // 12)),
               *range(graph.error_slice.start, graph.error_slice.stop, 5),
               *range(graph.token_slice.start, graph.token_slice.stop)]
    for source in sources:
        after = target_values(prompt, graph, frozen_run(prompt, **without(prompt, graph, source)))
        change = before - after
        edges = graph.adjacency_matrix[rows, source]
        n = graph.n_features
        torch.testing.assert_close(change[:n], edges[:n], atol=5e-4, rtol=0)
        torch.testing.assert_close(change[n:], edges[n:], atol=1e-5, rtol=0)


def test_in_float64_the_edges_are_exact_and_every_input_is_its_row_plus_constants() -> None:
    model, transcoders = model_and_transcoders(torch.float64, **GPT2_LIKE)
    ids = torch.randint(0, 20, (1, 10), generator=torch.Generator().manual_seed(2))
    graph = attribution_graph(model, transcoders, ids, batch_size=7)
    prompt = read_prompt(model, transcoders, ids)
    run = frozen_run(prompt)
    # The replacement computes exactly what the model computes (the error nodes see to it).
    torch.testing.assert_close(run.logits[0].detach(), prompt.logits, atol=1e-12, rtol=0)
    before = target_values(prompt, graph, run)
    # With every node written as zero, what is left is the constants (biases, shifts).
    zero_acts = [torch.zeros_like(a) for a in prompt.acts]
    bare = frozen_run(prompt, acts=zero_acts, errors=torch.zeros_like(prompt.errors),
                      embed=torch.zeros_like(prompt.embed))
    constants = target_values(prompt, graph, bare)
    rows = graph.adjacency_matrix[target_rows(graph)]
    torch.testing.assert_close(rows.sum(1) + constants, before, atol=1e-10, rtol=0)
    for source in (0, graph.n_features // 2, graph.error_index(1, 4), graph.token_index(9)):
        after = target_values(prompt, graph, frozen_run(prompt, **without(prompt, graph, source)))
        torch.testing.assert_close(before - after, graph.adjacency_matrix[target_rows(graph),
                                                                          source],
                                   atol=1e-12, rtol=0)


def test_the_nodes_are_laid_out_as_circuit_tracer_lays_them_out() -> None:
    model, transcoders = model_and_transcoders(torch.float64, **GPT2_LIKE)
    ids = torch.randint(0, 20, (1, 9), generator=torch.Generator().manual_seed(3))
    graph = attribution_graph(model, transcoders, ids, max_n_logits=4, desired_logit_prob=0.99)
    prompt = read_prompt(model, transcoders, ids)
    expected = [[layer, pos, f] for layer, acts in enumerate(prompt.acts)
                for pos in range(9) for f in range(acts.shape[1]) if acts[pos, f] > 0]
    assert graph.active_features.tolist() == expected
    for (layer, pos, f), value in zip(expected, graph.activation_values.tolist(), strict=True):
        assert value == float(prompt.acts[layer][pos, f])
    probs = torch.softmax(prompt.logits[-1], -1)
    assert graph.logit_tokens.tolist() == probs.topk(4).indices.tolist()  # 4 < 0.99 of the mass
    assert graph.n_nodes == len(expected) + 3 * 9 + 9 + 4
    A = graph.adjacency_matrix
    assert not A[graph.error_slice].any() and not A[graph.token_slice].any()
    assert not A[:, graph.logit_slice].any()  # logits write to nothing
    # A feature reads only what earlier layers wrote at its position or before.
    for row, (layer, pos, _) in enumerate(graph.active_features.tolist()):
        sources = A[row, :graph.n_features].nonzero()[:, 0]
        assert all(graph.active_features[s, 0] < layer and graph.active_features[s, 1] <= pos
                   for s in sources.tolist())
        assert not A[row, graph.token_index(pos) + 1:graph.token_slice.stop].any()
    assert [node_id(graph.node(i)) for i in (graph.error_index(2, 3), graph.token_index(4),
                                              graph.logit_index(0))] == \
        ["E2@3", "T@4", f"L{graph.logit_tokens[0]}"]


def test_one_target_at_a_time_gives_the_same_matrix_as_many() -> None:
    model, transcoders = model_and_transcoders(torch.float64, **LLAMA_LIKE)
    ids = torch.randint(0, 20, (1, 8), generator=torch.Generator().manual_seed(4))
    one = attribution_graph(model, transcoders, ids, batch_size=1)
    many = attribution_graph(model, transcoders, ids, batch_size=500)
    torch.testing.assert_close(one.adjacency_matrix, many.adjacency_matrix, atol=1e-12, rtol=0)


def test_an_attention_only_model_needs_no_transcoders() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**GPT2_LIKE, "attn_only": True})).double().eval()
    graph = attribution_graph(model, [], torch.tensor([[1, 2, 3, 1, 2]]))
    assert graph.n_features == 0 and graph.n_nodes == 3 * 5 + 5 + graph.n_logits
    assert graph.adjacency_matrix[graph.logit_slice, graph.token_slice].abs().sum() > 0
    assert not graph.adjacency_matrix[:, graph.error_slice].any()


def test_the_heads_shares_add_up_to_the_edge_where_each_path_takes_one_head() -> None:
    """One layer: every path from a token to a logit or a feature crosses at most one head, so
    direct + the shares = the edge, and across positions direct is 0."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=3, n_embd=12, block_size=8, vocab_size=11)
                ).double().eval()
    transcoders = [transcoder(0, 12, dtype=torch.float64)]
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    graph = attribution_graph(model, transcoders, ids)
    prompt = read_prompt(model, transcoders, ids)
    target = graph.logit_index(0)
    for position in range(6):
        split = edge_heads(prompt, graph, target, graph.token_index(position))
        assert split.direct + float(split.shares.sum()) == pytest.approx(split.weight, abs=1e-12)
        if position < 5:
            assert split.direct == 0.0
        assert split.shares.shape == (1, 3)
    feature = int((graph.active_features[:, 1] == 5).nonzero()[0])
    split = edge_heads(prompt, graph, feature, graph.token_index(2))  # layer 0's heads, then
    assert split.direct == 0.0 and split.weight != 0.0  # its MLP's transcoder reads the move
    assert float(split.shares.sum()) == pytest.approx(split.weight, abs=1e-12)
    with pytest.raises(InputError, match="only features and logits have edges in"):
        edge_heads(prompt, graph, graph.token_index(0), 0)


def hand_graph() -> AttributionGraph:
    """Two tokens, one feature, one error node (one layer), one logit:
    token0 -> feature (2), token1 -> feature (-2), feature -> logit (3), error -> logit (1),
    token1 -> logit (4)."""
    A = torch.zeros(6, 6, dtype=torch.float64)  # feature 0, errors 1-2, tokens 3-4, logit 5
    A[0, 3], A[0, 4] = 2.0, -2.0
    A[5, 0], A[5, 2], A[5, 4] = 3.0, 1.0, 4.0
    return AttributionGraph(torch.tensor([7, 8]), torch.tensor([[0, 1, 5]]),
                            torch.tensor([1.5], dtype=torch.float64), torch.tensor([2]),
                            torch.tensor([0.5], dtype=torch.float64), A, 1,
                            ["blocks.0.hook_mlp_out"])


def test_influence_and_the_scores_on_a_graph_worked_out_by_hand() -> None:
    graph = hand_graph()
    # Normalised: the logit's row is 3/8, 1/8, 4/8 (feature, error 1, token 1); the feature's
    # row is 1/2, 1/2 (tokens 0 and 1). Influence from w = 0.5 at the logit:
    # feature 3/16, error 1/16, token1 4/16 + 3/16 * 1/2 = 11/32, token0 3/32.
    scores = influence(normalize_matrix(graph.adjacency_matrix), torch.tensor(
        [0, 0, 0, 0, 0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(scores, torch.tensor([3 / 16, 0, 1 / 16, 3 / 32, 11 / 32, 0],
                                                    dtype=torch.float64))
    replacement, completeness = graph_scores(graph)
    assert replacement == pytest.approx((14 / 32) / (14 / 32 + 1 / 16))
    # Non-error share of each row: logit 7/8, every other row 1; weights: influence + w.
    weight = [3 / 16, 0, 1 / 16, 3 / 32, 11 / 32, 0.5]
    assert completeness == pytest.approx((sum(weight) - 0.5 / 8) / sum(weight))


def test_pruning_keeps_what_carries_the_influence() -> None:
    graph = hand_graph()
    everything = prune_graph(graph, node_threshold=1.0, edge_threshold=1.0)
    # All but the error node at position 0, which writes nothing (influence 0).
    assert everything.node_mask.tolist() == [True, False, True, True, True, True]
    assert int(everything.edge_mask.sum()) == 5
    # In 32nds, influence is token1 11, feature 6, token0 3, error 2: shares from the top.
    torch.testing.assert_close(everything.cumulative_scores, torch.tensor(
        [17 / 22, 1, 1, 20 / 22, 11 / 22, 1], dtype=torch.float64))
    # The feature's own edges carry little: at an edge threshold of 0.7 the strongest stay.
    lean = prune_graph(graph, node_threshold=1.0, edge_threshold=0.7)
    assert lean.edge_mask[5, 4] and lean.edge_mask[5, 0]
    assert not lean.edge_mask[5, 2] and not lean.node_mask[2]  # the error's one edge went
    # A model whose transcoders are perfect (errors write nothing) scores 1 and 1.
    perfect = hand_graph()
    perfect.adjacency_matrix[5, 2] = 0.0
    assert graph_scores(perfect) == pytest.approx((1.0, 1.0))
    with pytest.raises(InputError, match="node_threshold"):
        prune_graph(graph, node_threshold=0.0)


def test_a_real_graph_prunes_monotonically_and_its_json_names_what_stayed() -> None:
    model, transcoders = model_and_transcoders(torch.float32, **GPT2_LIKE)
    ids = torch.randint(0, 20, (1, 12), generator=torch.Generator().manual_seed(5))
    graph = attribution_graph(model, transcoders, ids)
    kept = [int(prune_graph(graph, t, 0.98).node_mask[:graph.n_features].sum())
            for t in (0.5, 0.8, 0.95, 1.0)]
    assert kept == sorted(kept) and kept[0] < kept[-1]
    pruned = prune_graph(graph)
    data = pruned_json(graph, pruned, (0.8, 0.98), decode=lambda t: f"<{t}>")
    ids_drawn = {node["id"] for node in data["nodes"]}
    assert all(e["source"] in ids_drawn and e["target"] in ids_drawn for e in data["edges"])
    for edge in data["edges"][:20]:
        target = next(n for n in data["nodes"] if n["id"] == edge["target"])
        source = next(n for n in data["nodes"] if n["id"] == edge["source"])
        assert graph.adjacency_matrix[target["index"], source["index"]] == \
            pytest.approx(edge["weight"])
    assert data["tokens"] == [f"<{t}>" for t in ids[0].tolist()]
    assert data["scores"]["replacement"] == pytest.approx(graph_scores(graph)[0])
    assert graph_scores(graph, pruned.influence) == graph_scores(graph)  # the same influence
    json.dumps(data)


def test_a_graph_saves_and_loads_and_a_corrupt_file_is_refused(tmp_path: Path) -> None:
    model, transcoders = model_and_transcoders(torch.float32, **GPT2_LIKE)
    graph = attribution_graph(model, transcoders, torch.tensor([[1, 2, 3, 4]]))
    back = AttributionGraph.load(graph.save(tmp_path / "g.safetensors"))
    assert torch.equal(back.adjacency_matrix, graph.adjacency_matrix)
    assert back.transcoders == graph.transcoders and back.n_layers == 3
    (tmp_path / "bad.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"not json")
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        AttributionGraph.load(tmp_path / "bad.safetensors")
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="not an attribution graph glassgpt saved"):
        AttributionGraph.load(tmp_path / "other.safetensors")


def test_what_is_not_a_replacement_model_is_refused_by_name() -> None:
    model, transcoders = model_and_transcoders(torch.float32, **GPT2_LIKE)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(InputError, match="no transcoder for layer 2"):
        attribution_graph(model, transcoders[:2], ids)
    with pytest.raises(InputError, match="two transcoders for layer 1"):
        attribution_graph(model, [*transcoders, transcoders[1]], ids)
    plain = SAEConfig(d_in=16, d_sae=8)
    plain.metadata.hook_name = "blocks.0.hook_resid_post"
    with pytest.raises(InputError, match="replaces each MLP by a transcoder; got a standard"):
        attribution_graph(model, [*transcoders, SAE(plain)], ids)
    with pytest.raises(InputError, match="must read that block's MLP input"):
        attribution_graph(model, [transcoder(0, 16, reads="hook_resid_pre"), *transcoders[1:]],
                          ids)
    with pytest.raises(InputError, match="one prompt"):
        attribution_graph(model, transcoders, torch.tensor([[1, 2], [3, 4]]))
    capped = GPT(GPTConfig(**GPT2_LIKE, logit_softcap=30.0)).eval()
    capped.load_state_dict(model.state_dict())  # graphs as circuit-tracer's: test_graph_softcap
    assert attribution_graph(capped, transcoders, ids).n_logits >= 1


def test_a_transcoder_may_read_the_residual_before_the_norm() -> None:
    model, _ = model_and_transcoders(torch.float64, **GPT2_LIKE)
    transcoders = [transcoder(layer, 16, dtype=torch.float64, reads="hook_resid_mid")
                   for layer in range(3)]
    ids = torch.tensor([[4, 2, 7, 1, 9]])
    graph = attribution_graph(model, transcoders, ids)
    prompt = read_prompt(model, transcoders, ids)
    before = target_values(prompt, graph, frozen_run(prompt))
    after = target_values(prompt, graph, frozen_run(prompt, **without(
        prompt, graph, graph.token_index(1))))
    torch.testing.assert_close(before - after, graph.adjacency_matrix[target_rows(graph),
                                                                      graph.token_index(1)],
                               atol=1e-12, rtol=0)


def test_the_graph_command_prints_scores_and_writes_the_graph(trained_run, tmp_path: Path,
                                                              capsys) -> None:
    from glassgpt.rundir.checkpoint import load_model

    model, tokenizer = load_model(trained_run.run)
    c = model.config
    folder = tmp_path / "transcoders"
    for layer in range(c.n_layer):
        transcoder(layer, c.n_embd).save(folder / f"layer{layer}")
    out, js = tmp_path / "g.safetensors", tmp_path / "g.json"
    assert main(["graph", str(trained_run.run), "--transcoders", str(folder), "--prompt",
                 "to be or", "--out", str(out), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    graph = attribution_graph(model, load_transcoders([folder]),
                              torch.tensor([tokenizer.encode("to be or")]))
    replacement, completeness = graph_scores(graph)
    assert f"replacement score {replacement:.3f}, completeness score {completeness:.3f}" \
        in printed
    assert f"{graph.n_features} active features" in printed
    torch.testing.assert_close(AttributionGraph.load(out).adjacency_matrix,
                               graph.adjacency_matrix)
    data = json.loads(js.read_text())
    assert data["metadata"]["prompt_tokens"] == [tokenizer.decode([t])
                                                 for t in tokenizer.encode("to be or")]
    assert main(["graph", str(trained_run.run), "--transcoders", str(folder), "--prompt",
                 "to be or", "--json", str(js)]) == 2  # a file already there stays
    assert f"{js} already exists; pass --force" in capsys.readouterr().err
    assert main(["graph", str(trained_run.run), "--transcoders", str(folder), "--prompt",
                 "to be or", "--json", str(js), "--force"]) == 0
    capsys.readouterr()
    assert main(["graph", str(trained_run.run), "--transcoders", str(folder), "--prompt", "x",
                 "--node-threshold", "2"]) == 2
    assert "--node-threshold is a share in (0, 1], got 2.0" in capsys.readouterr().err
    assert main(["graph", str(trained_run.run), "--transcoders", str(tmp_path), "--prompt",
                 "x"]) == 2
    assert "holds no dictionary" in capsys.readouterr().err


def test_the_graph_benchmark_times_what_it_says_at_a_toy_size() -> None:
    from glassgpt.bench.graph import GraphBenchSize, bench_graph

    size = GraphBenchSize(n_layer=2, n_head=2, n_embd=16, expansion=4, active=4, prompt_len=8,
                          vocab_size=32, rounds=1)
    result = bench_graph(size)
    assert 0 < result.kept_nodes <= result.features < result.nodes
    assert result.nodes == result.features + 2 * 8 + 8 + (result.nodes - result.features - 24)
    assert result.heads == 4 and result.graph_s > 0
    assert result.patching_ratio == result.activation_patching_s / result.attribution_patching_s
    assert 0 < result.replacement_score <= 1 and 0 < result.completeness_score <= 1


def test_the_bench_graph_command_prints_its_table(monkeypatch, capsys, tmp_path: Path) -> None:
    import glassgpt.bench.graph as bench

    monkeypatch.setattr(bench, "QUICK", bench.GraphBenchSize(
        n_layer=2, n_head=2, n_embd=16, expansion=4, active=4, prompt_len=8, vocab_size=32,
        rounds=1))
    monkeypatch.delenv(bench.CIRCUIT_TRACER_PYTHON_ENV, raising=False)
    out = tmp_path / "bench.json"
    assert main(["bench", "graph", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    # The table's rows and both figures, never which one is faster: that is the benchmark's
    # finding on one machine, not a property a test can hold on every CPU.
    assert "circuit-tracer not measured" in printed
    saved = json.loads(out.read_text())
    for row, figure in (("attribution patching, 4 heads, ms", saved["attribution_patching_s"]),
                        ("activation patching, 4 heads, ms", saved["activation_patching_s"])):
        assert row in printed and f"{figure * 1e3:.1f}" in printed
    assert "activation patching's time / attribution patching's" in printed
    assert f"{saved['patching_ratio']:.1f}x" in printed
    assert saved["patching_ratio"] == pytest.approx(
        saved["activation_patching_s"] / saved["attribution_patching_s"])
    assert saved["circuit_tracer_s"] is None
    assert main(["bench", "graph", "--quick", "--circuit-tracer-python",
                 str(tmp_path / "none")]) == 2
    assert "circuit-tracer's python" in capsys.readouterr().err
