"""TransformerLens's checkpoint format, both ways: a glassgpt model as what
`HookedTransformer.state_dict()` and its `HookedTransformerConfig` hold, and such a checkpoint
(ARENA's pretrained models, saved by TransformerLens 2.x/3.x) as a glassgpt model.

    state, cfg = lens_state_dict(model), lens_config_dict(model)
    model = model_from_lens_checkpoint(cfg, read_lens_state("attn_only_2L_half.pth"))
    export_lens_run("runs/x", "out/")  # `glassgpt convert RUN --to-lens OUT`

Here the tensors move; the config (`lens_config_dict`, `gpt_config_from_lens`) is
glassgpt.formats.transformer_lens_config's, the files (`read_lens_state`, `export_lens_run`, ...)
glassgpt.formats.transformer_lens_files'.

The keys ("property format"; L layers, H heads, H_kv key/value heads, d head width, C width,
F MLP width, V vocabulary), each TransformerLens's matrix multiplied from the left, x @ W:

    embed.W_E (V, C)   pos_embed.W_pos (n_ctx, C): learned and shortformer positions only
    blocks.{l}.ln1.w, ln1.b (C,): LayerNorm both, RMSNorm w, no norm neither (ln2 likewise,
        absent when attn_only; ln_final.w, ln_final.b after the last block)
    blocks.{l}.attn.W_Q (H, C, d)  b_Q (H, d)  W_O (H, d, C)  b_O (C,)
    blocks.{l}.attn.W_K, W_V (H, C, d)  b_K, b_V (H, d); with grouped heads _W_K, _W_V
        (H_kv, C, d) and _b_K, _b_V (H_kv, d), TransformerLens's names for the stored ones
    blocks.{l}.attn.mask (n_ctx, n_ctx) bool, attn.IGNORE (): buffers, written as TL wrote them
    blocks.{l}.mlp.W_in (C, F)  b_in (F,)  W_out (F, C)  b_out (C,); gated: W_gate (C, F) too
    unembed.W_U (C, V)  unembed.b_U (V,)

A bias glassgpt leaves out is written as zeros. Rotary models carry no sin/cos tables (TL
recomputes them; its 4.x converter refuses them). TL's gated MLP adds b_in after the gate,
act(x W_gate) * (x W_in) + b_in, where glassgpt has no bias: it is zero both ways. What TL's
checkpoint cannot hold is refused by name (`check_exportable`), and so is a config field
glassgpt cannot compute.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.formats.transformer_lens_config import check_exportable, gpt_config_from_lens
from glassgpt.formats.translation import MAX_ROTARY_CONTEXT
from glassgpt.model import GPT
from glassgpt.rundir.weights import initialisation_skipped, model_holding
from glassgpt.storage.tensorfile import check_finite

# buffers HookedTransformer saved beside its weights, recomputed from the config
BUFFER_SUFFIXES = (".mask", ".IGNORE", ".rotary_sin", ".rotary_cos")


# --- glassgpt's weights in TransformerLens's layout -------------------------------------------

def qkv_rows(attn: nn.Module, which: str) -> slice:
    """The rows of `attn.qkv` that make the queries, the keys or the values."""
    q_width, kv_width = attn.q_width, attn.n_kv_head * attn.head_dim
    starts = {"q": (0, q_width), "k": (q_width, kv_width), "v": (q_width + kv_width, kv_width)}
    start, width = starts[which]
    return slice(start, start + width)


def output_weight(attn: nn.Module) -> Tensor:
    """W_O of one attention, (H, d, C): `proj.weight` (C, H d) transposed, split by head."""
    return attn.proj.weight.T.reshape(attn.n_heads, attn.head_dim, attn.d_model)


def bias_or_zeros(linear: nn.Linear) -> Tensor:
    if linear.bias is not None:
        return linear.bias
    return linear.weight.new_zeros(linear.weight.shape[0])


def per_head(attn: nn.Module, which: str) -> tuple[Tensor, Tensor]:
    """W (heads, C, d) and b (heads, d) of the queries, keys or values, as stored: grouped
    K/V heads are not repeated here (TransformerLens's _W_K)."""
    rows = attn.qkv.weight[qkv_rows(attn, which)]  # (heads * d, C)
    weight = rows.reshape(-1, attn.head_dim, attn.d_model).transpose(1, 2)  # (heads, C, d)
    bias = attn.qkv.bias
    if bias is None:
        return weight, weight.new_zeros(weight.shape[0], attn.head_dim)
    return weight, bias[qkv_rows(attn, which)].reshape(-1, attn.head_dim)  # (heads, d)


def attention_tensors(attn: nn.Module, n_ctx: int) -> dict[str, Tensor]:
    kv = "_" if attn.n_kv_head != attn.n_heads else ""  # TL's stored name of grouped K/V
    (w_q, b_q), (w_k, b_k), (w_v, b_v) = (per_head(attn, which) for which in "qkv")
    device = w_q.device
    return {"W_Q": w_q, f"{kv}W_K": w_k, f"{kv}W_V": w_v, "W_O": output_weight(attn),
            "b_Q": b_q, f"{kv}b_K": b_k, f"{kv}b_V": b_v, "b_O": bias_or_zeros(attn.proj),
            "mask": torch.ones(n_ctx, n_ctx, dtype=torch.bool, device=device).tril(),
            "IGNORE": torch.tensor(-math.inf, device=device)}


def mlp_tensors(mlp: nn.Module) -> dict[str, Tensor]:
    out = {"W_out": mlp.proj.weight.T, "b_out": bias_or_zeros(mlp.proj)}  # (F, C), (C,)
    if not hasattr(mlp, "gate"):
        return {"W_in": mlp.fc.weight.T, "b_in": bias_or_zeros(mlp.fc), **out}  # (C, F), (F,)
    for linear in (mlp.gate, mlp.up):  # TL's gated MLP adds b_in after the gate, nothing before
        if linear.bias is not None and bool(linear.bias.any()):
            raise ConfigError("this gated MLP has biases on its gate and up matrices; "
                              "TransformerLens's gated MLP has none there (its b_in is added "
                              "after the gate), so it cannot be written in its checkpoint")
    return {"W_in": mlp.up.weight.T, "W_gate": mlp.gate.weight.T,
            "b_in": mlp.up.weight.new_zeros(mlp.up.weight.shape[0]), **out}


def norm_tensors(norm: nn.Module) -> dict[str, Tensor]:
    """LayerNorm: w and b (zeros without a shift); RMSNorm: w; no norm (Identity): nothing."""
    if isinstance(norm, nn.Identity):
        return {}
    if not hasattr(norm, "bias"):  # RMSNorm
        return {"w": norm.weight}
    return {"w": norm.weight, "b": bias_or_zeros(norm)}


def prefixed(prefix: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {f"{prefix}.{name}": tensor for name, tensor in tensors.items()}


def lens_state_dict(model: GPT) -> dict[str, Tensor]:
    """glassgpt `model`'s weights under HookedTransformer.state_dict()'s keys and shapes (new
    tensors, contiguous: safetensors and torch.save take them as they are)."""
    check_exportable(model.config)
    state = {"embed.W_E": model.tok_emb.weight}
    if model.pos_emb is not None:
        state["pos_embed.W_pos"] = model.pos_emb.weight
    for layer, block in enumerate(model.blocks):
        state |= prefixed(f"blocks.{layer}.ln1", norm_tensors(block.ln1))
        if block.ffn is not None:
            state |= prefixed(f"blocks.{layer}.ln2", norm_tensors(block.ln2))
        state |= prefixed(f"blocks.{layer}.attn",
                          attention_tensors(block.attn, model.config.block_size))
        if block.ffn is not None:
            state |= prefixed(f"blocks.{layer}.mlp", mlp_tensors(block.ffn))
    state |= prefixed("ln_final", norm_tensors(model.ln_f))
    state |= {"unembed.W_U": model.lm_head.weight.T, "unembed.b_U": bias_or_zeros(model.lm_head)}
    return {name: tensor.detach().clone(memory_format=torch.contiguous_format)
            for name, tensor in state.items()}


# --- TransformerLens -> glassgpt ----------------------------------------------------------------

def expected_lens_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the weights a checkpoint of `config` holds (buffers aside): the export's
    own layout, read off a model on the meta device (nothing allocated). Biases are written
    whether glassgpt has them or not, so the model is built without."""
    config = dataclasses.replace(config, bias=False, qkv_bias=False)
    with torch.device("meta"), initialisation_skipped():
        state = lens_state_dict(GPT(config))
    return {name: tuple(t.shape) for name, t in state.items()
            if not name.endswith(BUFFER_SUFFIXES)}


def check_lens_keys(state: dict[str, Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """CheckpointError naming a missing, unexpected or misshapen tensor."""
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    if missing or unexpected:
        raise CheckpointError(f"the TransformerLens checkpoint does not match its config: "
                              f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, shape in expected.items():
        tensor = state[name]
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise CheckpointError(f"the TransformerLens checkpoint's {name} is not a floating "
                                  f"point tensor ({type(tensor).__name__})")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"the TransformerLens checkpoint's {name} has shape "
                                  f"{tuple(tensor.shape)}, its config needs {shape}")


def layers_held(state: dict[str, Tensor]) -> set[int]:
    """The layer numbers l of the checkpoint's blocks.{l}.* keys."""
    held = set()
    for name in state:
        kind, _, rest = name.partition(".")
        number = rest.partition(".")[0]
        if kind == "blocks" and number.isdecimal() and len(number) <= 9:  # int() stays cheap
            held.add(int(number))
    return held


def check_sizes_against_state(config: GPTConfig, state: dict[str, Tensor]) -> None:
    """The config's layers, vocabulary, width and context against the tensors the checkpoint
    holds, before any model is built, even on the meta device: a config asking for 10**6
    layers over the weights of two is named at once. A rotary model has no position table to
    bound its context, so n_ctx is bounded as for a Hugging Face config.json."""
    n_layer, held = config.n_layer, layers_held(state)
    if held != set(range(n_layer)):
        holds = f"blocks {sorted(held)[:4]}{' ...' if len(held) > 4 else ''}" if held else \
            "no blocks.* tensors"
        raise CheckpointError(f"the TransformerLens config asks for n_layers={n_layer:,}, and "
                              f"the checkpoint holds {len(held):,} layers ({holds})")
    tables = {"embed.W_E": ((config.vocab_size, config.n_embd), "d_vocab, d_model")}
    if config.position in ("learned", "shortformer"):
        tables["pos_embed.W_pos"] = ((config.block_size, config.n_embd), "n_ctx, d_model")
    elif config.block_size > MAX_ROTARY_CONTEXT:
        raise ConfigError(f"n_ctx={config.block_size:,} is more than glassgpt holds (at most "
                          f"{MAX_ROTARY_CONTEXT:,} positions)")
    for name, (shape, fields) in tables.items():
        tensor = state.get(name)
        if not isinstance(tensor, Tensor):
            raise CheckpointError(f"the TransformerLens checkpoint has no {name} tensor")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"the TransformerLens checkpoint's {name} has shape "
                                  f"{tuple(tensor.shape)}, its config's {fields} need {shape}")


def completed(state: dict[str, Tensor], config: GPTConfig, unit_norms: bool
              ) -> dict[str, Tensor]:
    """The checkpoint's weights (buffers dropped), with what TransformerLens may leave out
    filled in: b_U (its minGPT and legacy loaders write none) and, for "LNPre"/"RMSPre", the
    norms' unit gains and zero shifts, which compute exactly what a bare norm does."""
    weights = {name: tensor for name, tensor in state.items()
               if not name.endswith(BUFFER_SUFFIXES)}
    expected = expected_lens_shapes(config)
    like = weights["embed.W_E"]  # there: check_sizes_against_state
    fills = {"unembed.b_U": 0.0}
    if unit_norms:
        fills |= {name: float(name.endswith(".w")) for name in expected
                  if name.startswith(("blocks.", "ln_final")) and ".ln" in f".{name}"
                  and name.endswith((".w", ".b"))}
    for name, value in fills.items():
        if name not in weights:
            weights[name] = torch.full(expected[name], value, dtype=like.dtype)
        elif name != "unembed.b_U":
            check_unit_norm(name, weights[name], value)
    check_lens_keys(weights, expected)
    return weights


def check_unit_norm(name: str, tensor: object, value: float) -> None:
    """A "LNPre"/"RMSPre" checkpoint that still holds a norm's gain or shift: TransformerLens's
    parameter-free norm never reads it, so only the unit gain / zero shift it stands for is
    taken; any other value would be computed here and ignored there."""
    if isinstance(tensor, Tensor) and tensor.is_floating_point() \
            and bool((tensor == value).all()):
        return
    raise CheckpointError(f"the TransformerLens config's norms are LNPre/RMSPre (no gain, no "
                          f"shift), yet the checkpoint's {name} is not all {value:g}: fold it, "
                          f"or give the config's normalization_type as LN/RMS")


def any_nonzero(weights: dict[str, Tensor], suffixes: tuple[str, ...]) -> bool:
    return any(bool(t.any()) for name, t in weights.items() if name.endswith(suffixes))


def glass_attention(weights: dict[str, Tensor], prefix: str, config: GPTConfig
                    ) -> dict[str, Tensor]:
    kv = "_" if (config.n_kv_head or config.n_head) != config.n_head else ""
    names = (("W_Q", "b_Q"), (f"{kv}W_K", f"{kv}b_K"), (f"{kv}W_V", f"{kv}b_V"))
    rows = [weights[f"{prefix}.{w}"].transpose(1, 2).flatten(0, 1) for w, _ in names]
    tensors = {"qkv.weight": torch.cat(rows),  # (H d + 2 H_kv d, C): rows [Q, K, V]
               "proj.weight": weights[f"{prefix}.W_O"].flatten(0, 1).T}  # (C, H d)
    if config.has_qkv_bias:
        tensors["qkv.bias"] = torch.cat([weights[f"{prefix}.{b}"].flatten() for _, b in names])
    if config.bias:
        tensors["proj.bias"] = weights[f"{prefix}.b_O"]
    return tensors


def glass_mlp(weights: dict[str, Tensor], prefix: str, config: GPTConfig) -> dict[str, Tensor]:
    get = {name: weights[f"{prefix}.{name}"] for name in ("W_in", "b_in", "W_out", "b_out")}
    tensors = {"proj.weight": get["W_out"].T}
    gated = config.activation in ("swiglu", "geglu")
    if gated:
        if bool(get["b_in"].any()):
            raise CheckpointError(f"{prefix}.b_in is not zero: TransformerLens's gated MLP adds "
                                  f"it after the gate, where glassgpt's has no bias")
        tensors |= {"gate.weight": weights[f"{prefix}.W_gate"].T, "up.weight": get["W_in"].T}
    else:
        tensors["fc.weight"] = get["W_in"].T
    if config.bias:
        zeros = get["b_in"].new_zeros(get["b_in"].shape)
        tensors |= ({"gate.bias": zeros, "up.bias": zeros} if gated else {"fc.bias": get["b_in"]})
        tensors["proj.bias"] = get["b_out"]
    return tensors


def glass_norm(weights: dict[str, Tensor], prefix: str, config: GPTConfig) -> dict[str, Tensor]:
    if config.norm == "none":
        return {}
    tensors = {"weight": weights[f"{prefix}.w"]}
    if config.norm == "layernorm" and config.bias:
        tensors["bias"] = weights[f"{prefix}.b"]
    return tensors


def glass_tensors(weights: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """The checkpoint's weights under glassgpt's names and layout (GPT.state_dict())."""
    tensors = {"tok_emb.weight": weights["embed.W_E"]}
    if "pos_embed.W_pos" in weights:
        tensors["pos_emb.weight"] = weights["pos_embed.W_pos"]
    parts = [("ln1", "ln1", glass_norm), ("attn", "attn", glass_attention)]
    if not config.attn_only:
        parts += [("ln2", "ln2", glass_norm), ("ffn", "mlp", glass_mlp)]
    for layer in range(config.n_layer):
        for glass, lens, convert in parts:
            tensors |= prefixed(f"blocks.{layer}.{glass}",
                                convert(weights, f"blocks.{layer}.{lens}", config))
    tensors |= prefixed("ln_f", glass_norm(weights, "ln_final", config))
    if not config.tie_weights:
        tensors["lm_head.weight"] = weights["unembed.W_U"].T  # (V, C)
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def model_from_lens_checkpoint(cfg: dict[str, Any], state: dict[str, Tensor]) -> GPT:
    """A glassgpt GPT computing what HookedTransformer(HookedTransformerConfig(**cfg)) with
    `state` loaded computes (eval mode). The biases are glassgpt's `bias` / `qkv_bias` when
    any is nonzero (else none); the head is tied when W_U is W_E transposed bit for bit."""
    settings, unit_norms = gpt_config_from_lens(cfg)
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(f"a TransformerLens state dict maps names to tensors, got "
                              f"{type(state).__name__}")
    config = GPTConfig(**settings)  # its own checks: widths, heads, ...
    check_sizes_against_state(config, state)
    weights = completed(state, config, unit_norms)
    dtype = weights["embed.W_E"].dtype
    weights = {name: tensor.to(dtype) for name, tensor in weights.items()}
    check_finite(weights, "the TransformerLens checkpoint", CheckpointError)
    if bool(weights["unembed.b_U"].any()):
        raise CheckpointError("unembed.b_U is not zero, and a glassgpt LM head has no bias: "
                              "these logits cannot be computed exactly")
    settings |= dict(
        qkv_bias=any_nonzero(weights, (".b_Q", ".b_K", ".b_V")),
        bias=any_nonzero(weights, (".b_O", ".b_in", ".b_out", "ln1.b", "ln2.b", "ln_final.b")),
        tie_weights=torch.equal(weights["unembed.W_U"].T, weights["embed.W_E"]))
    config = GPTConfig(**settings)
    tensors = glass_tensors(weights, config)
    return model_holding(config, tensors, "the TransformerLens checkpoint").eval()
