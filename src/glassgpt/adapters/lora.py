"""LoRA (Hu et al. 2021) on the glass model, computing what peft's LoRA computes.

An adapted projection W (out, in) adds a low-rank product to its output:

    y = W x + b + (alpha / r) * B (A (dropout(x)))      A (r, in), B (out, r)

A starts as `nn.Linear`'s weights do (kaiming-uniform, a = sqrt(5), as peft's), B at zero, so
an adapted model starts equal to its base. Merging adds (alpha / r) * B A to W; unmerging
subtracts it again.

The model knows nothing of this: `add_lora` replaces the targeted `nn.Linear` modules from
outside with a `LoraLinear` that holds the same weight and bias Parameters, so the model's
state_dict keeps its names and holds the base weights alone (a run's model.safetensors stays a
base model); the adapters are `lora_state_dict`'s. Glass fuses q, k and v into one `qkv`
projection: an adapter on q adds B_q A_q x to q's output rows only, as peft's adapter on
Hugging Face's separate q_proj does.

Paths that read a projection's weight rather than call it (shortformer positions' q and k, a
hook on attention's `hook_result`, the decoding engines) see the base weight while adapters are
unmerged: merge first to sample or inspect a tuned model (a run's `load_model` does).
Shortformer models take no adapter on q, k or v for that reason.

    settings = LoraSettings(rank=8, alpha=16, targets=("q", "v"))
    add_lora(model, settings)          # base frozen, adapters trainable
    optimizer = AdamW(lora_parameters(model).values())
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn

from glassgpt.adapters.settings import LoraSettings
from glassgpt.config import GATED_ACTIVATIONS, GPTConfig
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.storage import files
from glassgpt.storage.layout import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from glassgpt.storage.tensorfile import SafetensorsFile, check_finite, check_float_dtypes


def adapter_dtype(base: torch.dtype) -> torch.dtype:
    """The adapters' dtype on a base of `base`: float32 for the half-precision ones."""
    return torch.float32 if base in (torch.bfloat16, torch.float16) else base


class LoraLinear(nn.Module):
    """A `nn.Linear` with adapters on ranges of its output rows (`slices`: target -> (first,
    end) rows; q, k, v share one fused projection). It holds the base Linear's own weight and
    bias Parameters under their names, so the model's state_dict is unchanged; the adapters
    (`lora_A`, `lora_B`) are left out of it (see `lora_state_dict`)."""

    def __init__(self, base: nn.Linear, slices: dict[str, tuple[int, int]],
                 settings: LoraSettings):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.slices = dict(sorted(slices.items(), key=lambda item: item[1]))
        self.scaling = settings.scaling
        self.lora_dropout = nn.Dropout(settings.dropout)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        # On a bf16 or fp16 base the adapters still train in float32 (peft's
        # autocast_adapter_dtype): their updates are small next to the base's weights.
        like = dict(device=base.weight.device, dtype=adapter_dtype(base.weight.dtype))
        for name, (first, end) in self.slices.items():
            a = torch.empty(settings.rank, self.in_features, **like)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # nn.Linear's init, as peft's A
            self.lora_A[name] = nn.Parameter(a)
            self.lora_B[name] = nn.Parameter(torch.zeros(end - first, settings.rank, **like))
        self.merged = False
        self.register_state_dict_post_hook(_drop_adapters_from_state)
        self.register_load_state_dict_post_hook(_adapters_not_missing)

    def delta(self, name: str) -> Tensor:
        """(alpha / r) B A of one slice: (rows, in)."""
        return self.scaling * (self.lora_B[name] @ self.lora_A[name])

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        if self.merged:
            return y
        pieces, row = [], 0
        for name, (first, end) in self.slices.items():
            if first > row:
                pieces.append(y[..., row:first])  # rows without an adapter
            # a mask of its own per slice, as peft's separate q_proj, k_proj, v_proj draw
            adapter_in = self.lora_dropout(x).to(self.lora_A[name].dtype)
            low = F.linear(adapter_in, self.lora_A[name])  # (..., r)
            change = F.linear(low, self.lora_B[name]) * self.scaling  # (..., rows)
            pieces.append(y[..., first:end] + change.to(y.dtype))
            row = end
        if row < self.out_features:
            pieces.append(y[..., row:])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)  # (..., out)

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            for name, (first, end) in self.slices.items():
                self.weight[first:end] += self.delta(name).to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            for name, (first, end) in self.slices.items():
                self.weight[first:end] -= self.delta(name).to(self.weight.dtype)
            self.merged = False

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"adapters={list(self.slices)}, scaling={self.scaling}, merged={self.merged}")


