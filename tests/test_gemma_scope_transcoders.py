"""circuit-tracer's Gemma transcoders (`mwhanna/gemma-scope-transcoders`: a config.yaml naming
Gemma Scope's params.npz on the hub) from a local directory laid out as that repository, once
downloaded (glassgpt.interp.sae.circuit_tracer_npz): they load onto a Gemma-2-shaped model with
encode/decode equal to Gemma Scope's formulas and to circuit-tracer 0.5.0's own "gemma-scope"
loader (1e-6), at the same hook points, and `glassgpt graph` runs on them. The fixture is
tests/data/circuit_tracer/gemma_scope/ (make_npz.py, then make_ct_fixture.py in circuit-tracer's
venv); the tests run offline."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, InputError
from glassgpt.interp.sae.circuit_tracer import load_circuit_tracer
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import read_tokenizer, save_model

DATA = Path(__file__).parent / "data" / "circuit_tracer"
FIXTURE = DATA / "gemma_scope"
FILES = ["layer_0/width_16k/average_l0_76/params.npz",
         "layer_1/width_16k/average_l0_65/params.npz"]
TOL = 1e-6
# Gemma 2's block (formats/gemma.py's switches), shrunk: d_model 16 as the fixture's transcoders
GEMMA2_LIKE = dict(n_layer=2, n_head=2, n_kv_head=1, head_dim=8, n_embd=16, block_size=16,
                   vocab_size=64, norm="rmsnorm", norm_eps=1e-6, position="rope",
                   activation="geglu", pre_ln=True, post_norms=True, norm_offset=True,
                   embed_scale=True, bias=False, attn_softcap=50.0, logit_softcap=30.0,
                   query_pre_attn_scalar=8)


@pytest.fixture(scope="module")
def gemma() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GEMMA2_LIKE)).eval()
    with torch.no_grad():  # Gemma's norm weights w (gain 1 + w) away from 0
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model


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


def test_the_hook_points_are_transformer_lenss_gemma_2s(gemma) -> None:
    """What the transcoders read and write in glassgpt's Gemma block: ln2.hook_normalized is
    the pre-MLP norm's x_hat (before its gain 1 + w, as TransformerLens's RMSNorm hooks it and
    circuit-tracer's nnsight mapping reads pre_feedforward_layernorm's _norm), hook_mlp_out
    the MLP's output after the post-MLP norm (post_feedforward_layernorm's output)."""
    from glassgpt.interp import run_with_cache

    ids = torch.tensor([[0, 17, 5, 42, 33, 8]])
    _, cache = run_with_cache(gemma, ids)
    block = gemma.blocks[1]
    u = cache["blocks.1.hook_resid_mid"]
    x_hat = u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + gemma.config.norm_eps)
    torch.testing.assert_close(cache["blocks.1.ln2.hook_normalized"], x_hat)
    with torch.no_grad():
        mlp_out = block.ln2_post(block.ffn(x_hat * (1 + block.ln2.weight)))
    torch.testing.assert_close(cache["blocks.1.hook_mlp_out"], mlp_out)


def test_glassgpt_graph_runs_on_gemma_scope_transcoders(gemma, tmp_path: Path, capsys) -> None:
    """The graph of a Gemma block over the transcoders. glassgpt's graph refuses a final logit
    softcap (Gemma 2's 30.0) whatever the transcoders, so this model has none (Gemma 3's
    block has none either); every other Gemma 2 switch is on."""
    uncapped = GPT(GPTConfig(**{**GEMMA2_LIKE, "logit_softcap": None})).eval()
    uncapped.load_state_dict(gemma.state_dict())
    run = tmp_path / "gemma-run"
    save_model(run, uncapped, read_tokenizer(DATA / "run"))
    capsys.readouterr()
    assert main(["graph", str(run), "--transcoders", str(FIXTURE), "--prompt", "0h5Z"]) == 0
    out = capsys.readouterr().out
    assert "replacement score" in out and "layer 1 feature" in out, out
    # each feature printed is the transcoder's activation on the model's ln2.hook_normalized
    from glassgpt.interp import run_with_cache

    saes = load_circuit_tracer(FIXTURE, uncapped)
    ids = torch.tensor([read_tokenizer(run).encode("0h5Z")])
    _, cache = run_with_cache(uncapped, ids)
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
    wide = GPT(GPTConfig(**{**GEMMA2_LIKE, "n_embd": 32, "head_dim": 16}))
    with pytest.raises(InputError, match="d_model 16"):
        load_circuit_tracer(FIXTURE, wide)
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
