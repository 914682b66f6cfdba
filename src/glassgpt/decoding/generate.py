"""Sampling: continue a prompt token by token, as tensors or as streamed text.

Decoding is a prefill of the prompt, then one token per step through a KV cache; the steps run
on a decoding engine chosen for the model's device (`glassgpt.decoding`), which gives exactly
the tokens of the plain model. All settings are one `SamplingConfig`.
Shapes: B = batch, T = prompt length, V = vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from glassgpt.config import SamplingConfig
from glassgpt.decoding import EagerEngine, engine_for
from glassgpt.decoding.choice import auto_engine_name
from glassgpt.decoding.sampling import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    check_filter,
    draw,
)
from glassgpt.errors import InputError, ModelError
from glassgpt.hooks import HookFn, hooks_attached, named_hooks
from glassgpt.inputs import check_token_ids
from glassgpt.machine.devices import ThreadTuner, tuner_for
from glassgpt.model import eval_mode
from glassgpt.tokenizers import Tokenizer

__all__ = ["encode_prompt", "generate", "generate_stream", "sample_next_token", "stream_text"]


NOT_FINITE = ("the model's logits are not finite (NaN or infinite): its weights are damaged, "
              "or overflowed in a low precision")


def sample_next_token(logits: Tensor, temperature: float = DEFAULT_TEMPERATURE,
                      top_k: int | None = DEFAULT_TOP_K, top_p: float | None = DEFAULT_TOP_P,
                      generator: torch.Generator | None = None) -> Tensor:
    """Pick one token per row from logits (B, V); returns (B, 1). Temperature 0 is greedy.

    InputError for settings SamplingConfig refuses; ModelError if any logit is NaN or infinite
    (this reads one flag back to the host; `generate_stream` checks its steps without that)."""
    check_filter(temperature, top_k, top_p)
    raise_unless_finite(logits)
    return draw(logits, temperature, top_k, top_p, generator)


def raise_unless_finite(logits: Tensor) -> None:
    if not bool(torch.isfinite(logits).all()):
        raise ModelError(NOT_FINITE)


class _Decoder:
    """Feeds the engine one step at a time, with or without the KV cache.

    With the cache, each step runs only the newest token. Once the sequence outgrows the
    position table the cache cannot slide (learned positions are absolute), so from then on each
    step recomputes the last `block_size` tokens, exactly as the uncached decoder does.
    """

    def __init__(self, engine: EagerEngine, block_size: int, prompt: Tensor,
                 max_new_tokens: int, use_cache: bool):
        self.engine, self.block_size = engine, block_size
        self.position = prompt.shape[1]  # tokens in the sequence so far, prompt included
        window = prompt[:, -block_size:]  # the model never sees more than block_size tokens
        # Room for the window and every new token, but never more than two windows: a long
        # generation rolls the buffer instead of growing it (see `_append`).
        capacity = min(window.shape[1] + max_new_tokens, 2 * block_size)
        self.buffer = torch.empty(prompt.shape[0], capacity, dtype=prompt.dtype,
                                  device=prompt.device)  # (B, capacity)
        self.buffer[:, :window.shape[1]] = window
        self.filled = window.shape[1]
        self.use_cache = use_cache and self.position <= block_size
        if self.use_cache:
            engine.start(prompt.shape[0], min(block_size, self.position + max_new_tokens))

    def prefill(self) -> Tensor:
        """Logits (B, V) after the prompt."""
        window = self.buffer[:, :self.filled]
        return self.engine.prefill(window) if self.use_cache else self.engine.recompute(window)

    def step(self, token: Tensor) -> Tensor:
        """Append token (B, 1) and return the logits (B, V) for the position after it."""
        pos = self.position
        self._append(token)
        if self.use_cache and pos < self.block_size:
            return self.engine.step(token, pos)
        window = self.buffer[:, max(0, self.filled - self.block_size):self.filled]
        return self.engine.recompute(window)

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
            self.engine.close()


def _settings(sampling: SamplingConfig | None, overrides: dict[str, Any]) -> SamplingConfig:
    """`sampling` (default: SamplingConfig()) with `overrides` of its fields applied."""
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise InputError(f"sampling must be a SamplingConfig, got {sampling!r:.40}; give "
                         f"settings by name, e.g. max_new_tokens=50")
    base = sampling if sampling is not None else SamplingConfig()
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(SamplingConfig)})
    if unknown:
        raise InputError(f"unknown sampling settings {unknown}; the settings are the fields of "
                         f"SamplingConfig")
    return dataclasses.replace(base, **overrides) if overrides else base


def _check_call(model: Any, idx: Tensor, cfg: SamplingConfig) -> None:
    """The model, the prompt and the settings fit together (before any work is done)."""
    # A GPT, or a module that decodes like one (its forward takes GPT's arguments).
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or not all(
            isinstance(getattr(config, name, None), int) for name in ("vocab_size", "block_size")):
        raise ModelError(f"generate needs a glassgpt GPT model, got {type(model).__name__} "
                         f"{model!r:.40}")
    if not isinstance(idx, Tensor):
        raise InputError(f"a prompt must be a tensor of token ids (batch, time), got "
                         f"{type(idx).__name__} {idx!r:.40}; e.g. torch.tensor([[1, 2, 3]])")
    vocab_size = model.config.vocab_size
    if cfg.stop_token is not None and cfg.stop_token >= vocab_size:
        raise InputError(f"stop_token {cfg.stop_token} is outside the vocabulary "
                         f"[0, {vocab_size}): the model can never produce it")
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise InputError(f"a prompt must be (batch, time) with at least one token, "
                         f"got shape {tuple(idx.shape)}")
    check_token_ids(idx, vocab_size)  # once, here: steps never read ids back


@torch.no_grad()
def generate_stream(model: Any, idx: Tensor, sampling: SamplingConfig | None = None,
                    hooks: Iterable[tuple[str, HookFn]] = (), **settings: Any
                    ) -> Iterator[Tensor]:
    """Yield up to `max_new_tokens` new tokens (B, 1) one by one, continuing idx (B, T).

    `settings` are fields of `SamplingConfig` (e.g. `max_new_tokens=50, temperature=0.8`),
    applied over `sampling`. A row that has produced `stop_token` keeps repeating it; decoding
    ends when every row has. `seed` makes sampling reproducible without touching the global
    random state. The prompt's ids are read back once to be checked; after that no step reads
    anything back to the host (on a GPU: no sync per token), except to end early on a stop token.
    Logits that are NaN or infinite raise ModelError: the prompt's at once (one read-back), a
    later step's when decoding ends (the steps keep a flag on the device; until then such a
    step samples from a uniform row, so nothing fails half way).

    `hooks`: (hook point name, fn(tensor, name)) pairs, as glassgpt.interp's run_with_hooks
    takes them (names, not predicates), attached while decoding runs: a returned tensor
    replaces the activation at every step. A hook sees the positions a step computes (the
    prompt at the prefill, then the one new token with the KV cache, or the whole window
    without it). Only engines that run the model's own modules take hooks: "auto" then means
    the eager model, and a compiled step or a CUDA graph is refused (InputError).
    """
    cfg = _settings(sampling, settings)
    _check_call(model, idx, cfg)
    # Refused by name before any work; no hooks (the default) costs nothing, here or per step.
    hooks = named_hooks(model, hooks) if hooks != () else []
    if cfg.max_new_tokens == 0:
        return
    generator = None
    if cfg.seed is not None:
        generator = torch.Generator(device=idx.device).manual_seed(cfg.seed)
    with eval_mode(model):
        name = cfg.engine
        if hooks:
            name = engine_taking_hooks(name, cfg.compiled)
        elif name == "auto":  # a short decoding is not worth timing the engines for
            name = auto_engine_name(model, cfg.max_new_tokens, cfg.compiled)
        engine = engine_for(model, name, cfg.compiled)
        # On the modules the engine runs (a threaded engine's twin shares the model's points'
        # names); with no hooks nothing is attached, and no step does any work for them.
        watching = hooks_attached(engine.model, hooks) if hooks else contextlib.nullcontext()
        with watching:
            yield from _decode(engine, model.config.block_size, idx, cfg, generator)


def engine_taking_hooks(name: str, compiled: bool) -> str:
    """The engine a decoding with hooks runs on: "auto" is the eager model; a compiled step or
    a captured CUDA graph never calls the hook points, so they are refused rather than have
    the hooks silently ignored."""
    if compiled:
        raise InputError("hooks cannot reach inside a compiled decoding step: decode with "
                         "compiled=False (the eager engine)")
    if name == "cuda-graph":
        raise InputError("the cuda-graph engine replays a captured step that hooks cannot "
                         "reach: decode with hooks on engine 'eager' (or 'auto')")
    return EagerEngine.name if name == "auto" else name


def _decode(engine: EagerEngine, block_size: int, idx: Tensor, cfg: SamplingConfig,
            generator: torch.Generator | None) -> Iterator[Tensor]:
    """generate_stream's loop, on an engine already chosen."""
    decoder = _Decoder(engine, block_size, idx, cfg.max_new_tokens, cfg.use_cache)
    finished = torch.zeros(idx.shape[0], 1, dtype=torch.bool, device=idx.device)
    try:
        logits = decoder.prefill()
        raise_unless_finite(logits)  # damaged weights show here, before the first token
        all_finite = torch.ones((), dtype=torch.bool, device=idx.device)
        for i in range(cfg.max_new_tokens):
            token, all_finite = engine.pick(logits, all_finite, cfg, generator)
            if cfg.stop_token is not None:
                token = token.masked_fill(finished, cfg.stop_token)
                finished |= token == cfg.stop_token
            yield token
            # The one host sync per step, and only when a stop token can end decoding early.
            if (cfg.stop_token is not None and bool(finished.all())) \
                    or i == cfg.max_new_tokens - 1:
                break
            logits = decoder.step(token)
        if not bool(all_finite):
            raise ModelError(NOT_FINITE)
    finally:
        decoder.close()


