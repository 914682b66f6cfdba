"""glassgpt: a GPT you can see through, verified against references, and still fast.

The names below are imported on first use, not with the package: `glassgpt --help` and every
command that does not run a model start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "KVCache": "glassgpt.attention",
    "MultiHeadSelfAttention": "glassgpt.attention",
    "PerHeadSelfAttention": "glassgpt.experiments.references",
    "FeedForward": "glassgpt.block",
    "ManualLayerNorm": "glassgpt.norms",
    "TransformerBlock": "glassgpt.block",
    "GPTConfig": "glassgpt.config",
    "SamplingConfig": "glassgpt.config",
    "TrainConfig": "glassgpt.config",
    "load_preset": "glassgpt.config",
    "preset_names": "glassgpt.config",
    "CheckpointError": "glassgpt.errors",
    "ConfigError": "glassgpt.errors",
    "DataError": "glassgpt.errors",
    "GlassGPTError": "glassgpt.errors",
    "InputError": "glassgpt.errors",
    "TokenizerError": "glassgpt.errors",
    "GPT": "glassgpt.model",
    "TransformerLM": "glassgpt.model",
    "count_parameters": "glassgpt.model",
    "generate": "glassgpt.decoding.generate",
    "generate_stream": "glassgpt.decoding.generate",
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "FeedForward",
    "GPT",
    "GPTConfig",
    "GlassGPTError",
    "InputError",
    "KVCache",
    "ManualLayerNorm",
    "MultiHeadSelfAttention",
    "PerHeadSelfAttention",
    "SamplingConfig",
    "TokenizerError",
    "TrainConfig",
    "TransformerBlock",
    "TransformerLM",
    "count_parameters",
    "generate",
    "generate_stream",
    "load_preset",
    "preset_names",
]

if TYPE_CHECKING:  # what a type checker and an editor see; nothing here runs
    from glassgpt.attention import KVCache, MultiHeadSelfAttention
    from glassgpt.block import FeedForward, TransformerBlock
    from glassgpt.config import GPTConfig, SamplingConfig, TrainConfig, load_preset, preset_names
    from glassgpt.decoding.generate import generate, generate_stream
    from glassgpt.errors import (
        CheckpointError,
        ConfigError,
        DataError,
        GlassGPTError,
        InputError,
        TokenizerError,
    )
    from glassgpt.experiments.references import PerHeadSelfAttention
    from glassgpt.model import GPT, TransformerLM, count_parameters
    from glassgpt.norms import ManualLayerNorm


def __getattr__(name: str) -> Any:
    """Import a public name's module the first time the name is asked for (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'glassgpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
