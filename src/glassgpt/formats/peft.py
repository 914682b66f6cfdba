"""LoRA adapters in peft's format, both ways: a glass model's adapters (glassgpt.training.lora)
written as a directory `PeftModel.from_pretrained` loads onto the model's Hugging Face export,
and such a directory (written here or by peft) read back onto a glass model.

A directory holds adapter_config.json (peft_type LORA, r, lora_alpha, lora_dropout,
target_modules, ...) and adapter_model.safetensors, whose keys are the HF module names under
peft's wrapper, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight. The HF
names are the family's own (glassgpt.formats.architectures' tables); nothing is renamed here.

GPT-2 fuses q, k and v into one Conv1D (c_attn) in Hugging Face too, so peft puts one adapter
on all three, where glassgpt puts one on each. Glass's three are written exactly as one adapter
of rank 3r (alpha 3 alpha, peft's rank_pattern / alpha_pattern) whose A stacks A_q, A_k, A_v
and whose B is block-diagonal; such a c_attn adapter reads back, one that mixes q, k and v
(what peft trains) is refused by name, as are q, k, v targeted apart on GPT-2 and every target
of GPT-NeoX's per-head fused projection.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors_bytes
from torch import Tensor, nn

from glassgpt.adapters.lora import add_lora, load_lora_state_dict, lora_modules, lora_state_dict
from glassgpt.adapters.settings import TARGETS, LoraSettings
from glassgpt.config import GATED_ACTIVATIONS, GPTConfig
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.formats.architectures import architecture_for
from glassgpt.formats.translation import Architecture
from glassgpt.storage import files
from glassgpt.storage.commit import staged_directory
from glassgpt.storage.tensorfile import SafetensorsFile, check_finite, check_float_dtypes

PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
QKV = ("q", "k", "v")
ADAPTER_CONFIG_FILE = "adapter_config.json"  # peft's names
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
MAX_ADAPTER_BYTES = 2**34
# adapter_config.json settings glassgpt's adapters do not have: each must be off (its value
# here, or absent) in a file read back.
PLAIN_SETTINGS: dict[str, Any] = {"use_dora": False, "use_rslora": False, "lora_bias": False,
                                  "layers_to_transform": None, "modules_to_save": None,
                                  "target_parameters": None, "trainable_token_indices": None}


@dataclass(frozen=True)
class FamilyModules:
    """Where glass's LoRA targets are in one HF family: target -> the HF module name with
    "{i}" for the layer, and whether q, k, v share one (GPT-2's c_attn)."""

    arch: Architecture
    modules: dict[str, str]
    fused_qkv: bool

    def key(self, layer: int, target: str, matrix: str) -> str:
        """The adapter file's key of one matrix ("A" or "B")."""
        return f"{PEFT_PREFIX}{self.modules[target].format(i=layer)}.lora_{matrix}.weight"

    def in_layer(self, target: str) -> str:
        """The module's name inside its layer, e.g. self_attn.q_proj."""
        return self.modules[target].split("{i}.", 1)[1]

    def target_module(self, target: str) -> str:
        """What target_modules lists: the last part (q_proj) where no other target's module
        ends the same (GPT-2 has two c_proj), else the name inside the layer."""
        short = self.in_layer(target).rsplit(".", 1)[-1]
        clash = [t for t in self.modules if self.in_layer(t) != self.in_layer(target)
                 and self.in_layer(t).rsplit(".", 1)[-1] == short]
        return self.in_layer(target) if clash else short


def family_modules(config: GPTConfig) -> FamilyModules:
    """The HF modules of `config`'s family (the one its export takes), from its name table."""
    arch = architecture_for(config)
    up = "up" if config.activation in GATED_ACTIVATIONS else "fc"
    ours = {"q": "attn.qkv", "k": "attn.qkv", "v": "attn.qkv", "o": "attn.proj",
            "gate": "ffn.gate", "up": f"ffn.{up}", "down": "ffn.proj"}
    modules, fused = {}, False
    for target, glass in ours.items():
        theirs = arch.names.get(f"blocks.{{i}}.{glass}.weight")
        if theirs is None:
            continue
        if isinstance(theirs, tuple):  # q, k, v apart (the Llama family, Gemma)
            theirs = theirs[QKV.index(target)]
        elif target in QKV:
            fused = True
        modules[target] = theirs.removesuffix(".weight")
    return FamilyModules(arch, modules, fused)


def check_expressible(family: FamilyModules, settings: LoraSettings) -> None:
    """ConfigError where peft's format cannot hold these adapters exactly, naming why."""
    qkv = [t for t in settings.targets if t in QKV]
    if family.arch.per_head_qkv and qkv:
        raise ConfigError(f"LoRA on {qkv} cannot be written for {family.arch.title}: its "
                          f"query_key_value interleaves each head's q, k and v, which a peft "
                          f"adapter cannot hold apart; adapt o, up or down instead")
    if family.fused_qkv and qkv and len(qkv) != 3:
        raise ConfigError(f"LoRA on {qkv} alone cannot be written for {family.arch.title}: its "
                          f"c_attn holds q, k and v together, so peft's adapter covers all "
                          f"three; target q, k and v together, or none of them")


# --- writing -----------------------------------------------------------------------------------

def adapter_files(model: nn.Module, base_model: str) -> dict[str, bytes]:
    """adapter_config.json and adapter_model.safetensors of `model`'s adapters (unmerged or
    merged alike: the adapters are kept apart), for the HF export named `base_model`."""
    settings = _settings_of(model)
    family = family_modules(model.config)
    check_expressible(family, settings)
    tensors = _hf_tensors(family, settings, lora_state_dict(model), model.config.n_layer)
    config = _peft_config(family, settings, base_model)
    return {ADAPTER_CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode("utf-8"),
            ADAPTER_WEIGHTS_FILE: save_safetensors_bytes(tensors, metadata={"format": "pt"})}


def save_adapter(model: nn.Module, out: str | os.PathLike[str], base_model: str,
                 replacing: bool = False) -> Path:
    """Write `adapter_files` as the directory `out`, whole or not at all."""
    out = Path(out).expanduser()
    contents = adapter_files(model, base_model)
    with staged_directory(out, replacing=replacing) as staging:
        for name, data in contents.items():
            (staging / name).write_bytes(data)
    return out


def _settings_of(model: nn.Module) -> LoraSettings:
    settings = getattr(model, "lora_settings", None)
    if settings is None or not any(True for _ in lora_modules(model)):
        raise ConfigError("this model has no LoRA adapters to write (add_lora first)")
    return settings


def _peft_config(family: FamilyModules, settings: LoraSettings, base_model: str
                 ) -> dict[str, Any]:
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
        "target_modules": sorted({family.target_module(t) for t in settings.targets}),
        "bias": "none", "fan_in_fan_out": bool(family.arch.conv1d), "inference_mode": True,
        "rank_pattern": {}, "alpha_pattern": {}, **PLAIN_SETTINGS,
    }
    if family.fused_qkv and "q" in settings.targets:  # one adapter of rank 3r on q, k, v
        name = family.target_module("q")
        config["rank_pattern"] = {name: 3 * settings.rank}
        config["alpha_pattern"] = {name: 3 * settings.alpha}
    return config


