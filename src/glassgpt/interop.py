"""Hugging Face GPT-2 <-> glassgpt: the same weights, read and written both ways.

A `transformers` `GPT2LMHeadModel` is a Pre-LN glassgpt `GPT` with biases; only the names and one
layout differ:
  * HF keeps its projections in `Conv1D` modules, which store the weight as (in, out) and compute
    x @ W + b; `nn.Linear` stores (out, in) and computes x @ W^T + b. Every Conv1D weight is
    therefore transposed on the way through, and nothing else is.
  * `c_attn` yields Q, K, V in the same order, each with the heads side by side, exactly like our
    `qkv`, so it needs no reshuffling beyond that transpose.
  * Checkpoints written by older `transformers` also hold `attn.bias` and `attn.masked_bias`: the
    causal mask and its fill value, stored as buffers. They are not weights and are skipped.

Reading a save_pretrained directory or a hub model is glassgpt.hf_files' job (glassgpt reads
them itself: safetensors only, nothing unpickled, everything bounded); here the tensors it found
are checked against the config, name by name and shape by shape, before any is read.

`transformers` is the optional extra `hf` and is imported only inside the functions that need it
(export), so the rest of glassgpt never pays for it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from glassgpt import files
from glassgpt.checkpoint import expected_shapes
from glassgpt.config import GPTConfig
from glassgpt.distributed import unwrap_model
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.hf_files import INSTALL_HINT as INSTALL_HINT
from glassgpt.hf_files import (
    MASK_BUFFER_SUFFIXES,
    HFDirectory,
    StoredWeights,
    check_replaceable_export,
    fsync_tree,
    move_into_place,
    open_hf_source,
    usual_permissions,
)
from glassgpt.hf_files import MissingExtraError as MissingExtraError
from glassgpt.hf_files import load_hf_tokenizer as load_hf_tokenizer
from glassgpt.model import GPT
from glassgpt.tensorfile import check_each_shape, check_finite

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

# HF activation names that compute the same function as one of ours. "gelu_new" is GPT-2's own
# (tanh approximation); "gelu_fast" is left out because it rounds sqrt(2/pi) to 10 digits.
ACTIVATION_FROM_HF = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "relu": "relu",
}
ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}

# glassgpt name -> (HF name, stored as a Conv1D (in, out) matrix). "{i}" is the layer index.
_EMBEDDING_NAMES = {
    "tok_emb.weight": ("transformer.wte.weight", False),
    "pos_emb.weight": ("transformer.wpe.weight", False),
    "ln_f.weight": ("transformer.ln_f.weight", False),
    "ln_f.bias": ("transformer.ln_f.bias", False),
}
_LAYER_NAMES = {
    "blocks.{i}.ln1.weight": ("transformer.h.{i}.ln_1.weight", False),
    "blocks.{i}.ln1.bias": ("transformer.h.{i}.ln_1.bias", False),
    "blocks.{i}.attn.qkv.weight": ("transformer.h.{i}.attn.c_attn.weight", True),
    "blocks.{i}.attn.qkv.bias": ("transformer.h.{i}.attn.c_attn.bias", False),
    "blocks.{i}.attn.proj.weight": ("transformer.h.{i}.attn.c_proj.weight", True),
    "blocks.{i}.attn.proj.bias": ("transformer.h.{i}.attn.c_proj.bias", False),
    "blocks.{i}.ln2.weight": ("transformer.h.{i}.ln_2.weight", False),
    "blocks.{i}.ln2.bias": ("transformer.h.{i}.ln_2.bias", False),
    "blocks.{i}.ffn.fc.weight": ("transformer.h.{i}.mlp.c_fc.weight", True),
    "blocks.{i}.ffn.fc.bias": ("transformer.h.{i}.mlp.c_fc.bias", False),
    "blocks.{i}.ffn.proj.weight": ("transformer.h.{i}.mlp.c_proj.weight", True),
    "blocks.{i}.ffn.proj.bias": ("transformer.h.{i}.mlp.c_proj.bias", False),
}
def _transformers() -> Any:
    """The `transformers` module, or a MissingExtraError that says how to install it."""
    try:
        import transformers
    except ImportError as error:
        raise MissingExtraError(f"Hugging Face interop needs the optional extra `hf`: run "
                                f"{INSTALL_HINT} ({error})") from error
    return transformers


def weight_names(n_layer: int, tie_weights: bool) -> Iterator[tuple[str, str, bool]]:
    """Every (glassgpt name, HF name, is_conv1d) of a model: the one table both directions use.

    A tied head has no weight of its own, so `lm_head.weight` appears only when untied.
    """
    for ours, (theirs, conv1d) in _EMBEDDING_NAMES.items():
        yield ours, theirs, conv1d
    for i in range(n_layer):
        for ours, (theirs, conv1d) in _LAYER_NAMES.items():
            yield ours.format(i=i), theirs.format(i=i), conv1d
    if not tie_weights:
        yield "lm_head.weight", "lm_head.weight", False


# --- configs --------------------------------------------------------------------------------


def config_from_hf(hf_config: GPT2Config, dropout: float | None = None) -> GPTConfig:
    """The GPTConfig of a model that computes what `hf_config` describes.

    `dropout` replaces HF's three dropout rates (embeddings, residuals, attention), which glassgpt
    keeps as one; without it they must agree. Settings with no glassgpt equivalent are a
    ConfigError naming them.
    """
    model_type = getattr(hf_config, "model_type", "gpt2")
    if model_type != "gpt2":
        raise ConfigError(f"only GPT-2 models can be imported, this one has "
                          f"model_type={model_type!r}")
    _reject_unmirrored_hf_settings(hf_config)
    activation = hf_config.activation_function
    if activation not in ACTIVATION_FROM_HF:
        raise ConfigError(f"activation_function={activation!r} has no glassgpt equivalent; "
                          f"supported: {sorted(ACTIVATION_FROM_HF)}")
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        block_size=hf_config.n_positions,
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        n_embd=hf_config.n_embd,
        dropout=_single_dropout(hf_config) if dropout is None else dropout,
        bias=True,
        activation=ACTIVATION_FROM_HF[activation],
        pre_ln=True,
        tie_weights=bool(getattr(hf_config, "tie_word_embeddings", True)),
        ln_eps=float(hf_config.layer_norm_epsilon),
    )


def _reject_unmirrored_hf_settings(hf_config: GPT2Config) -> None:
    """ConfigError for HF GPT-2 options that change the computation in a way glassgpt cannot."""
    C = hf_config.n_embd
    n_inner = getattr(hf_config, "n_inner", None)
    if n_inner is not None and n_inner != 4 * C:
        raise ConfigError(f"n_inner={n_inner} is not supported: glassgpt's MLP is 4 x n_embd "
                          f"= {4 * C} wide")
    if not getattr(hf_config, "scale_attn_weights", True):
        raise ConfigError("scale_attn_weights=False is not supported: glassgpt always scales "
                          "attention scores by 1/sqrt(head_dim)")
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
        raise ConfigError("scale_attn_by_inverse_layer_idx=True is not supported: glassgpt "
                          "scales every layer's attention alike")
    if getattr(hf_config, "add_cross_attention", False):
        raise ConfigError("add_cross_attention=True is not supported: glassgpt is decoder-only")
    # reorder_and_upcast_attn is accepted: it changes rounding under mixed precision, not the math.


def _single_dropout(hf_config: GPT2Config) -> float:
    rates = {name: float(getattr(hf_config, name)) for name in
             ("embd_pdrop", "resid_pdrop", "attn_pdrop")}
    if len(set(rates.values())) > 1:
        raise ConfigError(f"glassgpt has one dropout rate, this model has {rates}; "
                          f"choose one with dropout=... (--dropout on the command line)")
    return next(iter(rates.values()))


def hf_config_from_glassgpt(config: GPTConfig, bos_token_id: int | None = None,
                            eos_token_id: int | None = None) -> GPT2Config:
    """The `transformers.GPT2Config` of `config`; a ConfigError names any setting GPT-2 lacks."""
    if not config.pre_ln:
        raise ConfigError("pre_ln=False (Post-LN) cannot be exported: GPT-2 normalises before "
                          "attention and MLP (Pre-LN)")
    if not config.bias:
        raise ConfigError("bias=False cannot be exported: GPT-2 has biases in every linear "
                          "layer and LayerNorm")
    if config.activation not in ACTIVATION_TO_HF:
        raise ConfigError(f"activation={config.activation!r} cannot be exported; GPT-2 "
                          f"supports {sorted(ACTIVATION_TO_HF)}")
    for name, token_id in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if token_id is not None and not 0 <= token_id < config.vocab_size:
            raise ConfigError(f"{name}={token_id} is outside the vocabulary "
                              f"[0, {config.vocab_size})")
    return _transformers().GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_inner=None,  # 4 * n_embd, like ours
        activation_function=ACTIVATION_TO_HF[config.activation],
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=config.ln_eps,
        tie_word_embeddings=config.tie_weights,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


# --- weights --------------------------------------------------------------------------------


def from_hf(source: GPT2LMHeadModel | HFDirectory | str | os.PathLike[str],
            dropout: float | None = None) -> GPT:
    """A glassgpt GPT holding the weights of a HF GPT-2: a model, a local directory or a hub name.

    A directory (or a hub name, downloaded into the Hugging Face cache) is read by glassgpt,
    never by `transformers` (see glassgpt.hf_files): weights from local `.safetensors` files
    only, checked against config.json before any tensor is allocated; a pickled
    `pytorch_model.bin` is never opened. The result has the dtype and device of the HF weights
    and starts in eval mode.
    """
    if isinstance(source, str | os.PathLike):
        source = open_hf_source(source)
    if isinstance(source, HFDirectory):
        config = config_from_hf(source.settings(), dropout=dropout)
        with source.weights() as stored:
            return _model_from_weights(config, _read_checked(config, stored))
    config = config_from_hf(source.config, dropout=dropout)
    hf_weights = _without_mask_buffers(source.state_dict())
    _check_same_names({theirs for _, theirs, _ in weight_names(config.n_layer,
                                                                config.tie_weights)},
                      set(hf_weights), "HF model")
    check_finite(hf_weights, "the HF model", CheckpointError)
    return _model_from_weights(config, hf_weights)


def _read_checked(config: GPTConfig, stored: StoredWeights) -> dict[str, Tensor]:
    """The stored tensors `config` needs, under HF names, after checking names and shapes.

    The number of layers is bounded by the tensors first: a config.json asking for 100,000
    layers over the weights of two is named at once, never built.
    """
    found = stored.shapes
    wte = "transformer.wte.weight"
    head_for_wte = config.tie_weights and wte not in found and "lm_head.weight" in found
    if head_for_wte:  # a tied matrix saved once, under the head's name
        found[wte] = found.pop("lm_head.weight")
    missing = []
    for _, theirs, _ in weight_names(config.n_layer, config.tie_weights):
        if theirs not in found:
            missing.append(theirs)
            if len(missing) == 5:
                break
    if missing:
        raise CheckpointError(f"{stored.source}: tensors missing from the weights: {missing} "
                              f"(config.json asks for n_layer={config.n_layer}; the files hold "
                              f"{len(found):,} tensors, {len(_LAYER_NAMES)} per layer)")
    ours = expected_shapes(config)
    expected = {theirs: ours[our_name][::-1] if conv1d else ours[our_name]
                for our_name, theirs, conv1d in weight_names(config.n_layer, config.tie_weights)}
    unexpected = sorted(set(found) - set(expected) - {"lm_head.weight"})
    if unexpected:
        raise CheckpointError(f"{stored.source}: tensors a GPT-2 of this config.json does not "
                              f"have: {unexpected[:5]}")
    check_each_shape(found, expected, stored.source)
    if head_for_wte:
        tensors = stored.read([n for n in expected if n != wte] + ["lm_head.weight"])
        tensors[wte] = tensors.pop("lm_head.weight")
        return tensors
    return stored.read(list(expected))


def _model_from_weights(config: GPTConfig, hf_weights: dict[str, Tensor]) -> GPT:
    """A GPT of `config` holding `hf_weights` (HF names, Conv1D layout), checked already."""
    reference = hf_weights["transformer.wte.weight"]
    model = GPT(config).to(device=reference.device, dtype=reference.dtype)
    ours = model.state_dict()
    with torch.no_grad():
        for our_name, their_name, conv1d in weight_names(config.n_layer, config.tie_weights):
            _copy_weight(ours[our_name], hf_weights[their_name], conv1d, their_name)
    return model.eval()


def to_hf(model: GPT | nn.Module, bos_token_id: int | None = None,
          eos_token_id: int | None = None) -> GPT2LMHeadModel:
    """A `transformers` GPT2LMHeadModel holding exactly the weights of `model`, in eval mode.

    `model` may be wrapped in DDP or `torch.compile`; the plain GPT inside is what is copied.
    """
    model = unwrap_model(model)
    hf_config = hf_config_from_glassgpt(model.config, bos_token_id, eos_token_id)
    reference = model.tok_emb.weight
    hf_model = _transformers().GPT2LMHeadModel(hf_config)
    hf_model.to(device=reference.device, dtype=reference.dtype)
    hf_weights = hf_model.state_dict()
    ours = model.state_dict()
    with torch.no_grad():
        for our_name, their_name, conv1d in weight_names(model.config.n_layer,
                                                          model.config.tie_weights):
            _copy_weight(hf_weights[their_name], ours[our_name], conv1d, our_name)
    return hf_model.eval()


def _copy_weight(dest: Tensor, src: Tensor, conv1d: bool, name: str) -> None:
    """dest <- src in place, transposing between Conv1D (in, out) and Linear (out, in)."""
    value = src.t() if conv1d else src
    if value.shape != dest.shape:
        raise CheckpointError(f"weight {name} has shape {tuple(src.shape)}, expected "
                              f"{tuple(dest.t().shape if conv1d else dest.shape)}")
    dest.copy_(value)


def _without_mask_buffers(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: t for name, t in state.items() if not name.endswith(MASK_BUFFER_SUFFIXES)}


def _check_same_names(expected: set[str], found: set[str], what: str) -> None:
    # HF keeps the tied head in its state dict as a second name for the embedding.
    found = found - ({"lm_head.weight"} - expected)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise CheckpointError(f"{what} does not match a GPT-2 layout: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")


# --- writing a save_pretrained directory ---------------------------------------------------


def save_hf(model: GPT | nn.Module, out_dir: str | os.PathLike[str],
            tokenizer: Tokenizer | None = None, eos_token: str | None = None,
            overwrite: bool = False) -> Path:
    """Write `model` (and a `tokenizers` tokenizer, if given) as a `save_pretrained` directory.

    The weights go to model.safetensors; the tokenizer's `model_max_length` is the model's
    `block_size` (transformers' `generate` then refuses a prompt the positions cannot hold,
    where it would otherwise crash past them). `eos_token`, when the tokenizer knows it, becomes
    the model's bos/eos token so that HF's `generate` stops on it. The directory appears whole
    or not at all, with the permissions of the user's other files. An existing non-empty
    directory is replaced only with `overwrite`, and only if it holds an earlier export.
    """
    out = files.check_can_make_dir(Path(out_dir).expanduser(), CheckpointError)
    replacing = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if replacing:
        check_replaceable_export(out, overwrite)
    model = unwrap_model(model)
    eos_id = tokenizer.token_to_id(eos_token) if tokenizer is not None and eos_token else None
    hf_model = to_hf(model, bos_token_id=eos_id, eos_token_id=eos_id)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as error:
        raise CheckpointError(f"cannot create {out} ({error})") from None
    try:
        hf_model.save_pretrained(staging)  # safetensors by default
        if tokenizer is not None:
            _save_hf_tokenizer(tokenizer, staging, eos_token if eos_id is not None else None,
                               model.config.block_size)
        usual_permissions(staging)
        fsync_tree(staging)
        move_into_place(staging, out, replacing)
    except OSError as error:  # a full disk, a directory that appeared meanwhile
        raise CheckpointError(f"cannot write {out} ({error}); nothing was left there") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path, eos_token: str | None,
                       max_length: int) -> None:
    special = {"bos_token": eos_token, "eos_token": eos_token} if eos_token else {}
    wrapped = _transformers().PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                                      model_max_length=max_length, **special)
    wrapped.save_pretrained(out_dir)
