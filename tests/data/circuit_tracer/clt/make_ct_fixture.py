"""circuit-tracer 0.5.0's side of tests/test_crosslayer.py and tests/test_circuit_tracer_files.py:
transcoders it writes itself, and its numbers on the files glassgpt wrote.

circuit-tracer pins TransformerLens < 4, so it runs in a venv of its own, offline, on a CPU:
    python3 -m venv /tmp/ct && /tmp/ct/bin/pip install torch==2.13.0 circuit-tracer==0.5.0
    cd tests/data/circuit_tracer/clt
    PYTHONPATH=../../../../src python make_glass_files.py .   # glassgpt's side (its venv)
    /tmp/ct/bin/python make_ct_fixture.py .                    # this one

Writes into the folder given (default "."):
  ct_clt/            a JumpReLU CLT circuit-tracer wrote (CrossLayerTranscoder.to_safetensors:
                     W_enc_{i}/W_dec_{i}.safetensors) and its config.yaml (as its cache writes it)
  ct_clt_relu/       the same for a ReLU CLT (no threshold_{i})
  ct_set/            a TranscoderSet circuit-tracer wrote (TranscoderSet.to_safetensors:
                     layer_{i}.safetensors; layer 0 JumpReLU, layer 1 ReLU) and its config.yaml
  ct_outputs.safetensors   circuit-tracer's encode / encode_layer / decode on `x` for each of the
                     three above, and on the directories glassgpt wrote (glass_clt/, glass_set/),
                     each loaded with circuit-tracer's own loaders (load_clt, load_transcoder_set)
"""
import sys
from pathlib import Path

import torch
import yaml
from circuit_tracer.transcoder.activation_functions import JumpReLU
from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder
from circuit_tracer.transcoder.single_layer_transcoder import (
    SingleLayerTranscoder,
    TranscoderSet,
)
from circuit_tracer.utils.caching import load_transcoders_from_cache
from safetensors.torch import load_file, save_file

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
CPU = torch.device("cpu")
N_LAYERS, D_MODEL, D_TC, N_POS = 3, 8, 12, 5


def write_config(directory: Path, kind: str, input_hook: str, output_hook: str) -> None:
    """config.yaml as circuit-tracer's cache writes it (save_transcoders_to_cache)."""
    config = {"model_kind": kind, "feature_input_hook": input_hook,
              "feature_output_hook": output_hook, "scan": f"glassgpt-fixture/{directory.name}"}
    with open(directory / "config.yaml", "w") as f:
        yaml.dump(config, f)


def random_clt(g: torch.Generator, activation: str, n_layers: int) -> CrossLayerTranscoder:
    clt = CrossLayerTranscoder(n_layers, D_TC, D_MODEL, activation_function=activation,
                               lazy_decoder=False, device=CPU, dtype=torch.float32,
                               feature_input_hook="ln2.hook_normalized",
                               feature_output_hook="hook_mlp_out")
    with torch.no_grad():
        clt.W_enc.copy_(torch.randn(n_layers, D_TC, D_MODEL, generator=g) / D_MODEL ** 0.5)
        clt.b_enc.copy_(0.3 * torch.randn(n_layers, D_TC, generator=g))
        clt.b_dec.copy_(0.1 * torch.randn(n_layers, D_MODEL, generator=g))
        for i in range(n_layers):
            clt.W_dec[i].copy_(torch.randn(D_TC, n_layers - i, D_MODEL, generator=g) * 0.3)
        if activation == "jump_relu":
            clt.activation_function.threshold.copy_(
                0.5 * torch.rand(n_layers, 1, D_TC, generator=g))
    return clt


def clt_outputs(clt, x: torch.Tensor, prefix: str) -> dict:
    """encode, encode_layer (each layer) and decode of circuit-tracer's CLT on x (L, N_POS, d)."""
    with torch.no_grad():
        acts = clt.encode(x)
        out = {f"{prefix}.x": x, f"{prefix}.encode": acts, f"{prefix}.decode": clt.decode(acts)}
        for layer in range(clt.n_layers):
            out[f"{prefix}.encode_layer.{layer}"] = clt.encode_layer(x[layer], layer)
    return out


