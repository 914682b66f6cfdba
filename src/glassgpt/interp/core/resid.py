"""The residual stream of a cached run split into what wrote it, as TransformerLens's
ActivationCache splits it: the streams before each block, each sub-layer's output, each head's
and each neuron's, the norm's view of them and their push on a logit. `ActivationCache`'s
methods of the same names call these; each takes the cache first.

In a Pre-LN block the stream is a sum: embeddings (learned positions included; a shortformer's
positions and rotary ones never join it), then every attention and MLP output; an attention
output is its heads' results plus b_O, an MLP output its neurons' (post[n] * W_out[n]) plus b_out.
So every decomposition here adds up to the cached stream. glassgpt's weights: W_O[h] is columns
h*d:(h+1)*d of attn.proj.weight, W_out is ffn.proj.weight.T, W_U is lm_head.weight.T.
Shapes: L = layers, C = width, H = heads, F = MLP width, "..." = (B, T), fewer after
`remove_batch_dim` or an int position.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from glassgpt.errors import InputError
from glassgpt.norms import LayerNorm, ManualLayerNorm, RMSNorm

# What TransformerLens's Slice takes: None (all), an int, a (start, stop[, step]) tuple, a
# slice, a list / tensor / array of indices (or a mask), or a TransformerLens Slice itself.
Slicing = Any


def as_index(value: Slicing, what: str = "pos_slice") -> int | slice | Tensor:
    """A slicing as TransformerLens's Slice reads it -> an index for one axis (an int drops it)."""
    if value is None:
        return slice(None)
    if hasattr(value, "slice") and hasattr(value, "mode"):  # a TransformerLens Slice
        value = value.slice
    if isinstance(value, slice):
        return value
    if isinstance(value, tuple):
        if not 1 <= len(value) <= 3 or not all(v is None or is_int(v) for v in value):
            raise InputError(f"a {what} tuple is (stop), (start, stop) or (start, stop, step) of "
                             f"ints, got {value!r:.60}")
        return slice(*value)
    if isinstance(value, np.ndarray | Tensor) and value.ndim == 0 and is_int(value.item()):
        return int(value.item())
    if is_int(value):
        return int(value)
    if isinstance(value, list | np.ndarray | Tensor):
        index = torch.as_tensor(value)
        if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32, torch.bool):
            raise InputError(f"a {what} list is 1-d ints (or a mask), got {value!r:.60}")
        return index
    raise InputError(f"{what} must be None, an int, a tuple, a slice or a list of indices, got "
                     f"{type(value).__name__}")


def is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def take(tensor: Tensor, index: int | slice | Tensor, dim: int) -> Tensor:
    """tensor indexed by `index` along `dim` (negative counts from the end)."""
    if isinstance(index, Tensor):
        index = index.to(tensor.device)
    axis = dim % tensor.dim()
    try:
        return tensor[(slice(None),) * axis + (index,)]
    except IndexError:  # a position, prompt or neuron past the end: named, not torch's words
        shown = index.tolist() if isinstance(index, Tensor) else index
        raise InputError(f"index {shown!r:.60} is out of range for an axis of size "
                         f"{tensor.shape[axis]}") from None


def glass_model(cache: Any) -> nn.Module:
    """The glassgpt GPT whose weights the analysis reads: the cache's model, or the one a
    wrapper of it (HookedGPT) holds as `.glass`."""
    model = cache.model
    if model is None:
        raise InputError("this analysis reads the model's weights, and this cache has no model "
                         "(made without one, or the model is gone): run_with_cache again")
    inner = getattr(model, "glass", None)
    return inner if isinstance(inner, nn.Module) else model


def layer_count(cache: Any, layer: Any, what: str = "layer") -> int:
    """A layer argument -> a count of blocks: None or -1 mean all n_layer, else 0..n_layer."""
    n_layer = glass_model(cache).config.n_layer
    if layer is None or (is_int(layer) and layer == -1):
        return n_layer
    if not is_int(layer) or not 0 <= layer <= n_layer:
        raise InputError(f"{what} must be an int in [0, n_layer = {n_layer}] (or -1 / None: "
                         f"all), got {layer!r:.40}")
    return int(layer)


def has_mlp(model: nn.Module) -> bool:
    return not getattr(model.config, "attn_only", False)


