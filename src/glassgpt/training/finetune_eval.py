"""Evaluating a fine-tuned run on its conversations: what `glassgpt eval RUN2` measures of a
run `glassgpt finetune` made.

A fine-tune has no prepared corpus: its data is conversations. Its evaluation measures what its
val loss measured while it trained, the loss on the assistant's tokens of the held-out
conversations (split "val"; "train": the others), packed as training packs them. The base
corpus it came from (its source run's data) is `eval RUN2 --data DIR`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glassgpt.data.sft import IGNORED
from glassgpt.errors import ConfigError
from glassgpt.machine.devices import AUTO, timed, tuner_for
from glassgpt.model import GPT, eval_mode
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.tokenizers import Tokenizer
from glassgpt.training.evaluate import MAX_LOSS, Evaluation, eval_batch_size, eval_context
from glassgpt.training.finetune import sft_data


def evaluated_conversations(run: ckpt.Run, split: str) -> str:
    """What `evaluate_conversations(run, split)` scores, for the line that reports it."""
    val_sft = run.extra.get("val_sft")
    if split == "val" and val_sft is not None:
        return f"the assistant's tokens of the conversations of {val_sft}"
    which = "held-out" if split == "val" else "training"
    return f"the assistant's tokens of the {which} conversations of {run.extra.get('sft')}"


def evaluate_conversations(run: ckpt.Run, split: str = "val", batch_size: int | None = None,
                           max_batches: int = 200, device: torch.device | str = "cpu",
                           checkpoint: str = "best", threads: int | str | None = AUTO,
                           progress: Callable[[int, int], Any] | None = None,
                           context: int | None = None) -> Evaluation:
    """Loss, perplexity and bits per byte of fine-tuned `run` on the assistant's tokens of
    its conversations (`evaluated_conversations`), over non-overlapping windows of `context`
    tokens of their packed stream: every assistant token is scored once, after the tokens
    before it in its window. The arguments are `runs.evaluate_run`'s."""
    if split not in ("train", "val"):
        raise ConfigError(f"split must be train or val, got {split!r:.40}")
    sft, val_sft = run.extra.get("sft"), run.extra.get("val_sft")
    if not isinstance(sft, str) or not isinstance(val_sft, str | None):
        raise ConfigError(f"{run.dir} records no conversation file it was fine-tuned on; "
                          f"evaluate it on a prepared corpus (--data DIR, data_dir=)")
    for path in (sft, val_sft):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{run.dir} was fine-tuned on the conversations of {path}, which "
                              f"is not there any more; evaluate it on a prepared corpus "
                              f"instead (--data DIR, data_dir=)")
    conversations = sft_data(run, sft, val_sft).splits[split]
    model, tokenizer = run.load_model(device, checkpoint=checkpoint)
    window = eval_context(model.config.block_size, context)
    batch_size = batch_size or eval_batch_size(window, model.config.vocab_size)
    x, y = _scored_windows(*conversations.stream(), window)  # (W, T) each
    has_targets = (y != IGNORED).any(dim=1)  # a window of prompts alone scores nothing
    x, y = x[has_targets], y[has_targets]
    kept = min(len(y), batch_size * max_batches)
    total, tokens, text_bytes = _windows_loss(model, tokenizer, x[:kept], y[:kept], batch_size,
                                              threads, progress)
    loss = total / tokens
    if not math.isfinite(loss) or loss > MAX_LOSS:
        raise ckpt.CheckpointError(f"the model's loss is {loss}, not a usable number (do its "
                                   f"weights hold NaN or inf?)")
    used = torch.get_num_threads() if model.lm_head.weight.device.type == "cpu" else None
    return Evaluation(loss, tokens, text_bytes, kept == len(y), used, window)


def _scored_windows(ids: np.ndarray, trained: np.ndarray, window: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed stream as inputs and targets in windows of `window`: (W, T) each, targets
    -1 where the token is not an assistant's and in the padding that ends the last window."""
    inputs = ids[:-1]  # (N - 1,)
    targets = np.where(trained[1:], ids[1:], IGNORED)  # (N - 1,)
    padding = -len(inputs) % window
    inputs = np.concatenate([inputs, np.zeros(padding, dtype=np.int64)])
    targets = np.concatenate([targets, np.full(padding, IGNORED, dtype=np.int64)])
    return (torch.from_numpy(inputs).view(-1, window),
            torch.from_numpy(targets).view(-1, window))


@torch.no_grad()
def _windows_loss(model: GPT, tokenizer: Tokenizer, x: torch.Tensor, y: torch.Tensor,
                  batch_size: int, threads: int | str | None,
                  progress: Callable[[int, int], Any] | None) -> tuple[float, int, int]:
    """(summed loss, targets scored, their UTF-8 bytes) of windows x, y (W, T), a batch of
    `batch_size` windows at a time."""
    device = model.lm_head.weight.device
    tuner = tuner_for(threads, device)
    byte_lengths = torch.tensor(tokenizer.token_byte_lengths(), dtype=torch.long)  # (V,)
    total, tokens, text_bytes = 0.0, 0, 0
    if progress is not None:
        progress(0, len(x))
    with eval_mode(model):
        for first in range(0, len(x), batch_size):
            xb, yb = x[first:first + batch_size], y[first:first + batch_size]  # (B, T)
            scored = yb != IGNORED
            with timed(tuner):
                _, loss = model(xb.to(device), yb.to(device))  # mean over the scored targets
                total += loss.item() * int(scored.sum())
            tokens += int(scored.sum())
            text_bytes += int(byte_lengths[yb[scored]].sum())
            if progress is not None:
                progress(min(first + batch_size, len(x)), len(x))
    return total, tokens, text_bytes
