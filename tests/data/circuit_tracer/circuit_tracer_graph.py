"""circuit-tracer 0.5.0's graph of this folder's model and transcoders: the reference that
tests/test_graph_reference.py holds glassgpt's attribution graph to.

circuit-tracer pins TransformerLens < 4, so it runs in a venv of its own, offline, on a CPU:
    python3 -m venv /tmp/ct && /tmp/ct/bin/pip install torch==2.13.0 circuit-tracer==0.5.0
    .venv/bin/python tests/data/circuit_tracer/make_fixture.py BUILD    # glassgpt's side
    /tmp/ct/bin/python tests/data/circuit_tracer/circuit_tracer_graph.py BUILD OUT
Reads BUILD (make_fixture.py's output: the TransformerLens checkpoint of the model and the
transcoders in circuit-tracer's layout) and writes OUT/reference.safetensors (the Graph's
adjacency, nodes and logits, prune_graph's masks at 0.8 / 0.98 with the kept edges as index
pairs, the node influences) and OUT/reference.json (the scores and settings); and the same of
`attribute(max_feature_nodes=CAPPED["max_feature_nodes"], ...)` as OUT/capped.safetensors and
OUT/capped.json (the selected features' indices among the active ones beside them), with
batches small enough that the greedy ranking is redone several times. And circuit-tracer's graph
files of the reference graph (`create_graph_files`: the JSON its local server and Neuronpedia
read) in OUT/graph_files/: reference.json at the default thresholds (it keeps no feature),
wide.json at node 0.99 / edge 0.995 (42 features), their graph-metadata.json, and
graph_schema.json, the JSON schema of the file as circuit-tracer's own pydantic model states it
(frontend/graph_models.Model), that tests/test_graph_files.py holds glassgpt's `--json` to.
And docs/interpretability.md's circuit-tracer recipe (the python block after
"<!-- section: into circuit-tracer -->"), run as written in BUILD/recipe/ on the fixture's
prompt: OUT/lens_recipe.json says what it gave beside the reference graph, and the names and
shapes of circuit-tracer's replacement model's state. And the same graph over a cross-layer
transcoder (BUILD/clt_graph/ct_clt, read by circuit-tracer's own loader, the model built by
ReplacementModel.from_config as the recipe builds it): OUT/clt_graph/clt_reference.* and, with
CLT_CAPPED, clt_capped.*, that tests/test_graph_clt.py holds glassgpt's CLT graph to. And the
graph of the same model with a final logit soft-cap (BUILD/softcap/: output_logits_soft_cap 10
in its TransformerLens config, the same transcoders): OUT/softcap/reference.* as above, and
OUT/softcap/removals.json, circuit-tracer's own check of its edges (its test suite's, under its
`zero_softcap()`): each active feature set to 0 by `feature_intervention` with every layer
constrained moves each logit node's demeaned logit and each feature's pre-activation by minus
its edge; the largest miss with the cap lifted, and with it left on (the capped logits are not
what the rows are of); and the same over the CLT (OUT/softcap/clt_reference.*,
clt_removals.json); that tests/test_graph_softcap.py holds glassgpt's graphs to.
"""
import hashlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import circuit_tracer
import torch
from circuit_tracer import attribute
from circuit_tracer.graph import (
    compute_graph_scores,
    compute_node_influence,
    prune_graph,
)
from safetensors.torch import load_file, save_file

FIX = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("build")
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(".")
torch.manual_seed(0)
torch.set_grad_enabled(True)
# some a third of the 270 active features, ranked again after every batch of 2: 50 rounds
# (re-ranking matters here: ranked once, 2 of the 100 would be others)
CAPPED = {"max_feature_nodes": 100, "batch_size": 2, "update_interval": 1}


