"""LoRA settings and peft adapter files that are wrong: each is one glassgpt error naming what is
wrong, read before anything trains or is written (issue 51). Tiny Llama-family and GPT-2 glass
models; the adapter files are glassgpt's own peft export, then edited."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from glassgpt import GPT, GPTConfig
from glassgpt.adapters.lora import add_lora
from glassgpt.adapters.settings import MAX_SCALING, TARGETS, LoraSettings
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.formats.peft import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    read_adapter,
    save_adapter,
)

LLAMA = dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_kv_head=1, n_embd=8,
             mlp_hidden=12, norm="rmsnorm", position="rope", activation="swiglu", bias=False)
GPT2 = dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)


def adapter_dir(tmp_path: Path, shape: dict[str, Any], targets: tuple[str, ...] = ("q", "v"),
                **edits: Any) -> Path:
    """glassgpt's peft export of a rank-2 adapter on `shape`, its config then given `edits`."""
    model = GPT(GPTConfig(**shape))
    add_lora(model, LoraSettings(rank=2, alpha=4.0, targets=targets))
    out = save_adapter(model, tmp_path / "adapter", base_model="tiny")
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    config.update(edits)
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("shape", "edit", "named"), [
    (LLAMA, {"rank_pattern": [1]}, "rank_pattern must be an object"),
    (GPT2, {"alpha_pattern": "x"}, "alpha_pattern must be an object"),
    (LLAMA, {"lora_dropout": "x"}, "dropout must be a number"),
    (LLAMA, {"lora_dropout": True}, "dropout must be a number"),
    (LLAMA, {"lora_alpha": 1e300}, "alpha 1e+300 over rank 2"),
    (LLAMA, {"lora_alpha": -4}, "alpha must be a positive"),
    (LLAMA, {"lora_alpha": "16"}, "alpha must be a positive"),
    (LLAMA, {"target_modules": ["q_proj"]}, "target_modules ['q_proj'] but its tensors adapt "
                                            "q_proj, v_proj"),
    (LLAMA, {"target_modules": ["q_proj", "v_proj", "nope"]}, "'nope' names no projection"),
    (LLAMA, {"target_modules": "q_proj|v_proj"}, "target_modules must be a list"),
])
def test_a_bad_peft_config_is_one_checkpoint_error(tmp_path: Path, shape: dict, edit: dict,
                                                   named: str) -> None:
    targets = TARGETS[:4] if shape is GPT2 else ("q", "v")  # GPT-2's c_attn holds q, k, v
    directory = adapter_dir(tmp_path, shape, targets, **edit)
    with pytest.raises(CheckpointError) as caught:
        read_adapter(directory, GPTConfig(**shape))
    message = str(caught.value)
    assert named in message and str(directory) in message and "\n" not in message


def test_target_modules_matched_as_peft_matches_them(tmp_path: Path) -> None:
    """peft adapts a module whose name is a listed name or ends with "." + it."""
    directory = adapter_dir(tmp_path, LLAMA, target_modules=["self_attn.v_proj", "q_proj"])
    settings, _ = read_adapter(directory, GPTConfig(**LLAMA))
    assert settings.targets == ("q", "v")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    directory = adapter_dir(gpt2, GPT2, targets=TARGETS[:4])  # c_attn and attn.c_proj
    config = json.loads((directory / ADAPTER_CONFIG_FILE).read_text())
    assert sorted(config["target_modules"]) == ["attn.c_proj", "c_attn"]
    config["target_modules"] = ["c_proj", "c_attn"]  # also mlp.c_proj, which has no tensors
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="its tensors adapt attn.c_proj, c_attn"):
        read_adapter(directory, GPTConfig(**GPT2))


def test_an_integer_adapter_tensor_is_refused(tmp_path: Path) -> None:
    directory = adapter_dir(tmp_path, LLAMA)
    tensors = load_file(directory / ADAPTER_WEIGHTS_FILE)
    name = next(k for k in tensors if "lora_A" in k)
    tensors[name] = torch.ones_like(tensors[name], dtype=torch.int32)
    save_file(tensors, directory / ADAPTER_WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match=f"tensor {name} has dtype I32"):
        read_adapter(directory, GPTConfig(**LLAMA))


@pytest.mark.parametrize("alpha", [0, 0.0, -1.0, math.nan, math.inf, 1e30, True, "8"])
def test_alpha_must_be_positive_finite_and_a_sane_scale(alpha: Any) -> None:
    with pytest.raises(ConfigError, match="alpha"):
        LoraSettings(rank=4, alpha=alpha)


def test_the_scale_is_bounded_not_alpha_alone() -> None:
    assert LoraSettings(rank=64, alpha=64 * MAX_SCALING).scaling == MAX_SCALING
    with pytest.raises(ConfigError, match=f"at most {MAX_SCALING}"):
        LoraSettings(rank=1, alpha=MAX_SCALING * 1.5)


def test_settings_from_python_carry_the_command_line_defaults() -> None:
    """LoraSettings(rank=8) is what `--lora-rank 8` asks for: alpha 2 x rank, q, k, v, o."""
    from glassgpt.cli.finetune import TARGETS as LORA_TARGETS

    settings = LoraSettings(rank=8)
    assert settings.alpha == 16.0 and settings.scaling == 2.0
    assert settings.targets == ("q", "k", "v", "o") and LORA_TARGETS == TARGETS
