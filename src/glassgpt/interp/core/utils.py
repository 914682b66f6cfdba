"""TransformerLens's `utils` helpers that interpretability code calls by name: `get_act_name`
(a short name such as "k6" or ("pattern", 0) -> the hook point's full name) and `to_numpy`.

glassgpt's hook names are TransformerLens's, so a short name resolves to the same full name
here as there: `get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"`,
`get_act_name("scale4ln1") == "blocks.4.ln1.hook_scale"`, `get_act_name("embed") == "hook_embed"`.
A short name this module does not know is an InputError listing the ones it does.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

import numpy as np
import torch

from glassgpt.errors import InputError

# The activations of each part of a block; a name here fixes its layer type, whatever was given.
ATTENTION_NAMES = ("q", "k", "v", "z", "rot_q", "rot_k", "result", "pattern", "attn_scores")
MLP_NAMES = ("pre", "post", "mid", "pre_linear")
NORM_NAMES = ("scale", "normalized")  # without a layer: the final norm's
# The block's own points (TransformerLens's split inputs q_input, k_input, v_input are the
# block's, blocks.{l}.hook_q_input, not the attention's).
STREAM_NAMES = ("embed", "pos_embed", "tokens", "resid_pre", "resid_mid", "resid_post",
                "attn_out", "mlp_out", "attn_in", "mlp_in", "q_input", "k_input", "v_input",
                "unembed")
SHORT_NAMES = ATTENTION_NAMES + MLP_NAMES + NORM_NAMES + STREAM_NAMES

# Other spellings TransformerLens takes for the same activations and layer types.
NAME_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q",
                "value": "v", "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}
LAYER_TYPE_ALIASES = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "",
                      "blocks": ""}
LAYER_TYPES = ("", "attn", "mlp", "ln1", "ln2", "ln_final")

# "k6", "scale4ln1", "resid_pre5": a short name with its layer (and layer type) glued on.
GLUED = re.compile(r"([a-z_]*[a-z])(\d+)([a-z_0-9]*)")


def get_act_name(name: str, layer: int | str | None = None,
                 layer_type: str | None = None) -> str:
    """A short activation name (with a layer and a layer type where it has them) -> the full
    hook name, as TransformerLens's `utils.get_act_name` resolves it.

    A full name ("blocks.0.attn.hook_q", "hook_embed") given alone comes back unchanged. The
    layer may be glued on ("k6", "pattern3", "scale4ln1"); attention and MLP names find their
    layer type themselves; "scale" and "normalized" without a layer are the final norm's.
    """
    if not isinstance(name, str):
        raise InputError(f"an activation name is a string, got {type(name).__name__}")
    if layer is None and layer_type is None and ("." in name or name.startswith("hook_")):
        return name
    glued = GLUED.fullmatch(name)
    if glued is not None:  # as TransformerLens: the glued layer and type win over the arguments
        name, layer, layer_type = glued.group(1), glued.group(2), glued.group(3)
    name = NAME_ALIASES.get(name, name)
    if name not in SHORT_NAMES:
        raise InputError(f"unknown activation name {name!r}: a hook point's full name, or one "
                         f"of {', '.join(SHORT_NAMES)} (aliases {', '.join(NAME_ALIASES)})")
    layer = block_index(layer)
    layer_type = part_of(name, layer_type)
    if layer is None and name in NORM_NAMES and layer_type in ("", "ln_final"):
        return f"ln_final.hook_{name}"
    prefix = "" if layer is None else f"blocks.{layer}."
    part = f"{layer_type}." if layer_type and layer_type != "ln_final" else ""
    return f"{prefix}{part}hook_{name}"


def block_index(layer: Any) -> int | None:
    """A layer as given (an int, or digits glued to a name) -> the block index, or None."""
    if layer is None:
        return None
    if isinstance(layer, str) and layer.isdigit():
        return int(layer)
    if isinstance(layer, torch.Tensor) and layer.dim() == 0 and not layer.is_floating_point():
        layer = layer.item()
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise InputError(f"a layer is a block index (an int), got {layer!r:.40}")
    if layer < 0:
        raise InputError(f"layer {layer}: a negative layer counts from the end only where the "
                         "number of layers is known (cache[name, -1]); get_act_name needs >= 0")
    return int(layer)


def part_of(name: str, layer_type: str | None) -> str:
    """The part of the block a name lives in ("attn", "mlp", "ln1", ...; "" for the block's
    own stream): fixed by attention and MLP names, else the layer type given or its alias."""
    if name in ATTENTION_NAMES:
        return "attn"
    if name in MLP_NAMES:
        return "mlp"
    if layer_type is None:
        return ""
    if not isinstance(layer_type, str):
        raise InputError(f"a layer type is a string, got {type(layer_type).__name__}")
    layer_type = LAYER_TYPE_ALIASES.get(layer_type, layer_type)
    if layer_type not in LAYER_TYPES:
        raise InputError(f"unknown layer type {layer_type!r}: one of "
                         f"{', '.join(t for t in LAYER_TYPES if t)} "
                         f"(aliases {', '.join(LAYER_TYPE_ALIASES)})")
    return layer_type


def to_numpy(values: Any) -> np.ndarray:
    """A tensor (detached, moved to the CPU, bfloat16 widened: NumPy has none), a list, a tuple,
    a scalar or an array -> a NumPy array."""
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dtype == torch.bfloat16:
            values = values.float()
        return values.numpy()
    if isinstance(values, list | tuple | int | float | bool | str):
        return np.array(values)
    raise InputError(f"to_numpy takes a tensor, an array, a list, a tuple or a scalar, got "
                     f"{type(values).__name__}")