def _hf_tensors(family: FamilyModules, settings: LoraSettings, ours: dict[str, Tensor],
                n_layer: int) -> dict[str, Tensor]:
    tensors = {}
    for i in range(n_layer):
        for target in settings.targets:
            if family.fused_qkv and target in QKV:
                continue
            part = "attn" if target in ("q", "k", "v", "o") else "ffn"
            for matrix in "AB":
                tensors[family.key(i, target, matrix)] = ours[
                    f"blocks.{i}.{part}.{target}.lora_{matrix}.weight"]
        if family.fused_qkv and "q" in settings.targets:
            a, b = _stacked_qkv([ours[f"blocks.{i}.attn.{t}.lora_A.weight"] for t in QKV],
                                [ours[f"blocks.{i}.attn.{t}.lora_B.weight"] for t in QKV])
            tensors[family.key(i, "q", "A")], tensors[family.key(i, "q", "B")] = a, b
    return tensors


def _stacked_qkv(a: list[Tensor], b: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Three adapters (A (r, C), B (rows, r)) as one: A (3r, C) stacked, B (q+k+v rows, 3r)
    block-diagonal, so B A = [B_q A_q; B_k A_k; B_v A_v], each slice's product."""
    return torch.cat(a, dim=0), torch.block_diag(*b)  # (3r, C), (q + 2 kv, 3r)


# --- reading -----------------------------------------------------------------------------------

def read_adapter(directory: str | os.PathLike[str], config: GPTConfig
                 ) -> tuple[LoraSettings, dict[str, Tensor]]:
    """The settings and the tensors (lora_state_dict's names) of the peft adapter directory
    for a glass model of `config`; anything else (another base, a setting glassgpt lacks, a
    name or shape that does not fit) is one CheckpointError."""
    directory = Path(directory).expanduser()
    family = family_modules(config)
    peft = files.read_json_object(directory / ADAPTER_CONFIG_FILE, CheckpointError)
    where = str(directory / ADAPTER_CONFIG_FILE)
    rank, alpha, dropout = _plain_lora(peft, where, family)
    with SafetensorsFile(directory / ADAPTER_WEIGHTS_FILE, CheckpointError) as file:
        if file.nbytes > MAX_ADAPTER_BYTES:
            raise CheckpointError(f"{file.path} holds {file.nbytes:,} bytes, more than an "
                                  f"adapter of this model can")
        check_float_dtypes(file.header, file.path, CheckpointError)  # an int lora_A: no
        hf = file.read_all()
    check_finite(hf, directory / ADAPTER_WEIGHTS_FILE, CheckpointError)
    targets = _targets_in(family, hf, config.n_layer, directory)
    _check_target_modules(peft.get("target_modules"), family, targets, config.n_layer, where)
    try:
        settings = LoraSettings(rank, alpha, dropout, targets)
        settings.check(config)
        check_expressible(family, settings)
        _check_patterns(peft, family, settings, where)
    except ConfigError as error:
        raise CheckpointError(f"{where}: {error}") from None
    return settings, _glass_tensors(family, settings, hf, config)


def load_adapter(model: nn.Module, directory: str | os.PathLike[str]) -> LoraSettings:
    """Adapters from a peft directory onto `model` (added first when it has none; one with
    adapters must have the same settings), unmerged."""
    settings, tensors = read_adapter(directory, model.config)
    current = getattr(model, "lora_settings", None)
    if current is None:
        add_lora(model, settings)
    elif current != settings:
        raise CheckpointError(f"{directory} holds adapters {settings}, the model has "
                              f"{current}")
    load_lora_state_dict(model, tensors)
    return settings


def _plain_lora(peft: dict[str, Any], where: str, family: FamilyModules
                ) -> tuple[Any, Any, Any]:
    """(r, lora_alpha, lora_dropout) of a config that is peft's plain LoRA."""
    if peft.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type is {peft.get('peft_type')!r}; glassgpt "
                              f"reads LoRA adapters (LORA)")
    for name, off in PLAIN_SETTINGS.items():
        if peft.get(name) not in (off, None, [], {}):
            raise CheckpointError(f"{where}: {name}={peft[name]!r}; glassgpt's adapters have "
                                  f"{name}={off!r}")
    if peft.get("bias", "none") != "none":
        raise CheckpointError(f"{where}: bias={peft['bias']!r}; glassgpt's adapters train no "
                              f"biases (bias='none')")
    if bool(peft.get("fan_in_fan_out", False)) != bool(family.arch.conv1d):
        raise CheckpointError(f"{where}: fan_in_fan_out={peft.get('fan_in_fan_out')!r} does "
                              f"not fit {family.arch.title}, this model's family (an adapter "
                              f"for another base?)")
    return peft.get("r"), peft.get("lora_alpha"), peft.get("lora_dropout", 0.0)


