"""Attribution graphs given lying files and mistaken flags: each one clear line, nothing written.
A tampered graph file refused by `AttributionGraph.load` with what is wrong, one path for both
outputs of `glassgpt graph`, transcoders of another width or trained on another run's model,
a count that is not positive.

The graph file is test_graph's small GPT-2-like one; the command line runs on the session's
trained run (one layer, 16 wide)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glassgpt.cli import main
from glassgpt.errors import CheckpointError, InputError
from glassgpt.interp.graph import AttributionGraph, attribution_graph
from glassgpt.interp.graph.prune import prune_graph
from glassgpt.interp.sae import SAE, SAEConfig
from test_graph import GPT2_LIKE, hand_graph, model_and_transcoders, transcoder
from test_sae_hostile import copy_of_run


@pytest.fixture(scope="module")
def saved_graph(tmp_path_factory) -> Path:
    model, transcoders = model_and_transcoders(torch.float32, **GPT2_LIKE)
    graph = attribution_graph(model, transcoders, torch.tensor([[1, 2, 3, 4]]))
    assert graph.n_features > 0
    return graph.save(tmp_path_factory.mktemp("graph") / "g.safetensors")


def tampered(saved: Path, dest: Path, change=None, **metadata: str) -> Path:
    with safe_open(saved, "pt") as file:
        original = file.metadata()
    tensors = load_file(saved)
    if change is not None:
        change(tensors)
    save_file(tensors, dest, {**original, **metadata})
    return dest


def put(name: str, index: tuple, value: float):
    def change(tensors: dict) -> None:
        tensors[name][index] = value
    return change


def replace(name: str, how):
    def change(tensors: dict) -> None:
        tensors[name] = how(tensors[name])
    return change


@pytest.mark.parametrize("change, metadata, says", [
    (replace("active_features", lambda t: t[:, :2].contiguous()), {},
     "active_features has shape \\(\\d+, 2\\)"),
    (replace("activation_values", lambda t: t[:-1]), {}, "activation_values has shape"),
    (replace("adjacency_matrix", lambda t: t.long()), {}, "adjacency_matrix has dtype I64"),
    (None, {"transcoders": "[" * 100_000 + "]" * 100_000}, "nested too deeply"),
    (None, {"transcoders": json.dumps(["blocks.0.hook_mlp_out"])}, "must list the 3 layers"),
    (None, {"n_layers": "abc"}, "n_layers must be a count of layers, got 'abc'"),
    (put("active_features", (0, 0), 7), {}, "names a layer without a transcoder"),
    (put("active_features", (0, 1), 99), {}, "names a position outside \\[0, 4\\)"),
    (put("active_features", (0, 2), -1), {}, "names a negative feature index"),
    (put("input_ids", (0,), -3), {}, "input_ids holds a negative token id"),
    (put("logit_probabilities", (0,), -0.5), {}, "logit_probabilities must be in \\[0, 1\\]"),
    (put("adjacency_matrix", (0, 1), float("nan")), {}, "adjacency_matrix holds 1 NaN"),
], ids=["features-2-wide", "short-values", "int-adjacency", "deep-json", "hooks-length",
        "n-layers", "layer", "position", "feature", "token", "probability", "nan"])
def test_a_tampered_graph_file_is_one_specific_error(saved_graph, tmp_path, change, metadata,
                                                     says) -> None:
    with pytest.raises(CheckpointError, match=says):
        AttributionGraph.load(tampered(saved_graph, tmp_path / "bad.safetensors", change,
                                       **metadata))


def test_a_nan_adjacency_is_said_to_be_one_not_a_cycle() -> None:
    graph = hand_graph()
    graph.adjacency_matrix[5, 0] = float("nan")
    with pytest.raises(InputError, match="NaN or infinite"):
        prune_graph(graph, 0.8, 0.98)


# --- the command line -------------------------------------------------------------------------

def graph_cli(run: Path, transcoders: Path, *flags, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["graph", str(run), "--transcoders", str(transcoders), "--prompt", "to be",
                 *map(str, flags)])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def fitting(tmp_path_factory) -> Path:
    """A transcoder for the session's run (one layer, 16 wide), built in code."""
    return transcoder(0, 16).save(tmp_path_factory.mktemp("transcoders") / "layer0")


def test_one_file_for_both_outputs_is_refused_before_any_work(trained_run, fitting, tmp_path,
                                                              capsys) -> None:
    (tmp_path / "sub").mkdir()
    same = tmp_path / "g"
    code, err = graph_cli(trained_run.run, fitting, "--out", same, "--json",
                          tmp_path / "sub" / ".." / "g", capsys=capsys)
    assert code == 2 and "--out and --json both name" in err and err.count("\n") == 1
    assert not same.exists()
    same.write_text("mine")
    code, err = graph_cli(trained_run.run, fitting, "--out", same, "--json", same, "--force",
                          capsys=capsys)
    assert code == 2 and same.read_text() == "mine"


