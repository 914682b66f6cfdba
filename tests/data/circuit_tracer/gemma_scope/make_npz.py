"""Gemma Scope-style transcoders laid out as circuit-tracer's `mwhanna/gemma-scope-transcoders`
is, once downloaded: a config.yaml whose `transcoders:` are hub URIs of Gemma Scope's
params.npz, and each file at its path in google/gemma-scope-2b-pt-transcoders. Random weights,
small (d_model 16, the Gemma-2-shaped test model's; 24 latents; 2 layers); numpy only:
    cd tests/data/circuit_tracer/gemma_scope && python make_npz.py .
then /tmp/ct/bin/python make_ct_fixture.py . (circuit-tracer's numbers on these files).
"""
import sys
from pathlib import Path

import numpy as np

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPO = "google/gemma-scope-2b-pt-transcoders"
N_LAYERS, D_MODEL, D_TC = 2, 16, 24
L0 = (76, 65)  # the published set's file names for layers 0 and 1


def params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Gemma Scope's five arrays: W_enc (d_model, d_tc), thresholds above 0 so that about
    half the latents fire on a unit-RMS input."""
    f32 = np.float32
    return {"W_enc": (rng.standard_normal((D_MODEL, D_TC)) / D_MODEL ** 0.5).astype(f32),
            "W_dec": (0.3 * rng.standard_normal((D_TC, D_MODEL))).astype(f32),
            "b_enc": (0.2 * rng.standard_normal(D_TC)).astype(f32),
            "b_dec": (0.1 * rng.standard_normal(D_MODEL)).astype(f32),
            "threshold": (0.05 + 0.5 * rng.random(D_TC)).astype(f32)}


def main() -> None:
    rng = np.random.default_rng(54)
    uris = []
    for layer in range(N_LAYERS):
        inside = f"layer_{layer}/width_16k/average_l0_{L0[layer]}/params.npz"
        path = OUT / inside
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **params(rng))
        uris.append(f"hf://{REPO}/{inside}")
    lines = ["model_name: google/gemma-2-2b", "model_kind: transcoder_set",
             "feature_input_hook: ln2.hook_normalized", "feature_output_hook: hook_mlp_out",
             "scan: gemma-2-2b", "transcoders:"] + [f"  - \"{uri}\"" for uri in uris]
    (OUT / "config.yaml").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
