"""circuit-tracer 0.5.0's transcoder files both ways (glassgpt.interp.sae.circuit_tracer*):
what circuit-tracer wrote loads in glassgpt with encode/decode equal to circuit-tracer's own
(1e-6), and what glassgpt writes (the same bytes as the files circuit-tracer's
load_transcoders_from_cache read when the fixture was made) computes there what it computes
here. The fixture is tests/data/circuit_tracer/clt/ (make_glass_files.py, then
make_ct_fixture.py in circuit-tracer's venv); the tests run offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.helpers_cli import glassgpt, one_error_line

from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, InputError
from glassgpt.interp import run_with_cache
from glassgpt.interp.sae import SAE
from glassgpt.interp.sae.circuit_tracer import convert_to_circuit_tracer, load_circuit_tracer
from glassgpt.interp.sae.circuit_tracer_clt import load_clt, save_clt
from glassgpt.interp.sae.circuit_tracer_set import save_transcoder_set
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.model import GPT

DATA = Path(__file__).parent / "data" / "circuit_tracer"
FIXTURE = DATA / "clt"
TOL = 1e-6


@pytest.fixture(scope="module")
def ct() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "ct_outputs.safetensors")


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=TOL, rtol=0)


def same_files(written: Path, kept: Path) -> None:
    """Two directories hold the same files: config.yaml's text, every tensor bit for bit."""
    assert sorted(p.name for p in written.iterdir()) == sorted(p.name for p in kept.iterdir())
    for path in kept.iterdir():
        if path.suffix == ".yaml":
            assert (written / path.name).read_text() == path.read_text()
            continue
        mine, theirs = load_file(written / path.name), load_file(path)
        assert mine.keys() == theirs.keys()
        for name in theirs:
            assert torch.equal(mine[name], theirs[name]), (path.name, name)


# --- circuit-tracer wrote, glassgpt reads -----------------------------------------------------

@pytest.mark.parametrize("name", ["ct_clt", "ct_clt_relu"])
def test_circuit_tracers_clt_loads_equal(name: str, ct: dict) -> None:
    clt = load_circuit_tracer(FIXTURE / name)
    assert isinstance(clt, CrossLayerTranscoder)
    assert clt.activation == ("jumprelu" if name == "ct_clt" else "relu")
    assert clt.input_hook_at(1) == "blocks.1.ln2.hook_normalized"
    with torch.no_grad():
        close(clt.encode(ct[f"{name}.x"]), ct[f"{name}.encode"])
        close(clt.decode(ct[f"{name}.encode"]), ct[f"{name}.decode"])


def test_circuit_tracers_transcoder_set_loads_equal(ct: dict) -> None:
    saes = load_circuit_tracer(FIXTURE / "ct_set")
    assert [sae.cfg.architecture for sae in saes] == ["jumprelu_transcoder", "transcoder"]
    assert saes[1].cfg.hook_name == "blocks.1.ln2.hook_normalized"
    assert saes[1].cfg.hook_name_out == "blocks.1.hook_mlp_out"
    x = ct["ct_set.x"]
    with torch.no_grad():
        for layer, sae in enumerate(saes):
            close(sae.encode(x[layer]), ct["ct_set.encode"][layer])
            close(sae.decode(ct["ct_set.encode"][layer]), ct["ct_set.decode"][layer])


# --- glassgpt writes, circuit-tracer read -----------------------------------------------------

@pytest.mark.parametrize("name", ["glass_clt", "glass_clt_relu"])
def test_glassgpts_clt_is_what_circuit_tracer_read(name: str, ct: dict, tmp_path: Path) -> None:
    source = {k.removeprefix(f"{name}."): v for k, v in
              load_file(FIXTURE / "glass_source.safetensors").items() if k.startswith(name + ".")}
    n_layers = source["b_dec"].shape[0]
    clt = CrossLayerTranscoder(n_layers, 8, 12, "jumprelu" if "threshold" in source else "relu")
    clt.load_state_dict(source)
    same_files(save_clt(clt, tmp_path / name), FIXTURE / name)
    x = ct[f"{name}.x"]
    with torch.no_grad():
        close(clt.encode(x), ct[f"{name}.encode"])
        for layer in range(n_layers):
            close(clt.encode_layer(x[layer], layer), ct[f"{name}.encode_layer.{layer}"])
        close(clt(x), ct[f"{name}.decode"])
    back = load_clt(tmp_path / name)  # and back: the same weights
    for key, tensor in clt.state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key