def _drop_adapters_from_state(module: nn.Module, state: dict[str, Any], prefix: str,
                              local_metadata: Any) -> None:
    """The model's state_dict keeps the base weights alone: a run's weights stay its base's."""
    for key in [k for k in state if k.startswith((prefix + "lora_A.", prefix + "lora_B."))]:
        del state[key]


def _adapters_not_missing(module: nn.Module, incompatible: Any) -> None:
    """A base state_dict loads into an adapted model: the adapters are not its to hold."""
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                    if ".lora_A." not in k and ".lora_B." not in k]


# --- where the targets live ---------------------------------------------------------------

def _projections(config: GPTConfig) -> dict[str, tuple[str, str]]:
    """target -> (sub-layer attribute, its projection attribute) in one block."""
    up = "up" if config.activation in GATED_ACTIVATIONS else "fc"
    return {"q": ("attn", "qkv"), "k": ("attn", "qkv"), "v": ("attn", "qkv"),
            "o": ("attn", "proj"), "gate": ("ffn", "gate"), "up": ("ffn", up),
            "down": ("ffn", "proj")}


def _rows(config: GPTConfig, target: str, out_features: int) -> tuple[int, int]:
    """The output rows of `target` in its projection: q, k, v are consecutive ranges of qkv."""
    q, kv = config.q_width, config.kv_width
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}.get(target,
                                                                        (0, out_features))


def add_lora(model: nn.Module, settings: LoraSettings) -> None:
    """Adapters on `settings.targets` of every block of `model` (a GPT), in place; every base
    parameter frozen (requires_grad False), the adapters trainable."""
    config = model.config
    settings.check(config)
    if any(True for _ in lora_modules(model)):
        raise ConfigError("this model has LoRA adapters already; add them once")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for block in model.blocks:
        homes = _projections(config)
        chosen: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
        for target in settings.targets:
            part, attribute = homes[target]
            linear = getattr(getattr(block, part), attribute)
            chosen.setdefault(homes[target], {})[target] = _rows(config, target,
                                                                 linear.out_features)
        for (part, attribute), slices in chosen.items():
            owner = getattr(block, part)
            setattr(owner, attribute, LoraLinear(getattr(owner, attribute), slices, settings))
    model.lora_settings = settings  # what run_adapter_files and the HF adapter write


def lora_modules(model: nn.Module) -> Iterator[tuple[int, str, LoraLinear]]:
    """(layer, sub-layer name, module) of every LoraLinear of `model`'s blocks."""
    for i, block in enumerate(getattr(model, "blocks", ())):
        for part in ("attn", "ffn"):
            owner = getattr(block, part, None)
            for child in () if owner is None else owner.children():
                if isinstance(child, LoraLinear):
                    yield i, part, child


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable adapters by a peft-like name, blocks.{i}.{attn|ffn}.{target}.lora_A.weight
    (and lora_B)."""
    found = {}
    for i, part, module in lora_modules(model):
        for name in module.slices:
            found[f"blocks.{i}.{part}.{name}.lora_A.weight"] = module.lora_A[name]
            found[f"blocks.{i}.{part}.{name}.lora_B.weight"] = module.lora_B[name]
    return found


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters (`lora_parameters`' names), detached copies on the CPU."""
    return {name: p.detach().cpu().clone().contiguous()
            for name, p in lora_parameters(model).items()}


