"""The workbench of the modern-Transformer experiments: a small character-level GPT on Tiny
Shakespeare, trained the same way whatever switch of `GPTConfig` an experiment turns.

Every variant of an experiment starts from the same seed, sees the same training batches in the
same order and takes the same number of AdamW steps with the trainer's recipe (weight decay on
matrices only, warmup then cosine decay, gradient clipping), so a difference in loss comes from
the switch, not from the data. Validation windows come from the held-out last 10% of the text
and are the same for every variant and every seed.
Notation: B = batch, T = positions, V = vocabulary (65 characters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from glassgpt.config import GPTConfig, TrainConfig
from glassgpt.data import tinyshakespeare
from glassgpt.experiments.results import step_taken
from glassgpt.model import GPT, eval_mode
from glassgpt.tokenizers import CharTokenizer
from glassgpt.training.optim import lr_at, make_optimizer, set_lr

VAL_FRACTION = 0.1
VAL_SEED = 123_456  # the validation windows, independent of any training seed
DATA_SEED_OFFSET = 10_000  # training batches come from seed + this, the weights from seed


@dataclass(frozen=True)
class CharLMSettings:
    """The model shape and the training recipe every variant shares."""

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64  # the context the model trains on
    batch_size: int = 16
    steps: int = 1000
    lr: float = 3e-3
    warmup_iters: int = 50
    eval_every: int = 100  # steps between validation losses on the curve
    eval_windows: int = 64  # validation windows of block_size tokens


@dataclass
class TrainedLM:
    """A trained variant: the model, its training loss per step and its validation curve."""

    model: GPT
    train_losses: list[float]
    val_steps: list[int]
    val_losses: list[float]

    @property
    def final_val(self) -> float:
        return self.val_losses[-1]


@functools.lru_cache(maxsize=1)
def shakespeare_ids() -> tuple[Tensor, Tensor, int]:
    """Tiny Shakespeare as character ids: (train ids, validation ids, vocabulary size)."""
    raw, _ = tinyshakespeare()
    text = raw.decode("utf-8")
    tokenizer = CharTokenizer.from_text(text)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)  # (N,)
    split = int(len(ids) * (1 - VAL_FRACTION))
    return ids[:split], ids[split:], tokenizer.vocab_size


def unigram_loss() -> float:
    """The loss of the best model that ignores the context: each character predicted from its
    frequency in the training split alone (the entropy of those frequencies, in nats)."""
    train_ids, _, vocab_size = shakespeare_ids()
    frequencies = torch.bincount(train_ids, minlength=vocab_size).double() / len(train_ids)
    seen = frequencies[frequencies > 0]
    return float(-(seen * seen.log()).sum())


def random_windows(ids: Tensor, length: int, count: int,
                   generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """`count` random windows of `length` tokens: inputs (B, T) and next-token targets (B, T)."""
    starts = torch.randint(len(ids) - length, (count,), generator=generator)  # (B,)
    offsets = torch.arange(length + 1)  # (T + 1,)
    windows = ids[starts[:, None] + offsets]  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def validation_windows(length: int, count: int) -> tuple[Tensor, Tensor]:
    """The same held-out windows for every variant and seed: (B, T), (B, T)."""
    _, val_ids, _ = shakespeare_ids()
    return random_windows(val_ids, length, count, torch.Generator().manual_seed(VAL_SEED))


def model_config(s: CharLMSettings, **switches: Any) -> GPTConfig:
    """The experiments' GPT with the given switches (e.g. norm="rmsnorm"); no dropout."""
    _, _, vocab_size = shakespeare_ids()
    return GPTConfig(vocab_size=vocab_size, block_size=s.block_size, n_layer=s.n_layer,
                     n_head=s.n_head, n_embd=s.n_embd, dropout=0.0, **switches)


def recipe(s: CharLMSettings) -> TrainConfig:
    """The trainer's settings these runs use (only the optimizer and schedule are read)."""
    return TrainConfig(max_iters=s.steps, batch_size=s.batch_size, lr=s.lr, min_lr=s.lr / 10,
                       warmup_iters=s.warmup_iters, grad_clip=1.0, weight_decay=0.1)


@torch.no_grad()
def mean_loss(model: GPT, inputs: Tensor, targets: Tensor, chunk: int = 32) -> float:
    """Mean next-token loss of `model` (in eval mode) over windows (B, T), (B, T)."""
    total = 0.0
    with eval_mode(model):
        for start in range(0, len(inputs), chunk):
            _, loss = model(inputs[start:start + chunk], targets[start:start + chunk])
            total += loss.item() * len(inputs[start:start + chunk])
    return total / len(inputs)


def train_char_lm(config: GPTConfig, s: CharLMSettings, seed: int,
                  after_step: Callable[[int, GPT], None] | None = None) -> TrainedLM:
    """Build `config` from `seed`, train it `s.steps` steps; `after_step(step, model)` is called
    after every optimizer step (step counts from 1), e.g. to watch a quantity grow."""
    torch.manual_seed(seed)
    model = GPT(config)
    train_ids, _, _ = shakespeare_ids()
    val_inputs, val_targets = validation_windows(s.block_size, s.eval_windows)
    data = torch.Generator().manual_seed(seed + DATA_SEED_OFFSET)
    cfg = recipe(s)
    optimizer = make_optimizer(model, cfg)
    trained = TrainedLM(model, [], [0], [mean_loss(model, val_inputs, val_targets)])
    for step in range(1, s.steps + 1):
        set_lr(optimizer, lr_at(step - 1, cfg))
        inputs, targets = random_windows(train_ids, s.block_size, s.batch_size, data)
        _, loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        trained.train_losses.append(loss.item())
        step_taken()  # for a progress bar
        if after_step is not None:
            after_step(step, model)
        if step % s.eval_every == 0 or step == s.steps:
            trained.val_steps.append(step)
            trained.val_losses.append(mean_loss(model, val_inputs, val_targets))
    return trained

