"""Export coverage of the weights: every parameter of a glassgpt model lands in the file each
export writes, GGUF for llama.cpp and TransformerLens's checkpoint, or is named here as
deliberately written otherwise. (The settings' coverage, field by field, is
tests/test_export_coverage.py's.)

Each parameter of a tiny model is filled with a number of its own (1000, 1001, ...: exact in
float32), the file is read back, and each number is counted: a parameter dropped counts 0, one
written twice counts twice its size, wherever the format moved its elements (GGUF's q, k and v
cut apart and llama's rows reordered, TransformerLens's heads split). What the file holds beyond
the parameters is named: buffers, zero biases, Llama 3's rotary factors.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.formats.architectures import ARCHITECTURES
from glassgpt.formats.transformer_lens_files import WEIGHTS_NAME, write_lens_checkpoint
from glassgpt.model import GPT
from glassgpt.storage.tensorfile import SafetensorsFile

SHAPE = dict(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32)
ROTARY = dict(SHAPE, position="rope", norm="rmsnorm", activation="swiglu", bias=False)
FIRST_ID = 1000

# One config per family written as GGUF, each with every tensor the family can hold: biases,
# an untied head, grouped K/V heads, QK-norm's weights, a head width of its own.
GGUF_FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": dict(SHAPE, tie_weights=False),
    "llama": dict(ROTARY, bias=True, n_kv_head=2, tie_weights=False),
    "qwen3": dict(ROTARY, qk_norm=True, n_kv_head=2, head_dim=16, tie_weights=False),
    "qwen2": dict(ROTARY, qkv_bias=True, n_kv_head=2, tie_weights=False),
}
# ... and the switches that add or take away a tensor in their file.
GGUF_VARIANTS: dict[str, dict[str, Any]] = {
    "gpt2 tied": SHAPE,
    "llama tied": dict(ROTARY, n_kv_head=2),
    "llama3 rotary": dict(ROTARY, rope_scaling="llama3", rope_factor=8.0,
                          rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                          rope_original_context=8),
}
# What a GGUF file holds beyond the parameters: the factors llama.cpp divides Llama 3's rotary
# angles by, computed from the config.
GGUF_COMPUTED = {"rope_freqs.weight"}

# Configs whose every kind of tensor TransformerLens's checkpoint holds: GPT-2's block (biases,
# LayerNorm, learned positions), Llama's (RMSNorm, gated MLP, grouped K/V, untied head), biases
# on q, k and v alone, an attention-only model without norms, shortformer positions, GeGLU.
LENS_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(SHAPE, activation="gelu_tanh"),
    "gpt2 untied": dict(SHAPE, tie_weights=False),
    "llama": dict(ROTARY, n_kv_head=2, tie_weights=False, mlp_hidden=48),
    "qkv biases": dict(ROTARY, qkv_bias=True),
    "arena": dict(SHAPE, attn_only=True, norm="none", position="shortformer"),
    "geglu": dict(ROTARY, activation="geglu", query_pre_attn_scalar=16.0),
}
# What the checkpoint holds beyond the parameters, each written by TransformerLens's layout:
# the causal mask and its fill value (buffers), zeros for a bias glassgpt leaves out.
LENS_BUFFERS = (".mask", ".IGNORE")


def numbered(config: GPTConfig) -> tuple[GPT, dict[str, tuple[int, int]]]:
    """A model whose every parameter is filled with a number of its own; name -> (that
    number, how many elements). A tied head is the embedding, one parameter."""
    model = GPT(config).eval()
    numbers = {}
    with torch.no_grad():
        for i, (name, param) in enumerate(model.named_parameters()):
            param.fill_(FIRST_ID + i)
            numbers[name] = (FIRST_ID + i, param.numel())
    return model, numbers


def counted(tensors: dict[str, np.ndarray]) -> Counter:
    """How many elements of `tensors` hold each value."""
    counts: Counter = Counter()
    for values in tensors.values():
        found, times = np.unique(values, return_counts=True)
        counts.update(dict(zip(found.tolist(), times.tolist(), strict=True)))
    return counts


def uncounted(tensors: dict[str, np.ndarray], numbers: dict[str, tuple[int, int]]) -> list[str]:
    """The tensors holding a value that is no parameter's number."""
    ids = np.array([number for number, _ in numbers.values()], dtype=np.float64)
    return [name for name, values in tensors.items()
            if not np.isin(values.astype(np.float64), ids).all()]


def assert_each_lands(tensors: dict[str, np.ndarray], numbers: dict[str, tuple[int, int]],
                      copies: dict[str, int] | None = None) -> None:
    """Each parameter's every element is in `tensors`, `copies` times (once unless named)."""
    counts = counted(tensors)
    wrong = {name: f"{counts[number]} of {size * (copies or {}).get(name, 1)}"
             for name, (number, size) in numbers.items()
             if counts[number] != size * (copies or {}).get(name, 1)}
    assert wrong == {}, f"parameters not written whole, elements found: {wrong}"


# --- GGUF ----------------------------------------------------------------------------------------


def gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    gguf = pytest.importorskip("gguf", reason="GGUF export needs the optional extra gguf")
    reader = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}


def test_every_family_written_as_gguf_is_covered() -> None:
    """A family given a GGUF record gets a row in GGUF_FAMILIES, and so a test below."""
    written = {arch.model_type for arch in ARCHITECTURES.values() if arch.gguf is not None}
    assert written == set(GGUF_FAMILIES)


@pytest.mark.parametrize("settings", [*GGUF_FAMILIES.values(), *GGUF_VARIANTS.values()],
                         ids=[*GGUF_FAMILIES, *GGUF_VARIANTS])
def test_every_parameter_lands_in_the_gguf_file(settings: dict[str, Any],
                                                tmp_path: Path) -> None:
    from glassgpt.formats.gguf import write_gguf

    model, numbers = numbered(GPTConfig(**settings))
    write_gguf(model, None, tmp_path / "m.gguf")
    tensors = gguf_tensors(tmp_path / "m.gguf")
    assert_each_lands(tensors, numbers)
    assert set(uncounted(tensors, numbers)) <= GGUF_COMPUTED


# --- TransformerLens's checkpoint -------------------------------------------------------------


def lens_tensors(out: Path) -> dict[str, np.ndarray]:
    with SafetensorsFile(out / WEIGHTS_NAME, AssertionError) as file:
        return {name: tensor.numpy() for name, tensor in file.read_all().items()}


@pytest.mark.parametrize("settings", LENS_CONFIGS.values(), ids=LENS_CONFIGS)
def test_every_parameter_lands_in_the_lens_checkpoint(settings: dict[str, Any],
                                                      tmp_path: Path) -> None:
    config = GPTConfig(**settings)
    model, numbers = numbered(config)
    write_lens_checkpoint(model, tmp_path / "out")
    tensors = lens_tensors(tmp_path / "out")
    # a tied head is written twice: as the embedding (W_E) and as the unembedding (W_U)
    assert_each_lands(tensors, numbers, {"tok_emb.weight": 2} if config.tie_weights else {})
    for name in uncounted(tensors, numbers):
        values = tensors[name]
        assert name.endswith(LENS_BUFFERS) or not values.any(), \
            f"{name} holds values that are no parameter's, and is no buffer or zero bias"
