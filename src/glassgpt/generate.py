"""Autoregressive decoding: a prefill of the prompt, then one token per step through a KV cache.

Works with any model that has `config.block_size`, `setup_kv_cache`, `remove_kv_cache` and
`forward(idx, start_pos=..., last_only=True) -> (logits, _)` (glassgpt's `GPT`).
Shapes: B = batch, T = prompt length, V = vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from glassgpt.errors import InputError


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None,
                        max_new_tokens: int) -> None:
    """Raise InputError naming the value for any sampling setting out of range."""
    if temperature < 0:
        raise InputError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k <= 0:
        raise InputError(f"top_k must be a positive integer, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def keep_top_k(logits: Tensor, k: int) -> Tensor:
    """Set every logit below the k-th largest of its row to -inf. (B, V) -> (B, V)."""
    k = min(k, logits.size(-1))
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def keep_top_p(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    # A token is dropped when the tokens ranked above it already reach p; the top one never is.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample_next_token(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None,
                      generator: torch.Generator | None = None) -> Tensor:
    """Pick one token per row from logits (B, V); returns (B, 1). Temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        logits = keep_top_k(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = keep_top_p(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


# Inductor settings for the compiled step. By default a CPU kernel may recompute a cheap producer
# inside its consumer; for a LayerNorm feeding a one-row matrix product that means normalising the
# row again for every output feature. A low threshold makes inductor store such a row once.
STEP_COMPILE_OPTIONS = {"realize_cpu_opcount_threshold": 10}


def one_token_logits(model: Any, token: Tensor, start_pos: int) -> Tensor:
    """Logits (B, V) after token (B, 1) at start_pos; the cache holds the earlier positions."""
    return model(token, start_pos=start_pos, last_only=True)[0][:, -1]


@functools.cache
def compiled_step() -> Callable[[Any, Tensor, int], Tensor]:
    """`one_token_logits` through torch.compile, built once per process and shared by all models.

    The position is a dynamic size, so one compilation serves every step: the cache is written at
    a symbolic offset and attention reads only the positions filled so far (gpt-fast instead
    attends over the whole cache under a mask, which for GPT-2's 1024 positions reads more bytes
    of cache than a 16-token prompt needs). One-row products and the one query's attention become
    fused reductions (`Linear._one_row_reduction`, `attention.one_query_attention`), so a step
    is a single native function with no per-operator Python overhead. Dynamo keeps one compiled
    graph per model shape, dtype and batch size, up to its recompile limit (8) per process.
    """
    return torch.compile(one_token_logits, dynamic=True, options=STEP_COMPILE_OPTIONS)


class _Decoder:
    """Feeds the model one step at a time, with or without a KV cache.

    With the cache, each step runs only the newest token. Once the sequence outgrows the
    position table the cache cannot slide (learned positions are absolute), so from then on each
    step recomputes the last `block_size` tokens, exactly as the uncached decoder does.
    """

    def __init__(self, model: Any, prompt: Tensor, max_new_tokens: int, use_cache: bool,
                 compiled: bool = False):
        self.model = model
        self.one_token_logits = compiled_step() if compiled else one_token_logits
        self.block_size = block = model.config.block_size
        self.position = prompt.shape[1]  # tokens in the sequence so far, prompt included
        window = prompt[:, -block:]  # the model never sees more than block_size tokens
        # Room for the window and every new token, but never more than two windows: a long
        # generation rolls the buffer instead of growing it (see `_append`).
        capacity = min(window.shape[1] + max_new_tokens, 2 * block)
        self.buffer = torch.empty(prompt.shape[0], capacity, dtype=prompt.dtype,
                                  device=prompt.device)  # (B, capacity)
        self.buffer[:, :window.shape[1]] = window
        self.filled = window.shape[1]
        self.use_cache = use_cache and self.position <= block
        if self.use_cache:
            # A compiled step keeps the cache at full size: one shape, so never a recompilation.
            needed = block if compiled else min(block, self.position + max_new_tokens)
            model.setup_kv_cache(prompt.shape[0], needed)

    def prefill(self) -> Tensor:
        """Logits (B, V) after the prompt."""
        window = self.buffer[:, :self.filled]
        start_pos = 0 if self.use_cache else None
        return self.model(window, start_pos=start_pos, last_only=True)[0][:, -1]

    def step(self, token: Tensor) -> Tensor:
        """Append token (B, 1) and return the logits (B, V) for the position after it."""
        pos = self.position
        self._append(token)
        if self.use_cache and pos < self.block_size:
            return self.one_token_logits(self.model, token, pos)
        window = self.buffer[:, max(0, self.filled - self.block_size):self.filled]
        return self.model(window, last_only=True)[0][:, -1]

    def _append(self, token: Tensor) -> None:
        if self.filled == self.buffer.shape[1]:  # full: keep the last block_size - 1 tokens
            keep = self.block_size - 1
            self.buffer[:, :keep] = self.buffer[:, self.filled - keep:self.filled].clone()
            self.filled = keep
        self.buffer[:, self.filled:self.filled + 1] = token
        self.filled += 1
        self.position += 1

    def close(self) -> None:
        if self.use_cache:
            self.model.remove_kv_cache()


@torch.no_grad()
def generate_stream(model: Any, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int | None = None, top_p: float | None = None,
                    stop_token: int | None = None, seed: int | None = None,
                    use_cache: bool = True, compiled: bool = False) -> Iterator[Tensor]:
    """Yield up to `max_new_tokens` new tokens (B, 1) one by one, continuing idx (B, T).

    A row that has produced `stop_token` keeps repeating it; decoding ends when every row has.
    `seed` makes sampling reproducible without touching the global random state.
    `compiled` runs each cached step through `compiled_step()`: the first use in a process
    compiles (seconds to a minute) for each model shape and dtype, after which a CPU step is
    1.5-2.5x faster (BENCHMARKS.md); the tokens are those of eager decoding (tested). It has no
    effect without the KV cache, or once decoding runs past `block_size` and recomputes.
    """
    check_sampling_args(temperature, top_k, top_p, max_new_tokens)
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise InputError(f"a prompt must be (batch, time) with at least one token, "
                         f"got shape {tuple(idx.shape)}")
    if max_new_tokens == 0:
        return
    generator = None
    if seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    decoder = _Decoder(model, idx, max_new_tokens, use_cache, compiled)
    finished = torch.zeros(idx.shape[0], 1, dtype=torch.bool, device=idx.device)
    try:
        logits = decoder.prefill()
        for i in range(max_new_tokens):
            token = sample_next_token(logits, temperature, top_k, top_p, generator)
            if stop_token is not None:
                token = token.masked_fill(finished, stop_token)
                finished |= token == stop_token
            yield token
            # The one host sync per step, and only when a stop token can end decoding early.
            if (stop_token is not None and bool(finished.all())) or i == max_new_tokens - 1:
                break
            logits = decoder.step(token)
    finally:
        decoder.close()
        model.train(was_training)


def generate(model: Any, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             stop_token: int | None = None, seed: int | None = None,
             use_cache: bool = True, compiled: bool = False) -> Tensor:
    """Continue idx (B, T); returns (B, T + n) with n <= max_new_tokens (fewer after a stop)."""
    new = list(generate_stream(model, idx, max_new_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, stop_token=stop_token, seed=seed,
                               use_cache=use_cache, compiled=compiled))
    return torch.cat([idx, *new], dim=1)
