"""circuit-tracer's side of `glassgpt bench graph`, run by the python of a venv that has
circuit-tracer (it pins TransformerLens < 4, so it cannot be installed beside glassgpt): this
file imports nothing of glassgpt.

    CIRCUIT_TRACER_PYTHON circuit_tracer_worker.py FOLDER ROUNDS BATCH_SIZE

FOLDER holds what glassgpt.bench.graph wrote: the model as TransformerLens's checkpoint
(lens/config.json, lens/model.safetensors: `glassgpt convert --to-lens`'s files), one
transcoder a layer in circuit-tracer's layout (transcoders/layer_L.safetensors: W_enc (d_sae,
d_model), b_enc, W_dec (d_sae, d_model), b_dec; ReLU, reading ln2.hook_normalized and writing
hook_mlp_out) and prompt.json. The model is built offline (no hub), `attribute` runs once
untimed and ROUNDS times timed; the last graph's adjacency goes to FOLDER/adjacency.safetensors
and one JSON line with the seconds of each round is printed.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from circuit_tracer import attribute
from circuit_tracer.replacement_model.replacement_model_transformerlens import (
    TransformerLensReplacementModel,
)
from circuit_tracer.transcoder import SingleLayerTranscoder, TranscoderSet
from safetensors.torch import load_file, save_file
from transformer_lens import HookedTransformerConfig


class IdTokenizer:
    """What circuit-tracer reads of a tokenizer. The prompt's first id is declared its only
    special id, so circuit-tracer takes the ids as they are (it prepends a BOS otherwise)."""

    def __init__(self, vocab_size: int, first_id: int):
        self.vocab_size, self.bos_token_id = vocab_size, first_id
        self.pad_token_id = self.eos_token_id = None
        self.all_special_ids = [first_id]
        self.padding_side = "right"

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return " ".join(str(i) for i in ([ids] if isinstance(ids, int) else ids))


def replacement_model(folder: Path, first_id: int, transcoders: str = "transcoders",
                      input_hook: str = "ln2.hook_normalized"
                      ) -> TransformerLensReplacementModel:
    """circuit-tracer's replacement model of FOLDER's checkpoint (lens/) and transcoders
    (`transcoders`/layer_L.safetensors, read at `input_hook`); tests/data/circuit_tracer's
    script builds its reference with it too."""
    config = json.loads((folder / "lens" / "config.json").read_text())
    cfg = HookedTransformerConfig(**config, device="cpu", dtype=torch.float32, seed=0)
    model = TransformerLensReplacementModel(cfg)  # a HookedTransformer until configured
    missing, unexpected = model.load_state_dict(
        load_file(str(folder / "lens" / "model.safetensors")), strict=False)
    if unexpected or not all(k.endswith((".mask", ".IGNORE")) for k in missing):
        raise SystemExit(f"the checkpoint does not fit: {unexpected} {missing}")
    model.tokenizer = IdTokenizer(cfg.d_vocab, first_id)
    layers = {}
    for layer in range(cfg.n_layers):
        weights = load_file(str(folder / transcoders / f"layer_{layer}.safetensors"))
        d_sae, d_model = weights["W_enc"].shape
        transcoder = SingleLayerTranscoder(d_model, d_sae, F.relu, layer,
                                           device=torch.device("cpu"), dtype=torch.float32)
        transcoder.load_state_dict(weights, strict=True)
        layers[layer] = transcoder
    model._configure_replacement_model(TranscoderSet(
        layers, feature_input_hook=input_hook, feature_output_hook="hook_mlp_out",
        scan="glassgpt-bench"))
    return model.eval()


def main() -> None:
    folder, rounds, batch_size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_grad_enabled(True)
    ids = torch.tensor(json.loads((folder / "prompt.json").read_text())["ids"])
    model = replacement_model(folder, int(ids[0]))
    graph = attribute(ids, model, batch_size=batch_size)  # warm-up, untimed
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        graph = attribute(ids, model, batch_size=batch_size)
        seconds.append(time.perf_counter() - start)
    save_file({"adjacency_matrix": graph.adjacency_matrix.float().contiguous()},
              str(folder / "adjacency.safetensors"))
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
