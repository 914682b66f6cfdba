"""Hugging Face <-> glassgpt: the same weights, read and written both ways.

Eight architectures have a glassgpt twin: GPT-2, Llama (SmolLM2 too), Qwen3, Qwen2, SmolLM3,
Gemma 3, Gemma 2 and GPT-NeoX; what each is in glassgpt's terms (its settings, its weight names,
the layouts that differ) is glassgpt.formats.architectures' table. Here the weights move: every
glassgpt tensor is one HF tensor, transposed where GPT-2 stores a Conv1D (in, out) matrix, its
rows regrouped where GPT-NeoX's fused query_key_value holds each head's q, k, v in turn, or
three HF tensors stacked along its rows (Llama's q_proj, k_proj, v_proj make our `qkv`:
[Q, K, V]), as glassgpt.formats.weight_mapping maps them.

Reading a save_pretrained directory or a hub model is glassgpt.formats.files' job (glassgpt reads
them itself: safetensors only, nothing unpickled, everything bounded); here the tensors it found
are checked against the config, name by name and shape by shape, before any is read.

`transformers` is the optional extra `hf` and is imported only inside the functions that need it
(export), so the rest of glassgpt never pays for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.formats.architectures import (
    Architecture,
    architecture_for,
    architecture_of,
    family_choice,
)
from glassgpt.formats.files import INSTALL_HINT as INSTALL_HINT
from glassgpt.formats.files import (
    HFDirectory,
    StoredWeights,
    check_replaceable_export,
    open_hf_source,
    write_export_marker,
)
from glassgpt.formats.files import MissingExtraError as MissingExtraError
from glassgpt.formats.rotary import RotaryTranslation
from glassgpt.formats.weight_mapping import WeightMapping, weight_mappings
from glassgpt.machine.distributed import unwrap_model
from glassgpt.model import GPT
from glassgpt.rundir.weights import expected_shapes, model_holding
from glassgpt.storage import files
from glassgpt.storage.commit import staged_directory
from glassgpt.storage.tensorfile import check_each_shape, check_finite
from glassgpt.tokenizers.chat import ChatTemplate

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PretrainedConfig, PreTrainedModel


def _transformers() -> Any:
    """The `transformers` module, or a MissingExtraError that says how to install it."""
    try:
        import transformers
    except ImportError as error:
        raise MissingExtraError(f"Hugging Face interop needs the optional extra `hf`: run "
                                f"{INSTALL_HINT} ({error})") from error
    return transformers


def _transformers_class(name: str) -> Any:
    """A class of the installed transformers (Qwen3 arrived in 4.51), or a MissingExtraError."""
    transformers = _transformers()
    if not hasattr(transformers, name):
        raise MissingExtraError(f"the installed transformers {transformers.__version__} has no "
                                f"{name}; upgrade it: pip install -U transformers")
    return getattr(transformers, name)


# --- configs --------------------------------------------------------------------------------


def config_from_hf(hf_config: PretrainedConfig | Any, dropout: float | None = None
                   ) -> GPTConfig:
    """The GPTConfig of a model that computes what `hf_config` describes (GPT-2, Llama, Qwen3,
    Qwen2, SmolLM3, Gemma 3, Gemma 2, GPT-NeoX).

    `dropout` replaces HF's dropout rates, which glassgpt keeps as one; without it they must
    agree (GPT-2, GPT-NeoX), or be zero (Llama and Qwen3 drop only attention weights).
    Settings with no glassgpt equivalent are a ConfigError naming them.
    """
    arch = architecture_of(getattr(hf_config, "model_type", "gpt2"))
    return arch.config_from_hf(hf_config, dropout)


def hf_config_from_glassgpt(config: GPTConfig, bos_token_id: int | None = None,
                            eos_token_id: int | None = None) -> PretrainedConfig:
    """The `transformers` config of the architecture `config` is (GPT2Config, LlamaConfig,
    Qwen3Config, Qwen2Config, SmolLM3Config, Gemma3TextConfig, Gemma2Config or GPTNeoXConfig;
    see `architecture_for`); a ConfigError names any switch that architecture lacks."""
    config = with_mlps_config(config)
    arch, chosen_by = family_choice(config)
    settings = family_settings(arch, chosen_by, config)
    for name, token_id in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if token_id is not None and not 0 <= token_id < config.vocab_size:
            raise ConfigError(f"{name}={token_id} is outside the vocabulary "
                              f"[0, {config.vocab_size})")
    config_class = _transformers_class(arch.hf_config_class)
    _check_takes(config_class, arch.required_settings)
    rotary = arch.rotary
    if rotary is not None:
        settings.update(rotary.kwargs(config_class, config))
    hf_config = config_class(**settings, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    if rotary is not None:
        _check_rotary_taken(rotary, hf_config, config)
    return hf_config


def family_settings(arch: Architecture, chosen_by: str, config: GPTConfig) -> dict[str, Any]:
    """`arch`'s settings for `config`; a refusal also names `chosen_by`, the switches that
    chose `arch`, which the one it refuses may not be (post_norms=True makes a Llama config
    Gemma 2's, which then refuses its activation)."""
    try:
        return arch.hf_settings(config)
    except ConfigError as error:
        if chosen_by in str(error):
            raise
        raise ConfigError(f"{error} (a config with {chosen_by} is exported as "
                          f"{arch.title})") from error


def _check_takes(config_class: Any, names: tuple[str, ...]) -> None:
    """MissingExtraError unless the installed config class takes each of `names` (an older
    one keeps an unknown setting as an attribute and computes without it)."""
    taken = inspect.signature(config_class.__init__).parameters
    missing = [name for name in names if name not in taken]
    if missing:
        raise MissingExtraError(f"the installed transformers {_transformers().__version__}'s "
                                f"{config_class.__name__} does not take {missing[0]}; upgrade "
                                f"it: pip install -U transformers")


def _check_rotary_taken(rotary: RotaryTranslation, hf_config: PretrainedConfig,
                        config: GPTConfig) -> None:
    """ConfigError unless the transformers config reads back the rotary of `config`."""
    theirs = rotary.read(hf_config, lambda key: getattr(hf_config, key, None))
    if theirs != rotary.of(config):
        raise ConfigError(f"the installed transformers did not take the rotary "
                          f"{rotary.of(config)} (it reads {theirs})")


# --- weights --------------------------------------------------------------------------------


def from_hf(source: PreTrainedModel | HFDirectory | str | os.PathLike[str],
            dropout: float | None = None) -> GPT:
    """A glassgpt GPT holding the weights of a HF GPT-2, Llama, Qwen3, Qwen2, SmolLM3,
    Gemma 3, Gemma 2 or GPT-NeoX: a model, a local directory or a hub name.

    A directory (or a hub name, downloaded into the Hugging Face cache) is read by glassgpt,
    never by `transformers` (see glassgpt.formats.files): weights from local `.safetensors` files
    only, checked against config.json before any tensor is allocated; a pickled
    `pytorch_model.bin` is never opened. A config that says tie_word_embeddings beside a head
    of its own that is not the embedding gives an untied model, as transformers (5.x) loads
    it. The result has the dtype and device of the HF weights and starts in eval mode.
    """
    if isinstance(source, str | os.PathLike):
        source = open_hf_source(source)
    if isinstance(source, HFDirectory):
        settings = source.settings()
        arch = architecture_of(settings.model_type)
        config = arch.config_from_hf(settings, dropout)
        with source.weights(arch.base_prefix, arch.skipped, arch.stored_names) as stored:
            if config.tie_weights and _stores_own_head(arch, stored.shapes):
                config = _untied_if_apart(arch, config, stored.read(
                    [arch.names["tok_emb.weight"], "lm_head.weight"]))
            return _model_from_weights(arch, config, _read_checked(arch, config, stored))
    arch = architecture_of(getattr(source.config, "model_type", None))
    config = arch.config_from_hf(source.config, dropout)
    hf_weights = {name: t for name, t in _current_names(arch, source.state_dict()).items()
                  if not name.endswith(arch.skipped)}
    if config.tie_weights and _stores_own_head(arch, hf_weights):
        config = _untied_if_apart(arch, config, hf_weights)
    _check_same_names(arch, {n for m in weight_mappings(arch, config) for n in m.theirs},
                      set(hf_weights))
    check_finite(hf_weights, "the HF model", CheckpointError)
    return _model_from_weights(arch, config, hf_weights, copy=True)


def _stores_own_head(arch: Architecture, weights: dict[str, Any]) -> bool:
    return arch.names["tok_emb.weight"] in weights and "lm_head.weight" in weights


def _untied_if_apart(arch: Architecture, config: GPTConfig, weights: dict[str, Tensor]
                     ) -> GPTConfig:
    """`config` untied when the weights hold a head that is not the embedding, as
    transformers (5.x) loads them: a config.json that says tie_word_embeddings beside a
    fine-tune that untied its head computes with that head, not with the embedding."""
    embedding, head = weights[arch.names["tok_emb.weight"]], weights["lm_head.weight"]
    if embedding.shape == head.shape and torch.equal(embedding, head):
        return config  # one matrix saved twice: tied it is
    return dataclasses.replace(config, tie_weights=False)


def _read_checked(arch: Architecture, config: GPTConfig, stored: StoredWeights
                  ) -> dict[str, Tensor]:
    """The stored tensors `config` needs, under HF names, after checking names and shapes.

    The number of layers is bounded by the tensors first: a config.json asking for 100,000
    layers over the weights of two is named at once, never built.
    """
    found = stored.shapes
    embedding = arch.names["tok_emb.weight"]
    head_for_embedding = (config.tie_weights and embedding not in found
                          and "lm_head.weight" in found)
    if head_for_embedding:  # a tied matrix saved once, under the head's name
        found[embedding] = found.pop("lm_head.weight")
    # Every layer has a tensor of its own, so the files bound the layers worth naming.
    probe = config if config.n_layer <= len(found) else \
        config.with_layers(len(found) + 1)
    _check_none_missing(weight_mappings(arch, probe), found, config, stored.source)
    mappings = weight_mappings(arch, config)
    ours = expected_shapes(config)
    expected = {name: shape for m in mappings for name, shape in
                m.their_shapes(ours[m.ours]).items()}
    unexpected = sorted(set(found) - set(expected) - {"lm_head.weight"})
    if unexpected:
        raise CheckpointError(f"{stored.source}: tensors a {arch.title} of this config.json "
                              f"does not have: {unexpected[:5]}")
    check_each_shape(found, expected, stored.source)
    if head_for_embedding:
        tensors = stored.read([n for n in expected if n != embedding] + ["lm_head.weight"])
        tensors[embedding] = tensors.pop("lm_head.weight")
        return tensors
    return stored.read(list(expected))


def _check_none_missing(mappings: list[WeightMapping], found: dict[str, Any],
                        config: GPTConfig, source: str) -> None:
    missing = []
    for name in (name for m in mappings for name in m.theirs):
        if name not in found:
            missing.append(name)
            if len(missing) == 5:
                break
    if missing:
        per_layer = sum(len(m.theirs) for m in mappings if m.ours.startswith("blocks.0."))
        raise CheckpointError(f"{source}: tensors missing from the weights: {missing} "
                              f"(config.json asks for n_layer={config.n_layer}; the files hold "
                              f"{len(found):,} tensors, {per_layer} per layer)")


def _model_from_weights(arch: Architecture, config: GPTConfig, hf_weights: dict[str, Tensor],
                        copy: bool = False) -> GPT:
    """A GPT of `config` holding `hf_weights` (HF names and layout), checked already, in
    their dtype (the embedding's) and on their device.

    The model is built around the tensors (see rundir.weights.model_holding): no random
    initialisation to overwrite, and a tensor that needs no rearranging is taken as it is,
    not copied (with `copy`, every tensor is: a live HF model's weights stay its own).
    `hf_weights` is emptied as it is read, so a stacked or transposed tensor's parts are freed
    once it is made.
    """
    reference = hf_weights[arch.names["tok_emb.weight"]]
    ours = {}
    with torch.no_grad():
        for m in weight_mappings(arch, config):
            parts = [hf_weights.pop(name) for name in m.theirs]
            value = m.ours_from(parts).to(device=reference.device, dtype=reference.dtype)
            ours[m.ours] = value.clone() if copy and _shares_memory(value, parts[0]) else value
    return model_holding(config, ours, f"the {arch.title} weights").eval()


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def to_hf(model: GPT | nn.Module, bos_token_id: int | None = None,
          eos_token_id: int | None = None) -> PreTrainedModel:
    """A `transformers` model of the architecture `model` is (GPT2LMHeadModel,
    LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM, SmolLM3ForCausalLM,
    Gemma3ForCausalLM, Gemma2ForCausalLM or GPTNeoXForCausalLM) holding exactly its weights,
    in eval mode.

    `model` may be wrapped in DDP or `torch.compile`; the plain GPT inside is what is copied.
    """
    model = with_zero_mlps(unwrap_model(model))
    config = model.config
    hf_config = hf_config_from_glassgpt(config, bos_token_id, eos_token_id)
    arch = architecture_for(config)
    reference = model.tok_emb.weight
    hf_model = _transformers_class(arch.hf_class)(hf_config)
    hf_model.to(device=reference.device, dtype=reference.dtype)
    hf_weights = _current_names(arch, hf_model.state_dict())
    ours = model.state_dict()
    with torch.no_grad():
        for m in weight_mappings(arch, config):
            for name, part in zip(m.theirs, m.theirs_from(ours[m.ours]), strict=True):
                _copy_weight(hf_weights[name], part, name)
    return hf_model.eval()


def with_mlps_config(config: GPTConfig) -> GPTConfig:
    """An `attn_only` config as one every family holds: MLPs of the usual width 4C (GPT-2's
    config has no other), which `with_zero_mlps` gives zero weights, so they add exactly 0;
    any other config as it is."""
    if not config.attn_only:
        return config
    return dataclasses.replace(config, attn_only=False, mlp_hidden=None)


def with_zero_mlps(model: GPT) -> GPT:
    """`model` itself, or for an `attn_only` model the GPT of `with_mlps_config` computing
    exactly what it computes: the same weights and an MLP per block whose weights are all
    zero, so each adds 0 to the stream (no family has attention-only blocks; read back, it is
    a model with MLPs of zeros)."""
    if not model.config.attn_only:
        return model
    with torch.random.fork_rng(devices=[]), torch.device(model.tok_emb.weight.device):
        twin = GPT(with_mlps_config(model.config))  # its initialisation draws no caller's numbers
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".ln2." in key or ".ffn." in key for key in missing), missing
    with torch.no_grad():
        for block in twin.blocks:
            for weight in block.ffn.parameters():
                weight.zero_()
    return twin.to(model.tok_emb.weight.dtype).eval()


