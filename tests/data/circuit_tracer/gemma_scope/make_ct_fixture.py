"""circuit-tracer 0.5.0's numbers on the Gemma Scope-style files make_npz.py wrote: its own
"gemma-scope" loader (load_transcoder_set with special_load_fn="gemma-scope", which calls
load_gemma_scope_transcoder on each params.npz; given local files it downloads nothing), then
its encode and decode on random inputs. In circuit-tracer's venv (see ../clt/make_ct_fixture.py):
    cd tests/data/circuit_tracer/gemma_scope && /tmp/ct/bin/python make_ct_fixture.py .
Writes ct_outputs.safetensors: x (n_layers, n_pos, d_model), encode, decode.
"""
import sys
from pathlib import Path

import torch
import yaml
from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set
from safetensors.torch import save_file

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
N_POS = 7


def local_paths(config: dict) -> dict[int, str]:
    """Each hub URI's file where make_npz.py put it: its path inside the repository."""
    inside = [uri.removeprefix("hf://").split("/", 2)[2] for uri in config["transcoders"]]
    return {layer: str(OUT / path) for layer, path in enumerate(inside)}


def main() -> None:
    config = yaml.safe_load((OUT / "config.yaml").read_text())
    transcoders = load_transcoder_set(local_paths(config), scan=config["scan"],
                                      feature_input_hook=config["feature_input_hook"],
                                      feature_output_hook=config["feature_output_hook"],
                                      device=torch.device("cpu"), dtype=torch.float32,
                                      special_load_fn="gemma-scope")
    d_model = transcoders[0].d_model
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(config["transcoders"]), N_POS, d_model, generator=g)
    with torch.no_grad():
        encode = torch.stack([tc.encode(x[layer]) for layer, tc in enumerate(transcoders)])
        decode = torch.stack([tc.decode(encode[layer]) for layer, tc in enumerate(transcoders)])
    assert (encode > 0).any() and (encode == 0).any()
    save_file({"x": x, "encode": encode.contiguous(), "decode": decode.contiguous()},
              OUT / "ct_outputs.safetensors")


if __name__ == "__main__":
    main()