def _check_patterns(peft: dict[str, Any], family: FamilyModules, settings: LoraSettings,
                    where: str) -> None:
    """rank_pattern and alpha_pattern: empty, or (GPT-2) the c_attn adapter of rank 3r."""
    wanted = _peft_config(family, settings, "")
    for name in ("rank_pattern", "alpha_pattern"):
        found = peft.get(name) or {}
        if not isinstance(found, dict):
            raise CheckpointError(f"{where}: {name} must be an object (module name -> "
                                  f"{name.split('_')[0]}), got {found!r:.60}")
        if found != wanted[name]:
            raise CheckpointError(f"{where}: {name}={found!r:.80}; glassgpt reads one rank and "
                                  f"alpha for every adapter ({wanted[name] or {}} here)")


def _check_target_modules(listed: Any, family: FamilyModules, targets: tuple[str, ...],
                          n_layer: int, where: str) -> None:
    """target_modules must name exactly the modules the tensors adapt: peft adapts a module
    whose full name is a listed name or ends with "." and one, and would otherwise put fresh
    adapters where the file has none, or leave some of its tensors unread."""
    if not isinstance(listed, list) or not listed or \
            not all(isinstance(name, str) for name in listed):
        raise CheckpointError(f"{where}: target_modules must be a list of module names "
                              f"(glassgpt reads no pattern), got {listed!r:.60}")
    every = {family.modules[t].format(i=i) for t in family.modules for i in range(n_layer)}
    adapted = {family.modules[t].format(i=i) for t in targets for i in range(n_layer)}
    names = set(listed)
    # A module's names peft matches: its own and each ending of it after a dot.
    endings = {module: {module.split(".", k)[-1] for k in range(module.count(".") + 1)}
               for module in every}
    unknown = sorted(names - set().union(*endings.values()))
    if unknown:
        known = sorted({family.target_module(t) for t in family.modules})
        raise CheckpointError(f"{where}: target_modules entry {unknown[0]!r:.60} names no "
                              f"projection of this {family.arch.title} model that glassgpt "
                              f"adapts ({', '.join(known)})")
    matched = {module for module, ends in endings.items() if ends & names}
    if matched != adapted:
        held = sorted({family.target_module(t) for t in targets})
        raise CheckpointError(f"{where}: target_modules {listed!r:.80} but its tensors adapt "
                              f"{', '.join(held)}; peft would adapt other modules than the "
                              f"file holds adapters for")