def generate(model: Any, idx: Tensor, sampling: SamplingConfig | None = None,
             hooks: Iterable[tuple[str, HookFn]] = (), **settings: Any) -> Tensor:
    """Continue idx (B, T); returns (B, T + n) with n <= max_new_tokens (fewer after a stop).

    `settings` are fields of `SamplingConfig`, e.g.
    `generate(model, prompt, max_new_tokens=20, temperature=0.8, top_k=10, seed=0)`;
    `hooks` are (name, fn) pairs run at every step (`generate_stream`).
    """
    return torch.cat([idx, *generate_stream(model, idx, sampling, hooks, **settings)], dim=1)


# --- text ------------------------------------------------------------------------------------

def encode_prompt(tokenizer: Tokenizer, text: str, block_size: int,
                  device: torch.device | str = "cpu", special: bool = True
                  ) -> tuple[Tensor, int]:
    """The prompt as ids (1, T) for the model, and how many tokens it had before cropping.

    With `special`, the ids transformers' `tokenizer(text)` gives: an imported Llama 3's or
    Gemma's begin-of-sequence token first, as those models were trained to see (Gemma's
    continuations fall apart without it). A chat template writes its own, so a rendered chat
    passes special=False. A prompt longer than the context keeps its last `block_size` tokens,
    which is all the model can see; the caller decides whether to say so (the second value
    exceeds block_size).
    """
    ids = [*(tokenizer.leading_special_ids() if special else []), *tokenizer.encode(text)]
    if not ids:
        raise InputError("the prompt encodes to no tokens; give a non-empty prompt")
    return torch.tensor([ids[-block_size:]], device=device), len(ids)