def test_glassgpts_transcoders_convert_to_what_circuit_tracer_read(ct: dict,
                                                                   tmp_path: Path) -> None:
    """The graph fixture's SAELens-format transcoders (tests/data/circuit_tracer/tc)."""
    done = convert_to_circuit_tracer([DATA / "tc"], tmp_path / "set")
    assert (done.n_layers, done.widths, done.padded_layers) == (2, (64, 64), [])
    same_files(done.path, FIXTURE / "glass_set")
    x = ct["glass_set.x"]
    with torch.no_grad():
        for layer in range(2):
            sae = SAE.load(DATA / "tc" / f"layer_{layer}")
            close(sae.encode(x[layer]), ct["glass_set.encode"][layer])
            close(sae(x[layer]), ct["glass_set.decode"][layer])


def test_widths_that_differ_are_padded_with_dead_latents(ct: dict, tmp_path: Path) -> None:
    """Layer 0 a JumpReLU of 12 latents with thresholds below 0 (written as 0), layer 1 a ReLU
    of 6, padded to 12: circuit-tracer's encode is glassgpt's with 6 latents that never fire;
    read back, glassgpt drops the padding."""
    source = FIXTURE / "glass_src_padded"
    done = convert_to_circuit_tracer([source], tmp_path / "set")
    assert (done.widths, done.padded_layers) == ((12, 6), [1])
    same_files(done.path, FIXTURE / "glass_set_padded")
    saes = [SAE.load(source / f"layer_{layer}") for layer in range(2)]
    assert (saes[0].threshold < 0).any()
    x, acts = ct["glass_set_padded.x"], ct["glass_set_padded.encode"]
    back = load_circuit_tracer(done.path)
    with torch.no_grad():
        for layer, sae in enumerate(saes):
            width = sae.cfg.d_sae
            close(sae.encode(x[layer]), acts[layer, :, :width])
            close(sae(x[layer]), ct["glass_set_padded.decode"][layer])
            close(back[layer](x[layer]), sae(x[layer]))
        assert (acts[1, :, 6:] == 0).all() and (acts[1, :, :6] > 0).any()
    assert [sae.cfg.d_sae for sae in back] == [12, 6]
    with pytest.raises(CheckpointError, match=r"layers \[1\] have fewer than 12"):
        convert_to_circuit_tracer([source], tmp_path / "refused", pad=False)


# --- circuit-tracer's own MLP points, read against a model ------------------------------------

def post_gain_copy(tmp_path: Path, model: GPT) -> Path:
    """The graph fixture's transcoders as circuit-tracer's Llama/Qwen ones are kept: reading
    "mlp.hook_in" (the MLP's input, after ln2's gain and shift), writing "mlp.hook_out"."""
    out = tmp_path / "post_gain"
    shutil.copytree(FIXTURE / "glass_set", out)
    for layer in range(2):
        path = out / f"layer_{layer}.safetensors"
        t = load_file(path)
        ln = model.blocks[layer].ln2
        w, b = ln.weight.detach(), ln.bias.detach()
        t["b_enc"] = t["b_enc"] - (b / w) @ t["W_enc"].T
        t["W_enc"] = (t["W_enc"] / w).contiguous()
        save_file(t, path)
    (out / "config.yaml").write_text("model_kind: transcoder_set\nfeature_input_hook: "
                                     "mlp.hook_in\nfeature_output_hook: mlp.hook_out\n")
    return out


