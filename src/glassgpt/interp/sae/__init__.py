"""Sparse dictionaries in the hook API: SAELens's sparse autoencoders and transcoders, read and
written in its file format, spliced into a glassgpt model's hook points.

    from glassgpt.interp.sae import SAE, run_with_saes, run_with_cache_and_saes
    sae = SAE.load("my_sae")                              # SAELens's cfg.json + safetensors
    f = sae.encode(x); x_hat = sae.decode(f)              # (..., d_in) -> (..., d_sae) -> ...
    logits = run_with_saes(model, ids, [sae])             # the reconstruction replaces the point
    logits, cache = run_with_cache_and_saes(model, ids, [sae], use_error_term=True)
    cache["blocks.1.hook_resid_post.hook_sae_acts_post"]  # SAELens's names for the latents

Architectures: SAELens's "standard", "topk", "jumprelu", "transcoder" and "jumprelu_transcoder";
a BatchTopK dictionary runs as SAELens runs it after training, as "jumprelu"
(`SAEConfig.batchtopk`). Each is one record of glassgpt.interp.sae.architectures.
`CrossLayerTranscoder` is circuit-tracer's CLT; `load_circuit_tracer` and
`convert_to_circuit_tracer` read and write circuit-tracer's transcoder files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from glassgpt.interp.core.lazyface import lazy_names

# public name -> its module, imported on first use: a torch-free part (the training settings)
# imports without the torch modules of the rest
_HOMES = {
    "CrossLayerTranscoder": "glassgpt.interp.sae.crosslayer",
    "SAE": "glassgpt.interp.sae.model",
    "SAEConfig": "glassgpt.interp.sae.config",
    "SAEMetadata": "glassgpt.interp.sae.config",
    "convert_to_circuit_tracer": "glassgpt.interp.sae.circuit_tracer",
    "load_circuit_tracer": "glassgpt.interp.sae.circuit_tracer",
    "run_with_cache_and_saes": "glassgpt.interp.sae.splice",
    "run_with_saes": "glassgpt.interp.sae.splice",
    "sae_hook_names": "glassgpt.interp.sae.splice",
}

__all__ = ["SAE", "CrossLayerTranscoder", "SAEConfig", "SAEMetadata",
           "convert_to_circuit_tracer", "load_circuit_tracer", "run_with_cache_and_saes",
           "run_with_saes", "sae_hook_names"]

if TYPE_CHECKING:  # what a type checker and an editor see; nothing here runs
    from glassgpt.interp.sae.circuit_tracer import convert_to_circuit_tracer, load_circuit_tracer
    from glassgpt.interp.sae.config import SAEConfig, SAEMetadata
    from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
    from glassgpt.interp.sae.model import SAE
    from glassgpt.interp.sae.splice import run_with_cache_and_saes, run_with_saes, sae_hook_names


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
