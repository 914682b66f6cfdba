"""What turns a dictionary's input into its latents, as SAELens 6's inference SAEs compute it:
`pre_acts` (the one place the pre-activation is written: the model, the trainer, the graphs
and the feature writers call it), then each architecture's activation (`ACTIVATIONS`, keyed by
`Architecture.activation`; glassgpt.interp.sae.architectures).

    x_c  = x - b_dec             when apply_b_dec_to_input (never for a transcoder), else x
    pre  = x_c @ W_enc + b_enc
    f    = ReLU(pre)                                               "relu"
         = ReLU(pre) * [pre > threshold]                           "jumprelu"
         = ReLU of the k largest of pre (of pre * n, with rescale_acts_by_decoder_norm), 0
           elsewhere                                               "topk"
where n (d_sae,) are the decoder rows' norms. The training's forms (BatchTopK over a batch, the
straight-through JumpReLU) are glassgpt.interp.sae.training.objective's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # the SAE calls this module; only its type is named here
    from glassgpt.interp.sae.model import SAE


def pre_acts(sae: SAE, x: Tensor, features: Tensor | None = None) -> Tensor:
    """x (..., d_in), in the dictionary's dtype -> the pre-activations (..., d_sae).

    With `features` (N,) and x (N, d_in): row n's pre-activation of feature features[n] only
    (N,), from those columns of W_enc rather than the whole product. That form is elementwise,
    so a float64 x is computed in float64 on any dictionary."""
    sae_in = x - sae.b_dec if sae.cfg.apply_b_dec_to_input else x
    if features is None:
        return sae_in @ sae.W_enc + sae.b_enc  # (..., d_sae)
    return (sae_in * sae.W_enc[:, features].T).sum(-1) + sae.b_enc[features]  # (N,)


def relu(sae: SAE, pre: Tensor) -> Tensor:
    return F.relu(pre)


def jump_relu(sae: SAE, pre: Tensor) -> Tensor:
    """ReLU, then off at or below each latent's threshold."""
    return F.relu(pre) * (pre > sae.threshold).to(pre.dtype)


def top_k(sae: SAE, pre: Tensor) -> Tensor:
    """The k largest pre-activations of each row (after a ReLU), zero elsewhere."""
    if sae.cfg.rescale_acts_by_decoder_norm:  # rank by what a latent writes, not its size
        pre = pre * sae.W_dec.norm(dim=-1)
    values, indices = torch.topk(pre, k=sae.cfg.k, dim=-1, sorted=False)  # (..., k)
    return torch.zeros_like(pre).scatter(-1, indices, values.relu())  # (..., d_sae)


# Architecture.activation -> pre (..., d_sae) -> latents (..., d_sae), for every architecture
# cfg.json may name
ACTIVATIONS: dict[str, Callable[[SAE, Tensor], Tensor]] = {
    "relu": relu, "jumprelu": jump_relu, "topk": top_k}
