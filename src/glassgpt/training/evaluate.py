"""How well a model predicts a split: loss, perplexity and bits per byte.

Loss and perplexity depend on the tokenizer: a model with a bigger vocabulary spends more nats
per token on fewer tokens. Bits per byte divide the same total by the text's UTF-8 bytes
instead, so models with different tokenizers can be compared on one scale:

    bits/byte = (mean loss in nats per token) * tokens / (ln 2 * bytes)

For a character model on ASCII text (one byte per token) this is loss / ln 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from glassgpt.data import sequential_batches
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.machine.devices import ThreadTuner, timed, tuner_for
from glassgpt.model import GPT
from glassgpt.tokenizers import Tokenizer

MAX_LOSS = math.log(float(np.finfo(np.float64).max))  # above this, perplexity overflows


def bits_per_byte(loss: float, tokens: int, text_bytes: int) -> float:
    """Mean loss in nats per token -> bits per UTF-8 byte of the text those tokens make."""
    if tokens <= 0 or text_bytes <= 0:
        raise ValueError(f"bits per byte need tokens and bytes, got {tokens} and {text_bytes}")
    return loss * tokens / (math.log(2) * text_bytes)


@dataclass(frozen=True)
class Evaluation:
    loss: float  # mean cross-entropy in nats per token
    tokens: int  # targets scored
    text_bytes: int  # UTF-8 bytes of the text those targets stand for
    whole_split: bool = True  # False when the bound on batches left windows out
    threads: int | None = None  # the CPU threads the last batches ran with (None on a GPU)
    context: int | None = None  # tokens a window held

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return bits_per_byte(self.loss, self.tokens, self.text_bytes)


LONGEST_DEFAULT_CONTEXT = 2048  # tokens a window holds unless --context says otherwise


def eval_context(block_size: int, context: int | None = None) -> int:
    """The window an evaluation scores: `context` (at most the model's `block_size`), else the
    model's whole context up to LONGEST_DEFAULT_CONTEXT tokens. An imported model's context
    (Qwen3-0.6B: 40,960) is longer than most validation splits, and one window of it costs
    minutes on a CPU; models trained here (block_size <= 2048) keep their whole context."""
    if context is None:
        return min(block_size, LONGEST_DEFAULT_CONTEXT)
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise ConfigError(f"the evaluation context must be a positive number of tokens, got "
                          f"{context!r:.40}")
    if context > block_size:
        raise ConfigError(f"context={context} is longer than the model's block_size="
                          f"{block_size}")
    return context


DEFAULT_EVAL_BATCH = 32  # windows per batch, where their logits fit LOGITS_BUDGET_BYTES
LOGITS_BUDGET_BYTES = 2**30


def eval_batch_size(context: int, vocab_size: int) -> int:
    """Windows per evaluation batch: 32, or as many (at least one) as keep the batch's float32
    logits (batch x context x vocabulary) within 1 GiB. A 151,936-word model scores one window
    of 2,048 tokens at a time (1.2 GiB of logits), GPT-2 five of 1,024."""
    fits = LOGITS_BUDGET_BYTES // (4 * context * vocab_size)
    return max(1, min(DEFAULT_EVAL_BATCH, fits))


@torch.no_grad()
def evaluate(model: GPT, ids: np.ndarray, tokenizer: Tokenizer, batch_size: int,
             max_batches: int, device: torch.device | str = "cpu",
             tuner: ThreadTuner | None = None,
             progress: Callable[[int, int], Any] | None = None,
             threads: int | str | None = None, context: int | None = None) -> Evaluation:
    """Score `model` on non-overlapping windows of `context` tokens (default: its whole
    context, `eval_context`) from the start of `ids` (at most batch_size * max_batches of
    them). A loss that is not a finite number (weights holding
    NaN, say) is a CheckpointError: it has no meaningful perplexity or bits per byte.
    `threads` (a count, "auto" or None) is the CPU's thread count: "auto" times the batches
    and keeps the faster count (an older caller may pass its own `tuner` instead); the result
    says which count ran. `progress(windows done, windows in all)` is called after each
    batch."""
    device = torch.device(device)
    if tuner is None and threads is not None:
        tuner = tuner_for(threads, device)
    byte_lengths = torch.tensor(tokenizer.token_byte_lengths(), dtype=torch.long,
                                device=device)  # (V,)
    block_size = eval_context(model.config.block_size, context)
    batches = sequential_batches(ids, block_size, batch_size, max_batches, device,
                                 model.config.vocab_size)
    windows = min((len(ids) - 1) // block_size, batch_size * max_batches)
    total, tokens, text_bytes = 0.0, 0, 0
    if progress is not None:
        progress(0, windows)  # the whole of the work, before its first batch
    for x, y in batches:
        with timed(tuner):
            _, loss = model(x, y, check_ids=False)  # mean over the (B, T) targets; ids checked
            total += loss.item() * y.numel()
        tokens += y.numel()
        text_bytes += int(byte_lengths[y].sum())
        if progress is not None:
            progress(tokens // block_size, windows)
    loss = total / tokens
    whole = (len(ids) - 1) // block_size <= batch_size * max_batches
    if not math.isfinite(loss) or loss > MAX_LOSS:
        raise CheckpointError(f"the model's loss is {loss}, not a usable number (do its weights "
                              f"hold NaN or inf?)")
    used = torch.get_num_threads() if device.type == "cpu" else None
    return Evaluation(loss, tokens, text_bytes, whole, used, block_size)