def set_outputs(tset, x: torch.Tensor, prefix: str) -> dict:
    with torch.no_grad():
        acts = tset.encode(x)
        return {f"{prefix}.x": x, f"{prefix}.encode": acts,
                f"{prefix}.decode": tset.decode(acts, None)}


def random_set(g: torch.Generator) -> TranscoderSet:
    transcoders = {}
    for layer in range(2):
        if layer == 0:
            activation = JumpReLU(0.5 * torch.rand(D_TC, generator=g), 0.1)
        else:
            activation = torch.nn.functional.relu
        tc = SingleLayerTranscoder(D_MODEL, D_TC, activation, layer, device=CPU,
                                   dtype=torch.float32)
        with torch.no_grad():
            tc.W_enc.copy_(torch.randn(D_TC, D_MODEL, generator=g) / D_MODEL ** 0.5)
            tc.W_dec.copy_(torch.randn(D_TC, D_MODEL, generator=g) * 0.3)
            tc.b_enc.copy_(0.3 * torch.randn(D_TC, generator=g))
            tc.b_dec.copy_(0.1 * torch.randn(D_MODEL, generator=g))
        transcoders[layer] = tc
    return TranscoderSet(transcoders, feature_input_hook="ln2.hook_normalized",
                         feature_output_hook="hook_mlp_out", scan="glassgpt-fixture/ct_set")


def circuit_tracer_written(g: torch.Generator) -> dict:
    outputs = {}
    for name, activation, n_layers in (("ct_clt", "jump_relu", N_LAYERS),
                                       ("ct_clt_relu", "relu", 2)):
        clt = random_clt(g, activation, n_layers)
        clt.to_safetensors(str(OUT / name))
        write_config(OUT / name, "cross_layer_transcoder", clt.feature_input_hook,
                     clt.feature_output_hook)
        x = torch.randn(n_layers, N_POS, D_MODEL, generator=g)
        outputs |= clt_outputs(clt, x, name)
    tset = random_set(g)
    tset.to_safetensors(str(OUT / "ct_set"))
    write_config(OUT / "ct_set", "transcoder_set", tset.feature_input_hook,
                 tset.feature_output_hook)
    outputs |= set_outputs(tset, torch.randn(2, N_POS, D_MODEL, generator=g), "ct_set")
    return outputs


def glassgpt_written() -> dict:
    """The directories make_glass_files.py wrote, read as circuit-tracer reads a directory of
    its cache (load_transcoders_from_cache: config.yaml's model_kind and hooks, then load_clt
    or load_transcoder_set), on glassgpt's inputs."""
    outputs = {}
    inputs = load_file(OUT / "glass_inputs.safetensors")
    for name in ("glass_clt", "glass_clt_relu", "glass_set", "glass_set_padded"):
        loaded, config = load_transcoders_from_cache(name, cache_dir=OUT, device=CPU,
                                                     dtype=torch.float32, lazy_encoder=False,
                                                     lazy_decoder=False)
        if config["model_kind"] == "cross_layer_transcoder":
            assert isinstance(loaded, CrossLayerTranscoder), type(loaded)
            outputs |= clt_outputs(loaded, inputs[f"{name}.x"], name)
        else:
            assert isinstance(loaded, TranscoderSet), type(loaded)
            outputs |= set_outputs(loaded, inputs[f"{name}.x"], name)
    return outputs


def main() -> None:
    g = torch.Generator().manual_seed(54)
    outputs = circuit_tracer_written(g)
    if (OUT / "glass_inputs.safetensors").exists():
        outputs |= glassgpt_written()
    else:
        print("no glass_inputs.safetensors: run make_glass_files.py first for glassgpt's side")
    save_file({k: v.contiguous() for k, v in outputs.items()}, OUT / "ct_outputs.safetensors")
    print("wrote", OUT / "ct_outputs.safetensors", len(outputs), "tensors")


if __name__ == "__main__":
    main()
