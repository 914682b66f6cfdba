"""circuit-tracer's Gemma transcoders (`mwhanna/gemma-scope-transcoders`: a config.yaml naming
Gemma Scope's params.npz on the hub) from a local directory laid out as that repository, once
downloaded (glassgpt.interp.sae.circuit_tracer_npz): they load onto an imported Gemma 2 with
encode/decode equal to Gemma Scope's formulas and to circuit-tracer 0.5.0's own "gemma-scope"
loader (1e-6), at the same hook points, and `glassgpt graph` runs on them. The fixture is
tests/data/circuit_tracer/gemma_scope/ (make_npz.py, then make_ct_fixture.py in circuit-tracer's
venv); the tests run offline."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from glassgpt.cli import main
from glassgpt.errors import CheckpointError, InputError
from glassgpt.interp.sae.circuit_tracer import load_circuit_tracer
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import read_tokenizer, save_model

DATA = Path(__file__).parent / "data" / "circuit_tracer"
FIXTURE = DATA / "gemma_scope"
FILES = ["layer_0/width_16k/average_l0_76/params.npz",
         "layer_1/width_16k/average_l0_65/params.npz"]
TOL = 1e-6


@pytest.fixture(scope="module")
def theirs() -> torch.nn.Module:
    """transformers' Gemma 2 (circuit-tracer's Gemma2ForCausalLM), shrunk to d_model 16 as the
    fixture's transcoders, every weight random (norm weights w, gain 1 + w, included)."""
    transformers = pytest.importorskip("transformers")
    from test_interop_modern import randomize

    config = transformers.Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
        max_position_embeddings=32, sliding_window=4, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Gemma2ForCausalLM(config)
    randomize(model, seed=54)
    return model.eval()


@pytest.fixture(scope="module")
def gemma(theirs) -> GPT:
    """The same model imported into glassgpt."""
    from glassgpt.formats.interop import from_hf

    return from_hf(theirs).eval()