def test_mlp_hook_in_is_folded_into_the_encoders(tmp_path: Path) -> None:
    from glassgpt.rundir.checkpoint import load_model

    model, _ = load_model(DATA / "run", "cpu")
    path = post_gain_copy(tmp_path, model)
    with pytest.raises(CheckpointError, match="against the model"):
        load_circuit_tracer(path)
    folded = load_circuit_tracer(path, model)
    _, cache = run_with_cache(model, torch.tensor([[0, 17, 5, 42, 33, 8]]))
    for layer, sae in enumerate(folded):
        assert sae.cfg.hook_name == f"blocks.{layer}.ln2.hook_normalized"
        assert sae.cfg.hook_name_out == f"blocks.{layer}.hook_mlp_out"
        x_hat = cache[f"blocks.{layer}.ln2.hook_normalized"][0]
        original = SAE.load(DATA / "tc" / f"layer_{layer}")
        torch.testing.assert_close(sae.encode(x_hat), original.encode(x_hat), atol=1e-5,
                                   rtol=1e-5)


def test_a_post_mlp_norm_is_refused(tmp_path: Path) -> None:
    from glassgpt.rundir.checkpoint import load_model

    path = post_gain_copy(tmp_path, load_model(DATA / "run", "cpu")[0])
    gemma_like = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=8, vocab_size=64,
                               norm="rmsnorm", post_norms=True))
    with pytest.raises(InputError, match="post-MLP norm"):
        load_circuit_tracer(path, gemma_like)


# --- the command line -------------------------------------------------------------------------

def printed(capsys, *args: object) -> str:
    """What `glassgpt ARGS` printed on stdout, after it exited 0."""
    capsys.readouterr()
    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def test_graph_takes_circuit_tracers_directory(tmp_path: Path, capsys) -> None:
    """`glassgpt graph --transcoders DIR`: circuit-tracer's directory of the fixture's
    transcoders (its own MLP points, folded) gives the graph glassgpt's own give."""
    from glassgpt.rundir.checkpoint import load_model

    path = post_gain_copy(tmp_path, load_model(DATA / "run", "cpu")[0])
    lines = []
    for transcoders in (DATA / "tc", path):
        out = printed(capsys, "graph", DATA / "run", "--transcoders", transcoders, "--prompt",
                      "0h5Z")
        lines.append([line for line in out.splitlines()
                      if line.startswith(("replacement score", "logits:", "  layer"))])
    assert lines[0] == lines[1] and len(lines[0]) > 2


def test_sae_convert_command(tmp_path: Path, capsys) -> None:
    out = printed(capsys, "sae", "convert", FIXTURE / "glass_src_padded", "--out", tmp_path / "ct")
    assert "transcoder set of 2 layers, 12 latents each" in out
    assert "layer 1: padded from 6 to 12" in out
    same_files(tmp_path / "ct", FIXTURE / "glass_set_padded")
    code, err = glassgpt("sae", "convert", FIXTURE / "glass_src_padded", "--out", tmp_path / "ct",
                         capsys=capsys)
    assert code != 0 and "not empty" in one_error_line(err)
    printed(capsys, "sae", "convert", FIXTURE / "glass_src_padded", "--out", tmp_path / "ct",
            "--force")  # glassgpt's own set: replaced
    same_files(tmp_path / "ct", FIXTURE / "glass_set_padded")
    printed(capsys, "sae", "convert", FIXTURE / "glass_clt", "--out", tmp_path / "clt")
    same_files(tmp_path / "clt", FIXTURE / "glass_clt")


@pytest.mark.parametrize("theirs", ["ct_set", "ct_clt"])
def test_force_never_replaces_what_circuit_tracer_wrote(theirs: str, tmp_path: Path,
                                                        capsys) -> None:
    """A set or CLT downloaded from circuit-tracer's publishers has the same file names as
    glassgpt's; only glassgpt's config.yaml section tells them apart, and --force reads it."""
    shutil.copytree(FIXTURE / theirs, tmp_path / "theirs")
    before = {f.name: f.read_bytes() for f in (tmp_path / "theirs").iterdir()}
    source = FIXTURE / ("glass_clt" if theirs == "ct_clt" else "glass_src_padded")
    code, err = glassgpt("sae", "convert", source, "--out", tmp_path / "theirs", "--force",
                         capsys=capsys)
    assert code != 0 and "not written by glassgpt" in one_error_line(err)
    assert {f.name: f.read_bytes() for f in (tmp_path / "theirs").iterdir()} == before