# The model and its transcoders are built as `glassgpt bench graph` builds them for
# circuit-tracer: by its worker, a file that imports nothing of glassgpt.
WORKER = Path(__file__).resolve().parents[3] / "src/glassgpt/bench/circuit_tracer_worker.py"
_spec = importlib.util.spec_from_file_location("circuit_tracer_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def build_model(transcoders: str, input_hook: str):
    first_id = json.loads((FIX / "prompt.json").read_text())["prompt_ids"][0]
    return worker.replacement_model(FIX, first_id, transcoders, input_hook)


def graph_tensors(graph, prune, scores) -> tuple[dict, dict]:
    node_mask, edge_mask, cum = prune
    t = {
        "adjacency_matrix": graph.adjacency_matrix.float().contiguous(),
        "active_features": graph.active_features.long().contiguous(),  # (n_active, 3) layer,pos,idx
        "selected_features": graph.selected_features.long().contiguous(),  # (n_features,)
        "activation_values": graph.activation_values.float().contiguous(),
        "logit_tokens": graph.logit_token_ids.long().contiguous(),
        "logit_probabilities": graph.logit_probabilities.float().contiguous(),
        "input_tokens": graph.input_tokens.long().contiguous(),
        "prune_node_mask": node_mask.to(torch.uint8).contiguous(),
        "prune_kept_edges": edge_mask.nonzero().to(torch.int32).contiguous(),  # (target, source)
        "prune_cumulative_scores": cum.float().contiguous(),
    }
    # extras the project may want to check step by step
    n_logits = len(graph.logit_targets)
    logit_weights = torch.zeros(graph.adjacency_matrix.shape[0])
    logit_weights[-n_logits:] = graph.logit_probabilities
    t["node_influence"] = compute_node_influence(graph.adjacency_matrix, logit_weights).contiguous()
    n_feat = len(graph.selected_features)
    n_pos = graph.n_pos
    n_layers = graph.cfg.n_layers
    scalars = {
        "circuit_tracer_version": circuit_tracer.__version__,
        "torch_version": torch.__version__,
        "n_layers": n_layers, "n_pos": n_pos, "n_features": n_feat,
        "n_active_features": int(graph.active_features.shape[0]),
        "n_error_nodes": n_layers * n_pos, "n_token_nodes": n_pos, "n_logit_nodes": n_logits,
        "n_nodes": int(graph.adjacency_matrix.shape[0]),
        "node_order": "features (selected, in active_features order), errors (layer-major: "
                      "layer*n_pos+pos), tokens (pos), logits (descending prob)",
        "adjacency_convention": "A[target, source] (rows = targets, columns = sources)",
        "logit_token_strings": [lt.token_str for lt in graph.logit_targets],
        "vocab_size": graph.vocab_size,
        "input_string": graph.input_string,
        "scan": graph.scan,
        "node_threshold": 0.8, "edge_threshold": 0.98,
        "replacement_score": scores[0], "completeness_score": scores[1],
        "n_kept_nodes": int(node_mask.sum()), "n_kept_edges": int(edge_mask.sum()),
        "feature_input_hook": "blocks.L.ln2.hook_normalized (TL 3.2.1: x_hat, before gain/bias)",
        "feature_output_hook": "blocks.L.hook_mlp_out",
        "position0_features_and_errors_zeroed": True,
        "bos_prepended": False,
    }
    return t, scalars


# create_graph_files(graph, slug, dir, node_threshold, edge_threshold) of the reference graph
GRAPH_FILES = {"reference": (0.8, 0.98), "wide": (0.99, 0.995)}


def write_graph_files(model, graph, graph_files=GRAPH_FILES, fresh=True) -> None:
    """circuit-tracer's graph JSON of `graph` ({slug: (node threshold, edge threshold)}), with
    the fixture's id tokenizer standing in for the Hugging Face one it loads by name (the
    model has none); `fresh`: a new graph-metadata.json."""
    import circuit_tracer.utils.create_graph_files  # noqa: F401 (the module, not the function)
    from circuit_tracer.frontend.graph_models import Model

    module = sys.modules["circuit_tracer.utils.create_graph_files"]

    class ByName:
        @staticmethod
        def from_pretrained(name):
            return model.tokenizer

    module.AutoTokenizer = ByName
    folder = OUT / "graph_files"
    folder.mkdir(exist_ok=True)
    if fresh:
        (folder / "graph-metadata.json").unlink(missing_ok=True)
    for slug, (node_threshold, edge_threshold) in graph_files.items():
        module.create_graph_files(graph, slug, str(folder), node_threshold=node_threshold,
                                  edge_threshold=edge_threshold)
    (folder / "graph_schema.json").write_text(json.dumps(Model.model_json_schema(), indent=2)
                                              + "\n")


RECIPE_SECTION = "<!-- section: into circuit-tracer -->"
RECIPE_PROMPT = 'prompt = "eszycidpyopumzg eszycidpyo"'


def recipe_block() -> str:
    """The first python block after RECIPE_SECTION in docs/interpretability.md."""
    page = (WORKER.parents[3] / "docs" / "interpretability.md").read_text()
    after = page[page.index(RECIPE_SECTION):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def run_docs_recipe(reference) -> None:
    """The recipe, as written but for its prompt (the fixture's, in its characters), in
    BUILD/recipe/; what it gave against the reference graph goes to OUT/lens_recipe.json."""
    code = recipe_block()
    chars = json.loads((FIX / "recipe/runs/repeats/tokenizer.json").read_text())["chars"]
    prompt = "".join(chars[i] for i in json.loads((FIX / "prompt.json").read_text())["prompt_ids"])
    assert RECIPE_PROMPT in code
    namespace = {"__name__": "__main__"}
    here = os.getcwd()
    os.chdir(FIX / "recipe")
    try:
        exec(compile(code.replace(RECIPE_PROMPT, f"prompt = {prompt!r}"), "recipe", "exec"),
             namespace)
    finally:
        os.chdir(here)
    graph, model = namespace["graph"], namespace["model"]
    state = {name: list(t.shape) for name, t in model.state_dict().items()
             if not name.startswith("transcoders.")}
    result = {
        "recipe_sha256": hashlib.sha256(code.encode()).hexdigest(),
        "prompt": prompt,
        "missing_keys": sorted(namespace["missing"]),
        "unexpected_keys": sorted(namespace["unexpected"]),
        "same_active_features": bool(torch.equal(graph.active_features,
                                                 reference.active_features)),
        "same_logit_tokens": bool(torch.equal(graph.logit_token_ids,
                                              reference.logit_token_ids)),
        "adjacency_max_abs_diff": float((graph.adjacency_matrix
                                         - reference.adjacency_matrix).abs().max()),
        "replacement_model_state": state,
    }
    (OUT / "lens_recipe.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"[recipe] adjacency max |diff| {result['adjacency_max_abs_diff']:.2e}, same "
          f"features {result['same_active_features']}, missing {len(result['missing_keys'])}")


# the CLT's capped graph: a third of its active features, re-ranked after every batch of 2
CLT_CAPPED = {"max_feature_nodes": 80, "batch_size": 2, "update_interval": 1}


def clt_model(lens=None):
    """circuit-tracer's replacement model over the fixture's CLT, built as the recipe builds
    one (from_config, then the export's circuit_tracer.safetensors; default the recipe's)."""
    from circuit_tracer import ReplacementModel
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder
    from circuit_tracer.utils.caching import load_transcoders_from_cache
    from transformer_lens import HookedTransformerConfig

    lens = FIX / "recipe" / "repeats-lens" if lens is None else lens
    cfg = HookedTransformerConfig.from_dict(json.loads((lens / "config.json").read_text()))
    clt, _ = load_transcoders_from_cache("ct_clt", cache_dir=FIX / "clt_graph",
                                         lazy_encoder=False, lazy_decoder=False)
    assert isinstance(clt, CrossLayerTranscoder), type(clt)
    model = ReplacementModel.from_config(cfg, clt, backend="transformerlens")
    first_id = json.loads((FIX / "prompt.json").read_text())["prompt_ids"][0]
    model.tokenizer = worker.IdTokenizer(cfg.d_vocab, first_id)
    missing, unexpected = model.load_state_dict(
        load_file(str(lens / "circuit_tracer.safetensors")), strict=False)
    assert not unexpected and all(k.startswith("transcoders.") for k in missing), missing
    return model.eval()


def run_clt(prompt) -> None:
    global OUT
    model = clt_model()
    _, acts = model.get_activations(torch.tensor(prompt))
    print(f"[clt] active features: {int((acts > 0).sum())} of {acts.numel()}")
    out, OUT = OUT, OUT / "clt_graph"
    OUT.mkdir(exist_ok=True)
    try:
        graph, _ = run_one(model, prompt, "clt_reference")
        run_one(model, prompt, "clt_capped", **CLT_CAPPED)
    finally:
        OUT = out
    write_graph_files(model, graph, {"clt": (0.8, 0.98)}, fresh=False)


def run_softcap(prompt) -> None:
    """The soft-capped model's graph, and circuit-tracer's own check of its edges."""
    global OUT
    model = worker.replacement_model(FIX / "softcap", prompt[0], "ct_tc", "ln2.hook_normalized")
    assert model.cfg.output_logits_soft_cap == 10.0, model.cfg.output_logits_soft_cap
    glass = load_file(str(FIX / "softcap" / "glass_logits.safetensors"))["logits"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0]
    print("[softcap] max |logits TL - glass| =", (logits - glass).abs().max().item(),
          "| max |logit| =", logits.abs().max().item())
    out, OUT = OUT, OUT / "softcap"
    OUT.mkdir(exist_ok=True)
    try:
        graph, _ = run_one(model, prompt, "reference")
        with model.zero_softcap():
            lifted = removal_misses(model, graph, prompt)
        kept = removal_misses(model, graph, prompt)
        (OUT / "removals.json").write_text(json.dumps({
            "logits_max_abs_diff_tl_glass": float((logits - glass).abs().max()),
            "cap_lifted": lifted, "cap_kept": kept}, indent=2) + "\n")
        print(f"[softcap] removal misses, cap lifted: {lifted}; cap kept: {kept}")
        clt = clt_model(FIX / "softcap" / "ct-lens")
        assert clt.cfg.output_logits_soft_cap == 10.0, clt.cfg.output_logits_soft_cap
        clt_graph, _ = run_one(clt, prompt, "clt_reference")
        with clt.zero_softcap():
            lifted = removal_misses(clt, clt_graph, prompt)
        (OUT / "clt_removals.json").write_text(json.dumps({"cap_lifted": lifted}, indent=2)
                                               + "\n")
        print(f"[softcap] CLT removal misses, cap lifted: {lifted}")
    finally:
        OUT = out


def removal_misses(model, graph, prompt) -> dict:
    """circuit-tracer's test-suite check: each active feature set to 0 (pre-activations read,
    every layer constrained: only its direct effect) changes each logit node's logit minus the
    mean logit, and each feature's pre-activation, by minus the edge from it."""
    ids = torch.tensor(prompt)
    n_layers, n_logits = model.cfg.n_layers, len(graph.logit_targets)
    tokens = graph.logit_token_ids
    feats = graph.active_features  # (F, 3): layer, position, feature

    def targets(logits, acts):  # (n_logits + F,): demeaned logits, then pre-activations
        last = logits[0, -1]
        return torch.cat([last[tokens] - last.mean(), acts[feats[:, 0], feats[:, 1], feats[:, 2]]])

    before = targets(*model.feature_intervention(
        ids, [], constrained_layers=range(n_layers), apply_activation_function=False))
    a = graph.adjacency_matrix
    rows = torch.cat([torch.arange(a.shape[0] - n_logits, a.shape[0]), torch.arange(len(feats))])
    logit_miss = feature_miss = 0.0
    for i, (layer, pos, idx) in enumerate(feats.tolist()):
        after = targets(*model.feature_intervention(
            ids, [(layer, pos, idx, 0)], constrained_layers=range(n_layers),
            apply_activation_function=False))
        miss = (after - before + a[rows, i]).abs()
        logit_miss = max(logit_miss, float(miss[:n_logits].max()))
        feature_miss = max(feature_miss, float(miss[n_logits:].max()))
    return {"n_features_removed": len(feats), "logit_max_abs_miss": logit_miss,
            "feature_max_abs_miss": feature_miss,
            "largest_logit_edge": float(a[-n_logits:].abs().max())}


def run_one(model, prompt, tag, **kw):
    graph = attribute(torch.tensor(prompt), model, **kw)
    prune = prune_graph(graph, node_threshold=0.8, edge_threshold=0.98)
    scores = compute_graph_scores(graph)
    t, s = graph_tensors(graph, prune, scores)
    s["attribute_kwargs"] = {"max_n_logits": 10, "desired_logit_prob": 0.95, "batch_size": 512,
                             "update_interval": 4,
                             "max_feature_nodes": None, **kw}
    save_file(t, str(OUT / f"{tag}.safetensors"))
    (OUT / f"{tag}.json").write_text(json.dumps(s, indent=2) + "\n")
    print(f"[{tag}] nodes={s['n_nodes']} feats={s['n_features']}/{s['n_active_features']} "
          f"logits={s['n_logit_nodes']} repl={scores[0]:.6f} compl={scores[1]:.6f} "
          f"kept nodes={s['n_kept_nodes']} edges={s['n_kept_edges']}")
    return graph, t


def main() -> int:
    prompt = json.loads((FIX / "prompt.json").read_text())["prompt_ids"]
    glass = load_file(str(FIX / "glass_acts.safetensors"))
    model = build_model("ct_tc", "ln2.hook_normalized")
    ids = torch.tensor(prompt)

    # 1. same model? logits and the hook point
    with torch.no_grad():
        logits, cache = model.run_with_cache(ids[None])
    print("max |logits TL - glass| =", (logits[0] - glass["logits"]).abs().max().item())
    for L in range(model.cfg.n_layers):
        d = (cache[f"blocks.{L}.ln2.hook_normalized"][0] - glass[f"x_hat.{L}"]).abs().max()
        d2 = (cache[f"blocks.{L}.hook_mlp_out"][0] - glass[f"mlp_out.{L}"]).abs().max()
        print(f"layer {L}: max |TL ln2.hook_normalized - glass x_hat| = {d.item():.3e}; "
              f"max |mlp_out diff| = {d2.item():.3e}")

    # 2. feature activations: circuit-tracer (position 0 zeroed) vs glassgpt sae.encode
    _, acts = model.get_activations(ids)
    ref = torch.stack([glass[f"acts.{L}"] for L in range(model.cfg.n_layers)])
    ref[:, 0] = 0
    print("max |ct feature acts - glass sae.encode| (pos 0 zeroed) =",
          (acts - ref).abs().max().item(),
          "| active:", int((acts > 0).sum()), "of", acts.numel())

    # 3. the graphs
    g, t = run_one(model, prompt, "reference")
    write_graph_files(model, g)
    run_docs_recipe(g)
    run_one(model, prompt, "capped", **CAPPED)
    run_clt(prompt)
    run_softcap(prompt)

    # 4. cross-check: gain/bias-folded encoder reading the MLP's input (post gain) gives the
    #    same graph
    model2 = build_model("ct_tc_postgain", "mlp.hook_in")
    _, acts2 = model2.get_activations(ids)
    print("postgain variant: max |acts - glass| =", (acts2 - ref).abs().max().item())
    g2 = attribute(ids, model2)
    same = g2.adjacency_matrix.shape == g.adjacency_matrix.shape
    print("postgain variant: same shape:", same,
          "max |A - A_ref| =", (g2.adjacency_matrix - g.adjacency_matrix).abs().max().item()
          if same else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