def _targets_in(family: FamilyModules, hf: dict[str, Tensor], n_layer: int,
                directory: Path) -> tuple[str, ...]:
    """The glass targets the file's keys name, the same in every layer, A and B each."""
    named = [t for t in family.modules if not (family.fused_qkv and t in ("k", "v"))]
    keys = {family.key(i, t, m): (i, t) for i in range(n_layer) for t in named for m in "AB"}
    unknown = sorted(set(hf) - set(keys))
    if unknown:
        raise CheckpointError(f"{directory / ADAPTER_WEIGHTS_FILE}: {unknown[0]} is no "
                              f"projection of this {family.arch.title} model of {n_layer} "
                              f"layers (an adapter for another base?)")
    found = {keys[k][1] for k in hf}
    if family.fused_qkv and "q" in found:
        found |= set(QKV)
    targets = tuple(t for t in TARGETS if t in found)
    expected = {family.key(i, t, m) for i in range(n_layer) for t in targets for m in "AB"
                if not (family.fused_qkv and t in ("k", "v"))}
    missing = sorted(expected - set(hf))
    if missing or not targets:
        raise CheckpointError(f"{directory / ADAPTER_WEIGHTS_FILE}: missing "
                              f"{missing[:3] or 'every adapter'}; glassgpt adapts the same "
                              f"projections in every layer")
    return targets


def _glass_tensors(family: FamilyModules, settings: LoraSettings, hf: dict[str, Tensor],
                   config: GPTConfig) -> dict[str, Tensor]:
    ours = {}
    for i in range(config.n_layer):
        for target in settings.targets:
            if family.fused_qkv and target in QKV:
                continue
            part = "attn" if target in ("q", "k", "v", "o") else "ffn"
            for matrix in "AB":
                ours[f"blocks.{i}.{part}.{target}.lora_{matrix}.weight"] = hf[
                    family.key(i, target, matrix)]
        if family.fused_qkv and "q" in settings.targets:
            a, b = hf[family.key(i, "q", "A")], hf[family.key(i, "q", "B")]
            ours.update(_split_qkv(a, b, settings.rank, config, family.key(i, "q", "B"), i))
    return {name: tensor.float() if tensor.dtype != torch.float32 else tensor
            for name, tensor in ours.items()}


def _split_qkv(a: Tensor, b: Tensor, rank: int, config: GPTConfig, name: str, layer: int
               ) -> dict[str, Tensor]:
    """`_stacked_qkv` undone: A (3r, C) and a block-diagonal B (q+k+v rows, 3r) as three
    adapters; a B that mixes them (peft's own c_attn adapter) is refused."""
    rows = (config.q_width, config.kv_width, config.kv_width)
    if tuple(a.shape) != (3 * rank, config.n_embd) or tuple(b.shape) != (sum(rows), 3 * rank):
        raise CheckpointError(f"{name}: c_attn's adapter has shapes {tuple(a.shape)} and "
                              f"{tuple(b.shape)}, this model's are {(3 * rank, config.n_embd)} "
                              f"and {(sum(rows), 3 * rank)}")
    out, first = {}, 0
    for slot, (target, height) in enumerate(zip(QKV, rows, strict=True)):
        block = b[first:first + height, slot * rank:(slot + 1) * rank]
        out[f"attn.{target}.lora_A.weight"] = a[slot * rank:(slot + 1) * rank]
        out[f"attn.{target}.lora_B.weight"] = block
        first += height
    if not torch.equal(torch.block_diag(*(out[f"attn.{t}.lora_B.weight"] for t in QKV)), b):
        raise CheckpointError(f"{name}: this c_attn adapter mixes q, k and v (its B is not "
                              f"block-diagonal, as peft trains it on GPT-2); glassgpt's adapters "
                              f"are one per projection and cannot hold it")
    return {f"blocks.{layer}.{key}": value.contiguous() for key, value in out.items()}

