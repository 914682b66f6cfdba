"""The exceptions glassgpt raises for user mistakes.

Every one derives from `GlassGPTError`, so the CLI can turn any of them into one clear line and a
non-zero exit, while a real bug (anything else) still shows its traceback.
"""

from __future__ import annotations


class GlassGPTError(Exception):
    """Base class of every error that a user's input (not a bug) can cause."""


class ConfigError(GlassGPTError, ValueError):
    """A model or training setting that cannot work (sizes, names, ranges)."""


class InputError(GlassGPTError, ValueError):
    """Tokens or text handed to a model that it cannot take (too long, outside the vocabulary)."""


class TokenizerError(GlassGPTError, ValueError):
    """Text a tokenizer cannot encode, or a tokenizer file that is not valid."""


class DataError(GlassGPTError):
    """A corpus or prepared data directory that is missing, empty or not usable."""


class CheckpointError(GlassGPTError):
    """A run directory or checkpoint that is missing, corrupt or does not match its config."""


class CommandLineError(GlassGPTError):
    """A bad flag or argument on the command line."""


class ModelError(GlassGPTError, ValueError):
    """A model that cannot be used as asked: not a glassgpt model, or one whose numbers (weights,
    logits) are NaN or infinite."""