def load_lora_state_dict(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Copy `tensors` (lora_state_dict's names, exactly those, the same shapes) into the
    model's adapters; a merged model is unmerged first and merged again after."""
    parameters = lora_parameters(model)
    missing = sorted(set(parameters) - set(tensors))
    unexpected = sorted(set(tensors) - set(parameters))
    if missing or unexpected:
        raise CheckpointError(f"the adapter does not match the model's adapters (missing "
                              f"{missing[:4]}, unexpected {unexpected[:4]})")
    for name, parameter in parameters.items():
        if tuple(tensors[name].shape) != tuple(parameter.shape):
            raise CheckpointError(f"adapter tensor {name} has shape {tuple(tensors[name].shape)},"
                                  f" the model's is {tuple(parameter.shape)}")
    merged = [module for _, _, module in lora_modules(model) if module.merged]
    for module in merged:
        module.unmerge()
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(tensors[name])
    for module in merged:
        module.merge()


def merge_lora(model: nn.Module) -> None:
    """Add every adapter's (alpha / r) B A into its base weight: the forward then costs what
    the base's does (decoding engines that read the weights see the adapted ones)."""
    for _, _, module in lora_modules(model):
        module.merge()


def unmerge_lora(model: nn.Module) -> None:
    """Take the adapters back out of the base weights (`merge_lora` undone)."""
    for _, _, module in lora_modules(model):
        module.unmerge()


def bake_lora(model: nn.Module) -> None:
    """Merge the adapters and put plain `nn.Linear` modules back (holding the merged
    weights): the model is a plain GPT again, with nothing of LoRA left to unmerge, and its
    weights trainable again as a loaded model's are (a frozen one counted as 0 parameters)."""
    for block in model.blocks:
        for part in ("attn", "ffn"):
            owner = getattr(block, part, None)
            for attribute, child in [] if owner is None else list(owner.named_children()):
                if isinstance(child, LoraLinear):
                    setattr(owner, attribute, _plain_linear(child))
    if hasattr(model, "lora_settings"):
        del model.lora_settings
    model.requires_grad_(True)


def _plain_linear(module: LoraLinear) -> nn.Linear:
    module.merge()
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                       device="meta")
    linear.weight, linear.bias = module.weight, module.bias  # the merged Parameters themselves
    return linear


# --- a run's adapter files ------------------------------------------------------------------
# A run keeps its adapters in glassgpt's own names (lora_state_dict's) beside its base weights;
# peft's format, with Hugging Face's module names, is written on export (glassgpt.formats.peft).

ADAPTER_FORMAT = "glassgpt-lora/1"


def run_adapter_files(model: nn.Module) -> dict[str, bytes]:
    """The run's adapter files of `model`'s adapters: the settings (JSON) and the tensors."""
    settings = getattr(model, "lora_settings", None)
    if settings is None:
        raise ConfigError("the model has no LoRA adapters to save")
    config = {"format": ADAPTER_FORMAT, "rank": settings.rank, "alpha": settings.alpha,
              "dropout": settings.dropout, "targets": list(settings.targets)}
    tensors = {name: t.detach().contiguous() for name, t in lora_state_dict(model).items()}
    return {ADAPTER_CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode("utf-8"),
            ADAPTER_WEIGHTS_FILE: safetensors_bytes(tensors)}


def apply_run_adapter(model: nn.Module, directory: str | Path) -> LoraSettings:
    """The adapters a run keeps in `directory`, added to `model` (unmerged); anything not
    written by run_adapter_files, or for another model, is one CheckpointError line."""
    directory = Path(directory)
    config = files.read_json_object(directory / ADAPTER_CONFIG_FILE, CheckpointError)
    if config.get("format") != ADAPTER_FORMAT:
        raise CheckpointError(f"{directory / ADAPTER_CONFIG_FILE} is not a glassgpt adapter "
                              f"(format {config.get('format')!r:.40})")
    try:
        settings = LoraSettings(config["rank"], config["alpha"], config["dropout"],
                                config["targets"])
        settings.check(model.config)
    except KeyError as error:
        raise CheckpointError(f"{directory / ADAPTER_CONFIG_FILE} has no {error}") from None
    except ConfigError as error:
        raise CheckpointError(f"{directory / ADAPTER_CONFIG_FILE}: {error}") from None
    with SafetensorsFile(directory / ADAPTER_WEIGHTS_FILE, CheckpointError) as file:
        check_float_dtypes(file.header, file.path, CheckpointError)
        tensors = file.read_all()
    check_finite(tensors, directory / ADAPTER_WEIGHTS_FILE, CheckpointError)
    add_lora(model, settings)
    load_lora_state_dict(model, tensors)
    return settings