def test_lying_files_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURE / "ct_set", bad)
    t = load_file(bad / "layer_0.safetensors")
    save_file({**t, "activation_function.threshold": -t["activation_function.threshold"]},
              bad / "layer_0.safetensors")
    with pytest.raises(CheckpointError, match="negative"):
        load_circuit_tracer(bad)
    save_file({**t, "W_skip": torch.zeros(8, 8)}, bad / "layer_0.safetensors")
    with pytest.raises(CheckpointError, match="no W_skip"):
        load_circuit_tracer(bad)
    (bad / "config.yaml").write_text("model_kind: sparse_thing\n")
    with pytest.raises(CheckpointError, match="model_kind"):
        load_circuit_tracer(bad)
    clt = tmp_path / "clt"
    shutil.copytree(FIXTURE / "ct_clt", clt)
    (clt / "W_dec_2.safetensors").unlink()
    with pytest.raises(CheckpointError, match="W_dec_i"):
        load_circuit_tracer(clt)
    with pytest.raises(CheckpointError, match="one transcoder a layer from 0"):
        save_transcoder_set([SAE.load(DATA / "tc" / "layer_1")], tmp_path / "one")


def test_a_topk_clt_round_trips_under_a_kind_circuit_tracer_refuses(tmp_path: Path) -> None:
    """circuit-tracer has no TopK CLT (its load_clt would run one as ReLU): glassgpt saves it
    in the same layout under its own model_kind, and reads it back the same."""
    torch.manual_seed(0)
    clt = CrossLayerTranscoder(2, 8, 12, "topk", k=3)
    save_clt(clt, tmp_path / "topk")
    assert "model_kind: glassgpt_topk_cross_layer_transcoder" in \
        (tmp_path / "topk" / "config.yaml").read_text()
    back = load_circuit_tracer(tmp_path / "topk")
    x = torch.randn(2, 5, 8)
    assert (back.activation, back.k) == ("topk", 3)
    with torch.no_grad():
        torch.testing.assert_close(back(x), clt(x), atol=0, rtol=0)


def test_a_clt_reading_mlp_hook_in_is_folded_too(tmp_path: Path) -> None:
    """A CLT kept as circuit-tracer's Qwen3 ones are (mlp.hook_in, mlp.hook_out), read
    against the graph fixture's model, encodes x_hat as the CLT it was made from."""
    from glassgpt.rundir.checkpoint import load_model

    model, _ = load_model(DATA / "run", "cpu")
    torch.manual_seed(5)
    clt = CrossLayerTranscoder(2, 32, 16, "relu")
    with torch.no_grad():
        clt.b_enc.normal_(0, 0.3)
    save_clt(clt, tmp_path / "clt")
    for layer in range(2):
        path = tmp_path / "clt" / f"W_enc_{layer}.safetensors"
        t = load_file(path)
        ln = model.blocks[layer].ln2
        w, b = ln.weight.detach(), ln.bias.detach()
        W = t[f"W_enc_{layer}"]  # (d_tc, d_model)
        t[f"b_enc_{layer}"] = t[f"b_enc_{layer}"] - (b / w) @ W.T
        t[f"W_enc_{layer}"] = (W / w).contiguous()
        save_file(t, path)
    (tmp_path / "clt" / "config.yaml").write_text(
        "model_kind: cross_layer_transcoder\nfeature_input_hook: mlp.hook_in\n"
        "feature_output_hook: mlp.hook_out\n")
    folded = load_circuit_tracer(tmp_path / "clt", model)
    assert folded.input_hook_at(1) == "blocks.1.ln2.hook_normalized"
    assert folded.output_hook_at(1) == "blocks.1.hook_mlp_out"
    _, cache = run_with_cache(model, torch.tensor([[0, 17, 5, 42, 33, 8]]))
    x_hat = torch.stack([cache[f"blocks.{layer}.ln2.hook_normalized"][0] for layer in range(2)])
    with torch.no_grad():
        torch.testing.assert_close(folded.encode(x_hat), clt.encode(x_hat), atol=1e-5,
                                   rtol=1e-5)