class TextStream(Iterator[str]):
    """The pieces of text `stream_text` yields, read once, and `threads`: the CPU threads the
    decoding runs with (with "auto", the count it settled on once its first steps are read).
    Pass that count as `threads` to the next call to decode again without re-timing."""

    def __init__(self, pieces: Generator[str, None, None], tuner: ThreadTuner | None):
        self._pieces, self._tuner = pieces, tuner

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop decoding early (a reader that left), as a generator's close does."""
        self._pieces.close()

    @property
    def threads(self) -> int:
        return self._tuner.threads if self._tuner is not None else torch.get_num_threads()


def stream_text(model: Any, tokenizer: Tokenizer, prompt: Tensor,
                sampling: SamplingConfig | None = None, stop: str | None = None,
                tuner: ThreadTuner | None = None, threads: int | str | None = None,
                hooks: Iterable[tuple[str, HookFn]] = (), **settings: Any) -> TextStream:
    """The continuation of prompt (1, T) as text, piece by piece as tokens are sampled.

    With `stop`, the text ends just before `stop` first appears (and decoding ends there).
    `hooks` run at every decoding step, as `generate_stream` runs them.
    `threads` (a count, "auto" or None: glassgpt.machine.threadsetting) is the CPU's thread count;
    "auto" times the decoding steps and keeps the faster count (an older caller may pass its
    own `tuner` instead). The stream's `threads` reports the count used.
    """
    if tuner is None and threads is not None:
        tuner = tuner_for(threads, prompt.device, compiled=_settings(sampling, settings).compiled)
    tokens = generate_stream(model, prompt, sampling, hooks, **settings)
    pieces = decode_incrementally(tokenizer, tuner.tuned(tokens) if tuner else tokens)
    return TextStream(until_stop(pieces, stop) if stop else pieces, tuner)


def decode_incrementally(tokenizer: Tokenizer, tokens: Iterable[Tensor]
                         ) -> Generator[str, None, None]:
    """Text of each new token (1, 1) as soon as it is whole: byte-level BPE can split one
    character over several tokens, so an unfinished UTF-8 sequence waits for its end."""
    pending: list[int] = []
    for token in tokens:
        pending.append(int(token))
        text = tokenizer.decode(pending)
        if not text.endswith("\ufffd"):  # the replacement character of an unfinished sequence
            yield text
            pending.clear()
    if pending:
        yield tokenizer.decode(pending)


def until_stop(pieces: Iterable[str], stop: str) -> Generator[str, None, None]:
    """Pass text through until `stop` appears; hold back a tail that may be its beginning."""
    pending = ""
    for piece in pieces:
        pending += piece
        cut = pending.find(stop)
        if cut >= 0:
            yield pending[:cut]
            return  # closing the token generator ends decoding
        hold = _longest_prefix_suffix(pending, stop)
        yield pending[:len(pending) - hold]
        pending = pending[len(pending) - hold:]
    yield pending


def _longest_prefix_suffix(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a start of `stop` (and not all of it)."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0