@pytest.mark.parametrize("top", ["-5", "0"])
def test_top_must_be_positive(trained_run, fitting, capsys, top) -> None:
    code, err = graph_cli(trained_run.run, fitting, "--top", top, capsys=capsys)
    assert code == 2 and f"--top must be positive, got {top}" in err


@pytest.mark.parametrize("d_in, d_out", [(8, 16), (16, 8)])
def test_a_transcoder_of_another_width_is_one_line(trained_run, tmp_path, capsys, d_in,
                                                   d_out) -> None:
    config = SAEConfig(d_in=d_in, d_sae=8, architecture="transcoder", d_out=d_out,
                       apply_b_dec_to_input=False, metadata={
                           "hook_name": "blocks.0.ln2.hook_normalized",
                           "hook_name_out": "blocks.0.hook_mlp_out"})
    path = SAE(config).save(tmp_path / "layer0")
    code, err = graph_cli(trained_run.run, path, capsys=capsys)
    assert code == 2 and err.count("\n") == 1
    assert "--transcoders" in err and "takes width 8" in err and "16 wide" in err


def test_transcoders_of_another_run_are_refused_unless_told(trained_run, tmp_path,
                                                            capsys) -> None:
    from glassgpt.interp.sae.provenance import run_record
    from glassgpt.rundir.checkpoint import Run

    sae = transcoder(0, 16)
    sae.cfg.metadata.update(run_record(Run(trained_run.run)))  # as glassgpt's trainer records
    path = sae.save(tmp_path / "layer0")
    other = copy_of_run(trained_run.run, tmp_path / "other", nudged=True)
    code, err = graph_cli(other, path, capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "--any-run" in err
    assert str(trained_run.run.resolve()) in err and str(other.resolve()) in err
    assert graph_cli(other, path, "--any-run", capsys=capsys)[0] == 0
    assert graph_cli(trained_run.run, path, capsys=capsys)[0] == 0


@pytest.mark.parametrize("flag, mine", [
    ("--out", lambda path: save_file({"weights": torch.zeros(3)}, path)),
    ("--json", lambda path: path.write_text('{"my": "notes"}')),
    ("--out", lambda path: path.write_text("not even safetensors")),
], ids=["a-users-safetensors", "a-users-json", "a-users-text"])
def test_force_replaces_only_a_file_glassgpt_graph_wrote(trained_run, fitting, tmp_path, capsys,
                                                         flag, mine) -> None:
    """--force replaced any file at --out or --json: a user's, a transcoder's weights."""
    path = tmp_path / "mine"
    mine(path)
    before = path.read_bytes()
    code, err = graph_cli(trained_run.run, fitting, flag, path, "--force", capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "--force replaces only such a file" in err
    assert path.read_bytes() == before


def test_a_transcoders_own_file_is_never_an_output(trained_run, tmp_path, capsys) -> None:
    layer = transcoder(0, 16).save(tmp_path / "layer0")
    before = {p.name: p.read_bytes() for p in layer.iterdir()}
    for flag, name in (("--out", "sae_weights.safetensors"), ("--json", "cfg.json")):
        code, err = graph_cli(trained_run.run, layer, flag, layer / name, "--force",
                              capsys=capsys)
        assert code == 2 and "is not" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in layer.iterdir()} == before


def test_outputs_go_under_new_folders_and_force_replaces_them(trained_run, fitting, tmp_path,
                                                              capsys) -> None:
    """A missing folder was a FileNotFoundError traceback; a graph's own files are replaced."""
    out, data = tmp_path / "new" / "g.safetensors", tmp_path / "other" / "deeper" / "g.json"
    assert graph_cli(trained_run.run, fitting, "--out", out, "--json", data, capsys=capsys)[0] == 0
    assert AttributionGraph.load(out).n_layers == 1 and "nodes" in json.loads(data.read_text())
    code, _ = graph_cli(trained_run.run, fitting, "--out", out, "--json", data, "--force",
                        "--node-threshold", "0.5", capsys=capsys)
    assert code == 0 and json.loads(data.read_text())["metadata"]["node_threshold"] == 0.5


def test_saving_a_graph_onto_a_directory_is_an_input_error(saved_graph, tmp_path) -> None:
    with pytest.raises(InputError, match="is a directory; give a file name"):
        AttributionGraph.load(saved_graph).save(tmp_path)