def positions_in_stream(cache: Any, model: nn.Module) -> bool:
    """Whether the stream holds the position embedding (a shortformer's reaches Q and K only)."""
    return "hook_pos_embed" in cache and model.config.position == "learned"


def require_sum_of_parts(model: nn.Module, what: str, per_part: bool = False) -> None:
    """Refuse where the stream is not the plain sum this splits it into: a Post-LN block
    normalises the sums, and with post_norms a head's or neuron's output is normalised
    before it joins the stream."""
    if not model.config.pre_ln:
        raise InputError(f"{what} splits a Pre-LN stream (a sum of the parts' outputs); a "
                         "Post-LN block (pre_ln=False) normalises the sums")
    if per_part and model.config.post_norms:
        raise InputError(f"{what} splits each sub-layer into heads or neurons, and with "
                         "post_norms their outputs are normalised before they join the stream")


def labelled(stack: Tensor, labels: list[str], return_labels: bool):
    return (stack, labels) if return_labels else stack


def empty_stack(cache: Any, pos: int | slice | Tensor, width: int | None = None) -> Tensor:
    """A stack of no parts, (0, ..., C) (or width), shaped as the embeddings after `pos`."""
    like = take(cache["hook_embed"], pos, -2)
    shape = like.shape if width is None else (*like.shape[:-1], width)
    return like.new_zeros((0, *shape))


def accumulated_resid(cache: Any, layer: Any, incl_mid: bool, apply_ln: bool, pos_slice: Slicing,
                      mlp_input: bool, return_labels: bool):
    pos, layer = as_index(pos_slice), layer_count(cache, layer)
    n_layer = glass_model(cache).config.n_layer
    parts, labels = [], []
    for l in range(layer + 1):
        if l == n_layer:
            parts.append(cache["resid_post", n_layer - 1])
            labels.append("final_post")
            continue
        parts.append(cache["resid_pre", l])
        labels.append(f"{l}_pre")
        if (incl_mid and l < layer) or (mlp_input and l == layer):
            parts.append(cache["resid_mid", l])
            labels.append(f"{l}_mid")
    stack = torch.stack([take(part, pos, -2) for part in parts])  # (L', ..., C)
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input, pos_slice, None,
                                  cache.has_batch_dim, recompute_ln=layer == n_layer)
    return labelled(stack, labels, return_labels)


def decompose_resid(cache: Any, layer: Any, mlp_input: bool, mode: str, apply_ln: bool,
                    pos_slice: Slicing, incl_embeds: bool, return_labels: bool):
    model, pos, layer = glass_model(cache), as_index(pos_slice), layer_count(cache, layer)
    if mode not in ("all", "mlp", "attn"):
        raise InputError(f"mode must be 'all', 'mlp' or 'attn', got {mode!r:.40}")
    require_sum_of_parts(model, "decompose_resid")
    with_attn, with_mlp = mode != "mlp", mode != "attn" and has_mlp(model)
    parts, labels = [], []
    if incl_embeds and "hook_embed" in cache:
        parts.append(cache["hook_embed"])
        labels.append("embed")
    if incl_embeds and positions_in_stream(cache, model):
        parts.append(cache["hook_pos_embed"])
        labels.append("pos_embed")
    for l in range(layer):
        if with_attn:
            parts.append(cache["attn_out", l])
            labels.append(f"{l}_attn_out")
        if with_mlp:
            parts.append(cache["mlp_out", l])
            labels.append(f"{l}_mlp_out")
    if mlp_input and with_attn:
        parts.append(cache["attn_out", layer])
        labels.append(f"{layer}_attn_out")
    stack = (torch.stack([take(part, pos, -2) for part in parts]) if parts
             else empty_stack(cache, pos))  # (parts, ..., C)
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input, pos_slice, None, True)
    return labelled(stack, labels, return_labels)


def head_output_weights(model: nn.Module, layer: int) -> Tensor:
    """W_O of block `layer` per head, (H, d, C): head h's rows of W_O = proj.weight.T."""
    attn = model.blocks[layer].attn
    return attn.proj.weight.T.reshape(attn.n_heads, attn.head_dim, -1)


