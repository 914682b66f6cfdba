"""glassgpt: a GPT you can see through, verified against references, and still fast."""

from glassgpt.attention import KVCache, MultiHeadSelfAttention, PerHeadSelfAttention
from glassgpt.block import FeedForward, ManualLayerNorm, TransformerBlock
from glassgpt.config import GPTConfig, load_preset, preset_names
from glassgpt.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    GlassGPTError,
    InputError,
    TokenizerError,
)
from glassgpt.model import GPT, TransformerLM, count_parameters

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "FeedForward",
    "GPTConfig",
    "GlassGPTError",
    "InputError",
    "KVCache",
    "ManualLayerNorm",
    "MultiHeadSelfAttention",
    "PerHeadSelfAttention",
    "TokenizerError",
    "TransformerBlock",
    "TransformerLM",
    "count_parameters",
    "load_preset",
    "preset_names",
]
