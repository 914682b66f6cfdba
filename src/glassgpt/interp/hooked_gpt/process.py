"""TransformerLens's weight processing on a glassgpt model: fold the norms' gains and shifts into
the weights that read them, centre what writes to the residual stream, centre the unembedding.
Each leaves the model's output as it was (the logits; after `center_unembed` the log-probs, the
logits moving by one number per position), and each is refused by name where it would not.

    fold_layer_norm          ln(x) W + b = x_hat (gain * W) + (shift W + b): the gain and the
                             shift move into the W_Q/W_K/W_V, W_in (W_gate) and W_U after each
                             norm, which keeps only its statistics (gain 1, shift 0: TL's
                             "LNPre"/"RMSPre"). LayerNorm's x_hat sums to 0 over C, so those
                             weights are centred over C as well (TL's center_weights).
    center_writing_weights   W_E, W_pos, W_O, b_O, W_out, b_out minus their mean over C: a
                             LayerNorm subtracts that mean from the stream anyway (LN only).
    center_unembed           W_U, b_U minus their mean over the vocabulary: softmax ignores a
                             shift shared by every logit.

They change the model in place (`HookedGPT` hands them its own copy, never a caller's model).
A tied LM head is untied first, so that processing W_U leaves W_E as it is and the reverse.
Notation: C = width, V = vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from glassgpt.errors import ModelError


def untie_head(model: nn.Module) -> None:
    """Give the LM head its own copy of the token embeddings (and the config tie_weights=False)."""
    if model.lm_head.weight is model.tok_emb.weight:
        model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
        model.config = dataclasses.replace(model.config, tie_weights=False)


def give_bias(linear: nn.Linear) -> Tensor:
    """`linear`'s bias, a new zero one where it had none (a folded shift needs a home)."""
    if linear.bias is None:
        linear.bias = nn.Parameter(linear.weight.new_zeros(linear.weight.shape[0]))
    return linear.bias


def norm_gain(norm: nn.Module) -> Tensor:
    """What a norm multiplies x_hat by: its weight, or Gemma's 1 + weight."""
    return getattr(norm, "gain", norm.weight)


def fold_norm_into(norm: nn.Module, readers: list[nn.Linear], centred: bool) -> None:
    """Move `norm`'s gain (and shift) into the Linears reading its output, then make the norm
    a bare one: x_hat W^T + b with W scaled by the gain per input feature, b += W shift."""
    gain, shift = norm_gain(norm).detach(), getattr(norm, "bias", None)
    for linear in readers:
        weight = linear.weight  # (out, C)
        if shift is not None:
            give_bias(linear).add_(weight @ shift.detach())  # (out,), with W before scaling
        weight.mul_(gain)  # (out, C) * (C,)
        if centred:  # x_hat sums to 0 over C: the mean over C of each row reads nothing
            weight.sub_(weight.mean(dim=1, keepdim=True))
    norm.weight.fill_(0.0 if getattr(norm, "offset", False) else 1.0)
    if shift is not None:
        shift.zero_()


def check_pre_ln(model: nn.Module, what: str) -> None:
    if not model.config.pre_ln:
        raise ModelError(f"{what} needs a Pre-LN model: a Post-LN block normalises the sum "
                         "after the sub-layer, so no norm sits before the weights that read it")


def fold_layer_norm(model: nn.Module) -> None:
    """TransformerLens's fold_layer_norm (with center_weights for LayerNorm), in place."""
    config = model.config
    check_pre_ln(model, "fold_layer_norm")
    if config.norm == "none":
        raise ModelError("fold_layer_norm: this model has no norms (norm='none'), nothing to fold")
    if config.position == "shortformer":
        raise ModelError("fold_layer_norm: shortformer positions join ln1's output before W_Q "
                         "and W_K, so ln1's gain cannot move into them")
    centred = config.norm == "layernorm"
    with torch.no_grad():
        for block in model.blocks:
            fold_norm_into(block.ln1, [block.attn.qkv], centred)
            if block.ffn is not None:
                readers = [block.ffn.gate, block.ffn.up] if hasattr(block.ffn, "gate") \
                    else [block.ffn.fc]
                fold_norm_into(block.ln2, readers, centred)
        untie_head(model)
        fold_norm_into(model.ln_f, [model.lm_head], centred)


def center_writing_weights(model: nn.Module) -> None:
    """TransformerLens's center_writing_weights, in place: what writes to the stream, centred."""
    config = model.config
    check_pre_ln(model, "center_writing_weights")
    if config.norm != "layernorm":
        raise ModelError(f"center_writing_weights needs LayerNorm, which removes the stream's "
                         f"mean; this model's norm is {config.norm!r}, so the mean would matter")
    with torch.no_grad():
        untie_head(model)
        writers = [model.tok_emb.weight]  # (V, C)
        if config.position == "learned":  # a shortformer table never reaches the stream
            writers.append(model.pos_emb.weight)  # (n_ctx, C)
        for block in model.blocks:
            projections = [block.attn.proj] + ([] if block.ffn is None else [block.ffn.proj])
            for proj in projections:  # weight (C, in): centred over C, its output axis
                proj.weight.sub_(proj.weight.mean(dim=0, keepdim=True))
                if proj.bias is not None:
                    proj.bias.sub_(proj.bias.mean())
        for weight in writers:
            weight.sub_(weight.mean(dim=-1, keepdim=True))


def center_unembed(model: nn.Module) -> None:
    """TransformerLens's center_unembed, in place: W_U and b_U centred over the vocabulary."""
    if model.config.logit_softcap is not None:
        raise ModelError("center_unembed: this model soft-caps its logits, and the cap of "
                         "shifted logits is not the shifted cap")
    with torch.no_grad():
        untie_head(model)
        weight = model.lm_head.weight  # (V, C)
        weight.sub_(weight.mean(dim=0, keepdim=True))
        if model.lm_head.bias is not None:
            model.lm_head.bias.sub_(model.lm_head.bias.mean())
