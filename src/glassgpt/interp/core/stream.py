"""The residual stream as a sum of parts, and a norm with its scale frozen: what direct logit
attribution (`glassgpt.interp.methods.attribution`) and a dictionary feature's writers
(`glassgpt.interp.sae.features`) both read.

In a Pre-LN model the stream that reaches the final norm is the embeddings plus what every head
(its share of the attention output, `hook_result`) and every MLP wrote into it. With a norm's
scale frozen at its value on the run, the norm is linear in the parts: each part is centred
(LayerNorm), divided by the scale and multiplied by the gain, and their sum is the norm's output.
Shapes: B = batch, C = width, H = heads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glassgpt.errors import ModelError
from glassgpt.interp.core.cache import cached
from glassgpt.norms import ManualLayerNorm


def check_sum_of_parts(model: nn.Module) -> None:
    if not getattr(model.config, "pre_ln", True):
        raise ModelError("direct logit attribution needs a Pre-LN model: a Post-LN one "
                         "renormalises the residual stream after every block, so the stream is "
                         "no sum of the heads' and MLPs' outputs")


def residual_parts(model: nn.Module, cache, pos: int) -> tuple[list[str], list[Tensor]]:
    """The parts whose sum is the stream entering the final norm, at `pos`: each (B, C)."""
    labels, parts = ["embed"], [cached(cache, "hook_embed")[:, pos]]
    if model.config.position == "learned":  # shortformer positions never enter the stream
        labels.append("pos_embed")
        parts.append(cache["hook_pos_embed"][:, pos])
    for layer, block in enumerate(model.blocks):
        # each head's share z_h W_O[h], as the model formed it at its hook point
        per_head = cached(cache, f"blocks.{layer}.attn.hook_result")[:, pos]  # (B, H, C)
        proj = block.attn.proj
        bias = None if proj.bias is None else proj.bias.expand_as(per_head[:, 0])
        head_labels = [f"L{layer}H{head}" for head in range(per_head.shape[1])]
        head_parts = list(per_head.unbind(1))
        if bias is not None:
            head_labels.append(f"L{layer} attn bias")
            head_parts.append(bias)
        if block.ln1_post is not None:  # Gemma: the attention's output is normalised first
            head_labels, head_parts = through_frozen_norm(block.ln1_post, head_labels,
                                                          head_parts, f"L{layer} attn norm")
        labels += head_labels
        parts += head_parts
        if block.ffn is not None:  # an attn_only block has no MLP
            labels.append(f"L{layer} MLP")
            parts.append(cached(cache, f"blocks.{layer}.hook_mlp_out")[:, pos])
    return labels, parts


def through_frozen_norm(norm: nn.Module, labels: list[str], parts: list[Tensor],
                        name: str) -> tuple[list[str], list[Tensor]]:
    """Parts (each (B, C)) whose sum a norm takes, as the parts of what it gives: its scale
    frozen at the sum's (as the final norm's is), so each part is centred (LayerNorm), divided
    by that scale and multiplied by the gain, and a LayerNorm's shift is a part of its own
    (`name` + " bias"). Their sum is the norm's output exactly."""
    wide = [part.double() for part in parts]
    scale, centred = frozen_norm(norm, sum(wide))
    gain = norm_gain(norm).double()
    out = [(part - part.mean(-1, keepdim=True) if centred else part) / scale * gain
           for part in wide]
    shift = getattr(norm, "bias", None)
    if shift is not None:
        labels, out = [*labels, f"{name} bias"], [*out, shift.double().expand_as(out[0])]
    return labels, out


def frozen_norm(norm: nn.Module, stream: Tensor) -> tuple[Tensor, bool]:
    """The final norm's scale on this stream (B, 1), and whether it centres (LayerNorm);
    with no norm (`norm="none"`) a scale of 1."""
    centred = isinstance(norm, nn.LayerNorm | ManualLayerNorm)
    wide = stream.double()
    if isinstance(norm, nn.Identity):
        return torch.ones_like(wide[..., :1]), False
    if centred:
        scale = torch.sqrt(wide.var(-1, keepdim=True, unbiased=False) + norm.eps)
    else:
        scale = torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + norm.eps)
    return scale, centred


def norm_gain(norm: nn.Module) -> Tensor:
    """What a norm multiplies each feature by: RMSNorm's gain (1 + w with norm_offset), a
    LayerNorm's weight, 1 for no norm."""
    if isinstance(norm, nn.Identity):
        return torch.ones(1)
    return getattr(norm, "gain", norm.weight)
