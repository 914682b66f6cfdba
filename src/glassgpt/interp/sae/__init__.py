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
(`SAEConfig.batchtopk`).
"""

from glassgpt.interp.sae.config import SAEConfig, SAEMetadata
from glassgpt.interp.sae.model import SAE
from glassgpt.interp.sae.splice import run_with_cache_and_saes, run_with_saes, sae_hook_names

__all__ = ["SAE", "SAEConfig", "SAEMetadata", "run_with_cache_and_saes", "run_with_saes",
           "sae_hook_names"]