def compute_head_results(cache: Any) -> None:
    """blocks.{l}.attn.hook_result (..., H, C) for every block whose run did not keep it."""
    model = glass_model(cache)
    require_sum_of_parts(model, "the head results", per_part=True)
    for l in range(model.config.n_layer):
        name = f"blocks.{l}.attn.hook_result"
        if name not in cache._tensors:
            z = cache["z", l]  # (..., H, d)
            w_o = head_output_weights(model, l).to(z.dtype)  # (H, d, C)
            cache._tensors[name] = torch.einsum("...hd,hdc->...hc", z, w_o).detach()


def stack_head_results(cache: Any, layer: Any, return_labels: bool, incl_remainder: bool,
                       pos_slice: Slicing, apply_ln: bool):
    model, pos, layer = glass_model(cache), as_index(pos_slice), layer_count(cache, layer)
    compute_head_results(cache)
    heads = [take(cache["result", l], pos, -3) for l in range(layer)]  # L x (..., H, C)
    labels = [f"L{l}H{h}" for l in range(layer) for h in range(model.config.n_head)]
    stack = (torch.cat(heads, dim=-2).movedim(-2, 0) if heads
             else empty_stack(cache, pos))  # (L * H, ..., C)
    if incl_remainder:
        # as TransformerLens: layer 0's "stream before it" is read as resid_post of layer -1
        stream = take(cache["resid_post", layer - 1], pos, -2)
        stack = torch.cat([stack, (stream - stack.sum(0))[None]])
        labels.append("remainder")
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, False, pos_slice, None, True)
    return labelled(stack, labels, return_labels)


def stack_activation(cache: Any, activation_name: str, layer: Any,
                     sublayer_type: str | None) -> Tensor:
    layer = layer_count(cache, layer)
    return torch.stack([cache[activation_name, l, sublayer_type] for l in range(layer)])


def neuron_output_weights(model: nn.Module, layer: int) -> Tensor:
    """W_out of block `layer`'s MLP, (F, C): what neuron n writes per unit of post[n]."""
    if not has_mlp(model):
        raise InputError("this model is attn_only: its blocks have no MLP neurons")
    return model.blocks[layer].ffn.proj.weight.T


def get_neuron_results(cache: Any, layer: Any, neuron_slice: Slicing, pos_slice: Slicing,
                       project_output_onto: Tensor | None) -> Tensor:
    model = glass_model(cache)
    n_layer = model.config.n_layer
    if not is_int(layer) or not 0 <= layer < n_layer:
        raise InputError(f"layer must be a block index in [0, {n_layer}), got {layer!r:.40}")
    require_sum_of_parts(model, "the neuron results", per_part=True)
    neurons = as_index(neuron_slice, "neuron_slice")
    acts = take(take(cache["post", layer, "mlp"], as_index(pos_slice), -2), neurons, -1)
    w_out = take(neuron_output_weights(model, layer), neurons, 0)  # (F', C)
    if project_output_onto is None:
        return acts[..., None] * w_out  # (..., F', C)
    projected = w_out @ direction(project_output_onto, w_out.shape[-1])  # (F', outs) or (F',)
    return acts * projected if project_output_onto.dim() == 1 else acts[..., None] * projected


def stack_neuron_results(cache: Any, layer: Any, pos_slice: Slicing, neuron_slice: Slicing,
                         return_labels: bool, incl_remainder: bool, apply_ln: bool,
                         project_output_onto: Tensor | None, mlp_input: bool):
    model, pos, layer = glass_model(cache), as_index(pos_slice), layer_count(cache, layer)
    neurons = as_index(neuron_slice, "neuron_slice")
    if isinstance(neurons, int):  # layers are joined along the neuron axis: keep it
        neurons = torch.tensor([neurons])
    width = neuron_output_weights(model, 0).shape[0]
    picked = take(torch.arange(width), neurons, 0).tolist()
    labels = [f"L{l}N{n}" for l in range(layer) for n in picked]
    per_layer = [get_neuron_results(cache, l, neurons, pos_slice, None) for l in range(layer)]
    stack = (torch.cat(per_layer, dim=-2).movedim(-2, 0) if per_layer
             else empty_stack(cache, pos))  # (L * F', ..., C)
    if incl_remainder:
        stream = cache["resid_mid", layer] if mlp_input else cache["resid_post", layer - 1]
        stack = torch.cat([stack, (take(stream, pos, -2) - stack.sum(0))[None]])
        labels.append("remainder")
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input, pos_slice, None, True)
    return labelled(projected(stack, project_output_onto), labels, return_labels)


