"""The cross-layer transcoder (glassgpt.interp.sae.crosslayer) computes what circuit-tracer
0.5.0's CrossLayerTranscoder computes on the same weights: encode, encode_layer and decode
within 1e-6, for a JumpReLU and a ReLU CLT. The weights and circuit-tracer's numbers are
tests/data/circuit_tracer/clt/ (made by its make_ct_fixture.py, in circuit-tracer's own venv);
here the weights are read straight from circuit-tracer's files, without glassgpt's reader
(tests/test_circuit_tracer_files.py holds that)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glassgpt.errors import ConfigError, InputError
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder

FIXTURE = Path(__file__).parent / "data" / "circuit_tracer" / "clt"
TOL = 1e-6


@pytest.fixture(scope="module")
def ct_outputs() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "ct_outputs.safetensors")


def clt_from_ct_files(directory: Path) -> CrossLayerTranscoder:
    """circuit-tracer's layout (W_enc_i (d_tc, d_model), W_dec_i (d_tc, L - i, d_model), ...)
    copied by hand into glassgpt's (W_enc (L, d_model, d_tc))."""
    n_layers = len(list(directory.glob("W_enc_*.safetensors")))
    enc = [load_file(directory / f"W_enc_{i}.safetensors") for i in range(n_layers)]
    dec = [load_file(directory / f"W_dec_{i}.safetensors")[f"W_dec_{i}"] for i in range(n_layers)]
    d_tc, d_model = enc[0]["W_enc_0"].shape
    jump = "threshold_0" in enc[0]
    clt = CrossLayerTranscoder(n_layers, d_model, d_tc, "jumprelu" if jump else "relu")
    with torch.no_grad():
        for i, tensors in enumerate(enc):
            clt.W_enc[i].copy_(tensors[f"W_enc_{i}"].T)
            clt.b_enc[i].copy_(tensors[f"b_enc_{i}"])
            clt.b_dec[i].copy_(tensors[f"b_dec_{i}"])
            clt.W_dec[i].copy_(dec[i])
            if jump:
                clt.threshold[i].copy_(tensors[f"threshold_{i}"])
    return clt


@pytest.mark.parametrize("name", ["ct_clt", "ct_clt_relu"])
def test_encode_decode_equal_circuit_tracer(name: str, ct_outputs: dict) -> None:
    clt = clt_from_ct_files(FIXTURE / name)
    x = ct_outputs[f"{name}.x"]  # (L, n_pos, d_model)
    with torch.no_grad():
        acts = clt.encode(x)
        torch.testing.assert_close(acts, ct_outputs[f"{name}.encode"], atol=TOL, rtol=0)
        assert (acts > 0).any() and (acts == 0).any()  # some features fire, some do not
        for layer in range(clt.n_layers):
            torch.testing.assert_close(clt.encode_layer(x[layer], layer),
                                       ct_outputs[f"{name}.encode_layer.{layer}"],
                                       atol=TOL, rtol=0)
        # decode of circuit-tracer's own features, then the whole forward
        torch.testing.assert_close(clt.decode(ct_outputs[f"{name}.encode"]),
                                   ct_outputs[f"{name}.decode"], atol=TOL, rtol=0)
        torch.testing.assert_close(clt(x), ct_outputs[f"{name}.decode"], atol=TOL, rtol=0)


def test_decode_is_the_written_out_sum() -> None:
    """y_t = sum over l <= t of f_l @ W_dec[l][:, t - l] + b_dec[t], in float64, for a batch
    shape with two leading axes; decoder_rows(l) is W_dec[l]."""
    torch.manual_seed(0)
    clt = CrossLayerTranscoder(4, 6, 10, "topk", k=3, dtype=torch.float64)
    with torch.no_grad():
        clt.b_dec.normal_()
    x = torch.randn(4, 2, 3, 6, dtype=torch.float64)
    acts = clt.encode(x)  # (4, 2, 3, 10)
    assert ((acts != 0).sum(-1) <= 3).all()
    y = clt.decode(acts)
    for t in range(4):
        expected = clt.b_dec[t] + sum(acts[s] @ clt.decoder_rows(s)[:, t - s] for s in range(t + 1))
        torch.testing.assert_close(y[t], expected, atol=1e-12, rtol=0)
    assert clt.decoder_rows(1).shape == (10, 3, 6)
    assert clt.input_hook_at(2) == "blocks.2.ln2.hook_normalized"
    assert clt.output_hook_at(0) == "blocks.0.hook_mlp_out"


def test_refuses_what_it_cannot_be() -> None:
    with pytest.raises(ConfigError, match="k must be"):
        CrossLayerTranscoder(2, 4, 8, "topk")
    with pytest.raises(ConfigError, match="activation"):
        CrossLayerTranscoder(2, 4, 8, "gelu")
    with pytest.raises(ConfigError, match="{L}"):
        CrossLayerTranscoder(2, 4, 8, input_hook="blocks.0.hook_resid_mid")
    clt = CrossLayerTranscoder(2, 4, 8)
    with pytest.raises(InputError, match=r"\(n_layers = 2"):
        clt.encode(torch.zeros(3, 5, 4))
    with pytest.raises(InputError, match="layer 2"):
        clt.encode_layer(torch.zeros(5, 4), 2)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(1)
    clt = CrossLayerTranscoder(3, 6, 10, metadata={"model_name": "a run"})
    with torch.no_grad():
        clt.threshold.uniform_(0, 0.2)
    clt.save(tmp_path / "clt")
    back = CrossLayerTranscoder.load(tmp_path / "clt")
    assert back.metadata == {"model_name": "a run"}
    for name, tensor in clt.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
