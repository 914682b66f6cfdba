"""glassgpt's side of tests/test_circuit_tracer_files.py: transcoders glassgpt writes in
circuit-tracer's layout, for make_ct_fixture.py to load with circuit-tracer's own loaders
(the recipe is in make_ct_fixture.py's docstring). Run with glassgpt's venv:
    PYTHONPATH=../../../../src python make_glass_files.py .

Writes into the folder given (default "."):
  glass_source.safetensors  the weights of the CLTs below in glassgpt's layout ("glass_clt.W_enc"
                     (L, d_model, d_tc), ...) and the inputs `x` each is run on
  glass_clt/, glass_clt_relu/   a JumpReLU and a ReLU CrossLayerTranscoder (save_clt)
  glass_src_padded/layer_L/     two glassgpt transcoders (SAELens's format) of different widths,
                     a JumpReLU one with some thresholds below 0 and a ReLU one
  glass_set/         ../tc/ (the graph fixture's transcoders) converted (convert_to_circuit_tracer)
  glass_set_padded/  glass_src_padded/ converted: layer 1 padded from 6 to 12 latents
  glass_inputs.safetensors      the inputs of each, for circuit-tracer
"""
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from glassgpt.interp.sae import SAE, SAEConfig
from glassgpt.interp.sae.circuit_tracer import convert_to_circuit_tracer
from glassgpt.interp.sae.circuit_tracer_clt import save_clt
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
TC = Path(__file__).resolve().parent.parent / "tc"
D_MODEL, D_TC, N_POS = 8, 12, 5


def fresh(name: str) -> Path:
    if (OUT / name).exists():
        shutil.rmtree(OUT / name)
    return OUT / name


def random_clt(g: torch.Generator, activation: str, n_layers: int) -> CrossLayerTranscoder:
    clt = CrossLayerTranscoder(n_layers, D_MODEL, D_TC, activation)
    with torch.no_grad():
        clt.W_enc.copy_(torch.randn(n_layers, D_MODEL, D_TC, generator=g) / D_MODEL ** 0.5)
        clt.b_enc.copy_(0.3 * torch.randn(n_layers, D_TC, generator=g))
        clt.b_dec.copy_(0.1 * torch.randn(n_layers, D_MODEL, generator=g))
        for i in range(n_layers):
            clt.W_dec[i].copy_(0.3 * torch.randn(D_TC, n_layers - i, D_MODEL, generator=g))
        if clt.threshold is not None:
            clt.threshold.copy_(0.5 * torch.rand(n_layers, D_TC, generator=g))
    return clt


def random_transcoder(g: torch.Generator, layer: int, width: int, jump: bool) -> SAE:
    cfg = SAEConfig(d_in=D_MODEL, d_sae=width, d_out=D_MODEL, apply_b_dec_to_input=False,
                    architecture="jumprelu_transcoder" if jump else "transcoder",
                    metadata={"hook_name": f"blocks.{layer}.ln2.hook_normalized",
                              "hook_name_out": f"blocks.{layer}.hook_mlp_out"})
    sae = SAE(cfg)
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(D_MODEL, width, generator=g) / D_MODEL ** 0.5)
        sae.W_dec.copy_(0.3 * torch.randn(width, D_MODEL, generator=g))
        sae.b_enc.copy_(0.3 * torch.randn(width, generator=g))
        sae.b_dec.copy_(0.1 * torch.randn(D_MODEL, generator=g))
        if jump:  # some below 0: written as 0, the same function
            sae.threshold.copy_(torch.rand(width, generator=g) - 0.3)
    return sae


def main() -> None:
    g = torch.Generator().manual_seed(540)
    source, inputs = {}, {}
    for name, activation, n_layers in (("glass_clt", "jumprelu", 3),
                                       ("glass_clt_relu", "relu", 2)):
        clt = random_clt(g, activation, n_layers)
        save_clt(clt, fresh(name))
        source |= {f"{name}.{k}": v.detach().clone() for k, v in clt.state_dict().items()}
        inputs[f"{name}.x"] = torch.randn(n_layers, N_POS, D_MODEL, generator=g)
    padded = fresh("glass_src_padded")
    for layer, (width, jump) in enumerate(((D_TC, True), (D_TC // 2, False))):
        random_transcoder(g, layer, width, jump).save(padded / f"layer_{layer}")
    convert_to_circuit_tracer([TC], fresh("glass_set"))
    inputs["glass_set.x"] = torch.randn(2, N_POS, 32, generator=g)
    convert_to_circuit_tracer([OUT / "glass_src_padded"], fresh("glass_set_padded"))
    inputs["glass_set_padded.x"] = torch.randn(2, N_POS, D_MODEL, generator=g)
    save_file(source, OUT / "glass_source.safetensors")
    save_file(inputs, OUT / "glass_inputs.safetensors")
    print("wrote", sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