def jumprelu_formulas(npz: Path, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gemma Scope's transcoder on x (n, d_model), from the file's arrays in float64."""
    with np.load(npz, allow_pickle=False) as p:
        z = x @ p["W_enc"].astype(np.float64) + p["b_enc"]
        acts = z * (z > p["threshold"])
        return acts, acts @ p["W_dec"].astype(np.float64) + p["b_dec"]


def test_gemma_scope_npz_loads_as_its_formulas_and_circuit_tracers_loader(gemma) -> None:
    saes = load_circuit_tracer(FIXTURE, gemma)
    ct = load_file(FIXTURE / "ct_outputs.safetensors")
    assert [sae.cfg.architecture for sae in saes] == ["jumprelu_transcoder"] * 2
    for layer, sae in enumerate(saes):
        assert sae.cfg.hook_name == f"blocks.{layer}.ln2.hook_normalized"
        assert sae.cfg.hook_name_out == f"blocks.{layer}.hook_mlp_out"
        x = ct["x"][layer]  # (n_pos, d_model)
        acts, recon = jumprelu_formulas(FIXTURE / FILES[layer], x.double().numpy())
        with torch.no_grad():
            mine = sae.encode(x)
            torch.testing.assert_close(mine.double(), torch.from_numpy(acts), atol=TOL, rtol=0)
            torch.testing.assert_close(sae.decode(mine).double(), torch.from_numpy(recon),
                                       atol=TOL, rtol=0)
            torch.testing.assert_close(mine, ct["encode"][layer], atol=TOL, rtol=0)
            torch.testing.assert_close(sae.decode(mine), ct["decode"][layer], atol=TOL, rtol=0)
        assert 0 < int((mine > 0).sum()) < mine.numel()


def test_the_hook_points_are_circuit_tracers_in_gemma_2(gemma, theirs) -> None:
    """Where circuit-tracer reads and writes Gemma 2's transcoders (its TransformerLens names,
    mapped onto transformers' Gemma2ForCausalLM in circuit_tracer/utils/tl_nnsight_mapping.py):
    ln2.hook_normalized is pre_feedforward_layernorm's _norm (x / rms, before the gain 1 + w),
    hook_mlp_out is post_feedforward_layernorm's output. glassgpt's imported model has both
    under the same names."""
    from glassgpt.interp import run_with_cache

    ids = torch.tensor([[0, 17, 5, 42, 33, 8, 61]])
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for layer, block in enumerate(theirs.model.layers):
        norm, eps = block.pre_feedforward_layernorm, theirs.config.rms_norm_eps
        handles.append(norm.register_forward_hook(
            lambda m, args, out, layer=layer, eps=eps: seen.update({
                f"blocks.{layer}.ln2.hook_normalized":
                    args[0] * torch.rsqrt(args[0].pow(2).mean(-1, keepdim=True) + eps)})))
        handles.append(block.post_feedforward_layernorm.register_forward_hook(
            lambda m, args, out, layer=layer: seen.update({f"blocks.{layer}.hook_mlp_out": out})))
    with torch.no_grad():
        theirs(ids)
    for handle in handles:
        handle.remove()
    _, cache = run_with_cache(gemma, ids)
    assert len(seen) == 4
    for name, expected in seen.items():
        torch.testing.assert_close(cache[name], expected, atol=1e-5, rtol=1e-5)


def test_glassgpt_graph_runs_on_gemma_scope_transcoders(gemma, tmp_path: Path, capsys) -> None:
    """The graph of the imported Gemma 2 over the transcoders, every switch on, its final logit
    soft-cap (30.0) too: the graph is circuit-tracer's of a capped model (test_graph_softcap)."""
    assert gemma.config.logit_softcap == 30.0
    run = tmp_path / "gemma-run"
    save_model(run, gemma, read_tokenizer(DATA / "run"))
    capsys.readouterr()
    assert main(["graph", str(run), "--transcoders", str(FIXTURE), "--prompt", "0h5Z"]) == 0
    out = capsys.readouterr().out
    assert "replacement score" in out and "layer 1 feature" in out, out
    # each feature printed is the transcoder's activation on the model's ln2.hook_normalized
    from glassgpt.interp import run_with_cache

    saes = load_circuit_tracer(FIXTURE, gemma)
    ids = torch.tensor([read_tokenizer(run).encode("0h5Z")])
    _, cache = run_with_cache(gemma, ids)
    found = re.findall(r"layer (\d) feature +(\d+) at .* \(position (\d)\): activation "
                       r"([\d.]+)", out)
    assert len(found) >= 5
    for layer, feature, position, printed in found:
        x_hat = cache[f"blocks.{layer}.ln2.hook_normalized"][0, int(position)]
        with torch.no_grad():
            activation = saes[int(layer)].encode(x_hat)[int(feature)]
        assert abs(float(activation) - float(printed)) <= 5e-4


def copy_of_fixture(tmp_path: Path) -> Path:
    out = tmp_path / "gemma-scope-transcoders"
    shutil.copytree(FIXTURE, out)
    return out


def test_refused_what_does_not_fit(gemma, tmp_path: Path) -> None:
    wide = GPT(dataclasses.replace(gemma.config, n_embd=32))
    with pytest.raises(InputError, match="d_model 16"):
        load_circuit_tracer(FIXTURE, wide)
    with pytest.raises(InputError, match="transcoders for 2 layers; the model has 1"):
        load_circuit_tracer(FIXTURE, GPT(dataclasses.replace(gemma.config, n_layer=1)))
    out = copy_of_fixture(tmp_path)
    (out / FILES[1]).unlink()
    with pytest.raises(CheckpointError, match="average_l0_65/params.npz is not in"):
        load_circuit_tracer(out, gemma)
    shutil.rmtree(out)
    out = copy_of_fixture(tmp_path)  # an object array would need unpickling: never read
    with np.load(FIXTURE / FILES[0], allow_pickle=False) as p:
        arrays = dict(p)
    arrays["b_dec"] = np.array([object()] * 16, dtype=object)
    np.savez(out / FILES[0], **arrays)
    with pytest.raises(CheckpointError, match="b_dec is object, not a float array"):
        load_circuit_tracer(out, gemma)
    arrays["b_dec"] = np.zeros(15, np.float32)
    np.savez(out / FILES[0], **arrays)
    with pytest.raises(CheckpointError, match=r"b_dec has shape \(15,\)"):
        load_circuit_tracer(out, gemma)


def test_a_path_outside_the_directory_is_not_read(gemma, tmp_path: Path) -> None:
    out = copy_of_fixture(tmp_path)
    shutil.copy(out / FILES[0], tmp_path / "params.npz")
    text = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(text.replace(f"hf://google/gemma-scope-2b-pt-transcoders/"
                                                  f"{FILES[0]}", "../params.npz"))
    with pytest.raises(CheckpointError, match=r"\.\./params\.npz is not in"):
        load_circuit_tracer(out, gemma)
    absolute = str((tmp_path / "params.npz").resolve())
    (out / "config.yaml").write_text(text.replace(f"hf://google/gemma-scope-2b-pt-transcoders/"
                                                  f"{FILES[0]}", absolute))
    with pytest.raises(CheckpointError, match="params.npz is not in"):
        load_circuit_tracer(out, gemma)
    (out / "config.yaml").write_text(text)  # a download's links (older hub clients) are read
    (out / FILES[0]).unlink()
    (out / FILES[0]).symlink_to(tmp_path / "params.npz")
    assert len(load_circuit_tracer(out, gemma)) == 2