def projected(stack: Tensor, onto: Tensor | None) -> Tensor:
    """stack (..., C) @ onto (C,) or (C, outs); None: the stack itself."""
    return stack if onto is None else stack @ direction(onto, stack.shape[-1])


def direction(onto: Any, width: int) -> Tensor:
    """`project_output_onto` as it must be: a float tensor (C,) or (C, outs)."""
    if not isinstance(onto, Tensor) or onto.dim() not in (1, 2) or onto.shape[0] != width \
            or not onto.is_floating_point():
        got = (f"{onto.dtype} of shape {tuple(onto.shape)}" if isinstance(onto, Tensor)
               else type(onto).__name__)
        raise InputError(f"project_output_onto must be a float tensor (d_model,) or "
                         f"(d_model, n) with d_model = {width}, got {got}")
    return onto


def target_norm(model: nn.Module, layer: int, mlp_input: bool) -> tuple[nn.Module, str]:
    """The norm that reads the stream into `layer` (n_layer: the final one) and its scale's name."""
    if layer == model.config.n_layer:
        return model.ln_f, "ln_final.hook_scale"
    which = "ln2" if mlp_input else "ln1"
    return getattr(model.blocks[layer], which), f"blocks.{layer}.{which}.hook_scale"


def apply_ln_to_stack(cache: Any, stack: Tensor, layer: Any, mlp_input: bool, pos_slice: Slicing,
                      batch_slice: Slicing, has_batch_dim: bool,
                      recompute_ln: bool = False) -> Tensor:
    model, layer = glass_model(cache), layer_count(cache, layer)
    width = model.config.n_embd
    if not isinstance(stack, Tensor) or stack.dim() < 2 or stack.shape[-1] != width:
        got = tuple(stack.shape) if isinstance(stack, Tensor) else type(stack).__name__
        raise InputError(f"a residual stack is a tensor (parts, ..., d_model = {width}), got "
                         f"{got}")
    batch = as_index(batch_slice, "batch_slice")
    if has_batch_dim:
        stack = take(stack, batch, 1)  # (parts, B', ...)
    norm, scale_name = target_norm(model, layer, mlp_input)
    if not isinstance(norm, LayerNorm | ManualLayerNorm | RMSNorm):
        return stack  # norm="none": the stream reaches the layer as it is
    require_sum_of_parts(model, "apply_ln_to_stack")
    if recompute_ln and layer == model.config.n_layer:
        return norm(stack)  # each part normalised by its own statistics (the logit lens)
    if isinstance(norm, LayerNorm | ManualLayerNorm):
        stack = stack - stack.mean(dim=-1, keepdim=True)
    scale = take(cache[scale_name], as_index(pos_slice), -2)  # (..., 1)
    if cache.has_batch_dim:
        scale = take(scale, batch, 0)
    try:
        return stack / scale
    except RuntimeError:  # a stack of other positions or prompts than the scale read here
        raise InputError(f"a residual stack of shape {tuple(stack.shape)} does not fit this "
                         f"cache's {scale_name} {tuple(scale.shape)} (after pos_slice and "
                         "batch_slice): slice the stack and pass the same pos_slice") from None


def token_ids(cache: Any, tokens: Any) -> Any:
    """Tokens as ids: a string is one token of the cache's model's tokenizer (a HookedGPT's
    to_single_token); a bare glassgpt GPT has none."""
    if not isinstance(tokens, str):
        return tokens
    to_single_token = getattr(cache.model, "to_single_token", None)
    if to_single_token is None:
        raise InputError(f"a glassgpt GPT has no tokenizer: pass token ids, not {tokens!r:.40} "
                         "(or run a HookedGPT, which has one)")
    return to_single_token(tokens)