def _current_names(arch: Architecture, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """`weights` (a transformers model's state dict) by the names the table uses: an older
    transformers' model may name a tensor as its checkpoints do (GPT-NeoX's `embed_out`)."""
    return {arch.stored_names.get(name, name): tensor for name, tensor in weights.items()}


def _copy_weight(dest: Tensor, value: Tensor, name: str) -> None:
    """dest <- value in place, shapes checked (a mapping error must never broadcast)."""
    if value.shape != dest.shape:
        raise CheckpointError(f"weight {name} has shape {tuple(value.shape)}, expected "
                              f"{tuple(dest.shape)}")
    dest.copy_(value)


def _check_same_names(arch: Architecture, expected: set[str], found: set[str]) -> None:
    # HF keeps the tied head in its state dict as a second name for the embedding.
    found = found - ({"lm_head.weight"} - expected)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise CheckpointError(f"HF model does not match a {arch.title} layout: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")


# --- writing a save_pretrained directory ---------------------------------------------------


def save_hf(model: GPT | nn.Module, out_dir: str | os.PathLike[str],
            tokenizer: Tokenizer | None = None, eos_token: str | None = None,
            overwrite: bool = False, chat: ChatTemplate | None = None) -> Path:
    """Write `model` (and a `tokenizers` tokenizer, if given) as a `save_pretrained` directory.

    The weights go to model.safetensors. The model's `block_size` bounds generation twice:
    the generation config's `max_length` (transformers' `generate` and `pipeline` stop there by
    default, where GPT-2's learned positions would otherwise run out with an IndexError) and
    the tokenizer's `model_max_length`. `eos_token`, when the tokenizer knows it, becomes the
    model's bos/eos token so that HF's `generate` stops on it. An instruct model's `chat`
    template (an imported run's) goes with the tokenizer instead, with its special tokens and
    its end-of-turn token as the eos of the tokenizer, the config and the generation config, so
    that transformers' `apply_chat_template` and chat `pipeline` work and stop where a reply
    ends. A marker file (EXPORT_MARKER) says glassgpt wrote the directory. The directory
    appears whole or not at all, with the permissions of the user's other files. An existing
    non-empty directory is replaced only with `overwrite`, and only if it holds an earlier
    export of glassgpt's (its marker).
    """
    out = files.check_can_make_dir(Path(out_dir).expanduser(), CheckpointError)
    replacing = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if replacing:
        check_replaceable_export(out, overwrite)
    model = unwrap_model(model)
    special = {} if tokenizer is None else _special_tokens(tokenizer, eos_token, chat)
    ids = {name: tokenizer.token_to_id(text) for name, text in special.items()}
    hf_model = to_hf(model, bos_token_id=ids.get("bos_token"),
                     eos_token_id=ids.get("eos_token"))
    hf_model.generation_config.max_length = model.config.block_size
    with staged_directory(out, replacing) as staging, _disk_errors_as_os_errors():
        hf_model.save_pretrained(staging)  # safetensors by default
        if tokenizer is not None:
            _save_hf_tokenizer(tokenizer, staging, special, chat, model.config.block_size)
        write_export_marker(staging)
    return out


def _special_tokens(tokenizer: Tokenizer, eos_token: str | None,
                    chat: ChatTemplate | None) -> dict[str, str]:
    """The exported tokenizer's special tokens (bos_token, eos_token, ...), each one of its
    tokens: an instruct model's own, with its end-of-turn token as the eos (where a reply
    stops); else `eos_token` as both bos and eos."""
    if chat is None:
        wanted = {"bos_token": eos_token, "eos_token": eos_token}
    else:
        wanted = {**chat.special_tokens,
                  "eos_token": chat.end_of_turn or chat.special_tokens.get("eos_token")}
    return {name: text for name, text in wanted.items()
            if text is not None and tokenizer.token_to_id(text) is not None}


@contextlib.contextmanager
def _disk_errors_as_os_errors() -> Iterator[None]:
    """The Rust writers (safetensors, tokenizers) report a full disk as a plain Exception
    ending "(os error 28)"; as the OSError it is, staged_directory names it in one line."""
    try:
        yield
    except OSError:
        raise
    except Exception as error:
        code = re.search(r"\(os error (\d+)\)", str(error))
        if code is None:
            raise
        number = int(code[1])
        raise OSError(number, os.strerror(number)) from error


def _save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path, special: dict[str, str],
                       chat: ChatTemplate | None, max_length: int) -> None:
    # transformers writes the template where the installed version reads it back from
    # (tokenizer_config.json's chat_template, or chat_template.jinja since 4.50).
    template = {} if chat is None else {"chat_template": chat.template}
    wrapped = _transformers().PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                                      model_max_length=max_length,
                                                      **special, **template)
    wrapped.save_pretrained(out_dir)