def token_directions(model: nn.Module, tokens: Any) -> Tensor:
    """Token ids -> their unembedding directions, W_U[:, id]: (C,) for one, (*shape, C)."""
    ids = torch.as_tensor(tokens) if not isinstance(tokens, Tensor) else tokens
    vocab = model.config.vocab_size
    if ids.is_floating_point() or ids.dtype == torch.bool or ids.numel() == 0 \
            or not bool(((ids >= 0) & (ids < vocab)).all()):
        raise InputError(f"tokens must be token ids in [0, {vocab}), got {tokens!r:.60}")
    w_u_rows = model.lm_head.weight  # (V, C): row t is W_U[:, t]
    return w_u_rows[int(ids.item())] if ids.numel() == 1 else w_u_rows[ids.to(w_u_rows.device)]


def logit_attrs(cache: Any, stack: Tensor, tokens: Any, incorrect_tokens: Any,
                pos_slice: Slicing, batch_slice: Slicing, has_batch_dim: bool) -> Tensor:
    model = glass_model(cache)
    tokens = token_ids(cache, tokens)
    incorrect_tokens = token_ids(cache, incorrect_tokens)
    directions = token_directions(model, tokens)
    if incorrect_tokens is not None:
        if torch.as_tensor(tokens).shape != torch.as_tensor(incorrect_tokens).shape:
            raise InputError(f"tokens and incorrect_tokens must have one shape, got "
                             f"{tuple(torch.as_tensor(tokens).shape)} and "
                             f"{tuple(torch.as_tensor(incorrect_tokens).shape)}")
        directions = directions - token_directions(model, incorrect_tokens)
    scaled = apply_ln_to_stack(cache, stack, None, False, pos_slice, batch_slice, has_batch_dim)
    if has_batch_dim and not isinstance(as_index(batch_slice), int) and scaled.dim() == 4 \
            and directions.dim() == 2 and directions.shape[0] == scaled.shape[1]:
        directions = directions[:, None]  # one token per prompt: the same at every position
    return (scaled * directions).sum(-1)  # (parts, ...)


def accumulated_bias(model: nn.Module, layer: int, mlp_input: bool = False,
                     include_mlp_biases: bool = True) -> Tensor:
    """The output biases the stream into `layer` holds, (C,): b_O of each block before it (and
    of `layer` itself with `mlp_input`), and b_out of each MLP before it."""
    blocks = model.blocks
    total = blocks[0].attn.proj.weight.new_zeros(model.config.n_embd)
    biases = [blocks[l].attn.proj.bias for l in range(layer)]
    if include_mlp_biases and has_mlp(model):
        biases += [blocks[l].ffn.proj.bias for l in range(layer)]
    if mlp_input:
        biases.append(blocks[layer].attn.proj.bias)
    for bias in biases:
        if bias is not None:
            total = total + bias
    return total


def get_full_resid_decomposition(cache: Any, layer: Any, mlp_input: bool, expand_neurons: bool,
                                 apply_ln: bool, pos_slice: Slicing, return_labels: bool,
                                 project_output_onto: Tensor | None):
    model, pos, layer = glass_model(cache), as_index(pos_slice), layer_count(cache, layer)
    if mlp_input and layer == model.config.n_layer:
        raise InputError("mlp_input reads the stream into a block's MLP; the final layer has none")
    require_sum_of_parts(model, "get_full_resid_decomposition", per_part=True)
    stack, labels = stack_head_results(cache, layer + mlp_input, True, False, pos_slice, False)
    parts = [stack]
    if has_mlp(model) and layer > 0:
        mlps, mlp_labels = (
            stack_neuron_results(cache, layer, pos_slice, None, True, False, False, None,
                                 mlp_input) if expand_neurons
            else decompose_resid(cache, layer, mlp_input, "mlp", False, pos_slice, False, True))
        parts.append(mlps)
        labels += mlp_labels
    if "hook_embed" in cache:
        parts.append(take(cache["hook_embed"], pos, -2)[None])
        labels.append("embed")
    if positions_in_stream(cache, model):
        parts.append(take(cache["hook_pos_embed"], pos, -2)[None])
        labels.append("pos_embed")
    bias = accumulated_bias(model, layer, mlp_input, include_mlp_biases=expand_neurons)
    parts.append(bias.to(stack.dtype).expand((1, *stack.shape[1:])))
    labels.append("bias")
    stack = torch.cat(parts)  # (parts, ..., C)
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input, pos_slice, None, True)
    return labelled(projected(stack, project_output_onto), labels, return_labels)
