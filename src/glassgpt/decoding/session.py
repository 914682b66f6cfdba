"""Sampling from a run directory, as one library call: what `glassgpt sample` does.

    from glassgpt.decoding.session import sample_run

    done = sample_run("runs/tiny", "ROMEO:", sampling=SamplingConfig(max_new_tokens=50))
    print(done.texts[0])
    done = sample_run("runs/chat", chat="Hello!", dtype="bfloat16",
                      on_sample=lambda i, pieces: [print(p, end="") for p in pieces])

The run is opened once and its model made ready to decode in the dtype asked for
(glassgpt.decoding.prepare); a prompt is continued, or a chat message (after an optional system
message) is rendered through the run's chat template and answered until the template's end of
turn. Everything is checked before the weights are read. What the command prints besides the
samples (which weights, what is steered, how it decodes) comes as notes, each handed to
`on_note` as soon as it is known, before the first token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassgpt.config import SamplingConfig, sampling_defaults
from glassgpt.config_checks import COMPILE_PAYS_OFF_STEPS, INT64_MAX
from glassgpt.decoding.generate import encode_prompt, stream_text, until_stop
from glassgpt.decoding.kernels import blockdot
from glassgpt.decoding.prepare import DecodingModel, decoding_model
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.hooks import HookFn
from glassgpt.machine.devices import bf16_warning, resolve_device
from glassgpt.machine.threadsetting import AUTO
from glassgpt.rundir.checkpoint import Run, open_run
from glassgpt.tokenizers.chat import chat_messages
from glassgpt.training import arguments

DEFAULT_PROMPT = "\n"  # what an empty prompt continues: the start of a line
# Given the loaded model, the (hook point, fn) pairs to run at every step and a line for each
# saying what it adds where (glassgpt.interp.methods.steering builds such pairs).
SteeringHooks = Callable[[nn.Module], tuple[Sequence[tuple[str, HookFn]], Sequence[str]]]
OnSample = Callable[[int, Iterator[str]], Any]  # (sample index, its pieces as sampled)

# The start line of `sample --dtype int8/int4`: what was quantized, and how it multiplies.
BLOCK_NOTES = {
    "int8": "int8: every layer's weight in Q8_0 blocks of 32 (llama.cpp's format: an fp16 "
            "scale a block), multiplied with integer dot products",
    "int4": "int4: every layer's weight in Q4_0 blocks of 32 (llama.cpp's format: 4 bits a "
            "weight, an fp16 scale a block), multiplied with integer dot products",
}
INT8_NOTE = BLOCK_NOTES["int8"]


@dataclass
class SampleResult:
    """What `sample_run` did: each sample's text (a chat's reply alone; a continuation
    without its prompt), the notes it gave, and the CPU threads the decoding settled on."""

    texts: list[str]
    notes: list[str]
    threads: int


@dataclass(frozen=True)
class _Prompt:
    text: str  # what the model reads
    end_of_turn: str | None = None  # a chat reply's end, cut from its text
    stop_token: int | None = None  # ... as one token id where it is one


def sample_run(run: str | Path | Run, prompt: str | None = None, *, chat: str | None = None,
               system: str | None = None, sampling: SamplingConfig | None = None,
               num_samples: int = 1, stop: str | None = None, dtype: str = "float32",
               device: str | torch.device = "auto", compile: bool = False,
               checkpoint: str = "best", threads: int | str | None = AUTO,
               steering: SteeringHooks | None = None, on_note: Callable[[str], Any] | None = None,
               on_sample: OnSample | None = None, wording: str = "api") -> SampleResult:
    """`num_samples` samples from the model of `run`: continuing `prompt` (default: a
    newline), or replying to `chat` (after `system`) through the run's chat template.

    `sampling` (default: `glassgpt sample`'s row of SAMPLING_DEFAULTS) sets the filter, the
    length and the seed: sample i uses seed + i. `stop` ends a sample where that text appears.
    `dtype` is float32, bfloat16, int8 or int4 (glassgpt.decoding.prepare); `compile` compiles
    the decoding step (nothing compiles unasked). `steering` gives the hooks to
    run at every step once the model is loaded. `on_note(line)` hears each note as it is known;
    `on_sample(i, pieces)` is called for each sample with its text as it is sampled. Raises
    glassgpt.errors exceptions naming arguments as Python does, or as flags with
    `wording="cli"`, before the weights are read."""
    spell = arguments.spelling(wording)
    sampling = sampling if sampling is not None else sampling_defaults("sample")
    _check_request(num_samples, sampling, chat, system, spell)
    target = resolve_device(str(device))
    run = open_run(run)
    # before the model is read: a run without a template fails fast
    asked = _Prompt(prompt or DEFAULT_PROMPT) if chat is None else \
        chat_prompt(run, chat, system, spell)
    decoding = decoding_model(run, dtype, device=target, checkpoint=checkpoint,
                              compiled=compile)
    stop_token = sampling.stop_token if asked.stop_token is None else asked.stop_token
    sampling = dataclasses.replace(sampling, compiled=decoding.compiled, stop_token=stop_token)
    notes: list[str] = []

    def note(line: str) -> None:
        notes.append(line)
        if on_note is not None:
            on_note(line)

    ids, hooks = _ready(run, decoding, asked, chat is None, steering, checkpoint, note)
    for line in _decoding_notes(decoding, ids.shape[1], sampling, num_samples, compile):
        note(line)
    texts, used = [], threads
    for i in range(num_samples):
        seed = None if sampling.seed is None else sampling.seed + i
        stream = stream_text(decoding.model, decoding.tokenizer, ids, sampling,
                             stop=asked.end_of_turn or stop, threads=used, hooks=hooks,
                             seed=seed)
        # A reply's end of turn ends decoding; --stop cuts within it.
        pieces = until_stop(stream, stop) if asked.end_of_turn and stop else stream
        texts.append(_told(pieces, i, on_sample))
        used = stream.threads  # "auto" is settled by the first sample, not timed again
    return SampleResult(texts, notes, used)


def _check_request(num_samples: int, sampling: SamplingConfig, chat: str | None,
                   system: str | None, spell: arguments.Spell) -> None:
    if not isinstance(sampling, SamplingConfig):
        raise ConfigError(f"sampling must be a SamplingConfig, got {sampling!r:.40}")
    seed = sampling.seed
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
        raise ConfigError(f"{spell('num_samples')} must be positive, got {num_samples}")
    if system is not None and chat is None:
        raise ConfigError(f"{spell('system')} goes with {spell('chat')} MESSAGE (a system "
                          f"message before the user's)")
    if seed is not None and seed + num_samples - 1 > INT64_MAX:  # sample i uses seed + i
        raise ConfigError(f"{spell('num_samples')} {num_samples} from {spell('seed')} {seed} "
                          f"needs seeds past 2**63 - 1, the largest there is")


def _ready(run: Run, decoding: DecodingModel, asked: _Prompt, plain: bool,
           steering: SteeringHooks | None, checkpoint: str, note: Callable[[str], Any]
           ) -> tuple[torch.Tensor, Sequence[tuple[str, HookFn]]]:
    """The prompt's ids (1, T) and the steering hooks, with the notes on the weights, the
    steering and the precision."""
    block_size = decoding.model.config.block_size
    # A chat template writes the begin-of-sequence token itself, where a model has one.
    ids, length = encode_prompt(decoding.tokenizer, asked.text, block_size, decoding.device,
                                special=plain)
    hooks, steered = steering(decoding.model) if steering is not None else ((), ())
    note(f"sampling from {run.describe_weights(checkpoint)}")
    for line in steered:
        note(line)
    warning = bf16_warning(decoding.device) if decoding.dtype == "bfloat16" else None
    if warning:
        note(f"warning: {warning}")
    if length > block_size:
        note(f"note: the prompt has {length} tokens, more than the context of {block_size}; "
             f"the model sees its last {block_size}")
    return ids, tuple(hooks)


def _decoding_notes(decoding: DecodingModel, prompt_len: int, sampling: SamplingConfig,
                    num_samples: int, compile_asked: bool) -> list[str]:
    """How the samples decode: int8's line (its own rule), else what --compile costs."""
    on = decoding.device.type
    if decoding.dtype in BLOCK_NOTES:  # how the integer products run, not compile's pay-off
        return [int8_line(decoding.compiled, on, decoding.dtype)]
    if compile_asked:
        return [compile_note(prompt_len, decoding.model.config.block_size,
                             sampling.max_new_tokens, num_samples, on_cpu=on == "cpu")]
    return []


def _told(pieces: Iterator[str], index: int, on_sample: OnSample | None) -> str:
    """The whole text of one sample, its pieces handed to `on_sample` as they come (what it
    leaves unread is read here)."""
    seen: list[str] = []

    def recorded() -> Iterator[str]:
        for piece in pieces:
            seen.append(piece)
            yield piece
    reading = recorded()
    if on_sample is not None:
        on_sample(index, reading)
    for _ in reading:
        pass
    return "".join(seen)


def chat_prompt(run: Run, message: str, system: str | None,
                spell: arguments.Spell = arguments.as_argument) -> _Prompt:
    """The text the run's model reads for `message` (after `system`), rendered through its
    chat template, and what a reply ends with: its text, and its token id where it is one token
    (glassgpt's own template's `<|end|>` is several in a character or small BPE vocabulary: the
    reply then stops at the text)."""
    chat = run.chat_template()
    if chat is None:
        raise ConfigError(f"{run.dir} has no chat template (only a run imported from an "
                          f"instruct model that has one does); continue text with "
                          f"{spell('prompt')} instead")
    ids = [] if chat.end_of_turn is None else run.tokenizer().encode(chat.end_of_turn)
    if not ids:
        raise CheckpointError(f"{run.dir}: the chat template has no end-of-turn text the run's "
                              f"tokenizer can write ({chat.end_of_turn!r:.40}); a reply could "
                              f"not stop")
    stop_token = ids[0] if len(ids) == 1 else None
    return _Prompt(chat.render(chat_messages(message, system)), chat.end_of_turn, stop_token)


# --- what decoding costs, said before it starts ------------------------------------------------

def int8_line(compiled: bool, device: str, dtype: str = "int8") -> str:
    """`sample --dtype int8` (or int4)'s start line: what was quantized, and how its products
    run: the block kernel uncompiled (first token at once, for a model of any size), the step
    compiled first where asked, or the torch reference where the kernel is not to be had."""
    note = BLOCK_NOTES[dtype]
    if device != "cpu" or blockdot() is None:
        where = "off a CPU" if device != "cpu" else "without a C compiler"
        return f"{note}; {where}, in the torch reference (slow: each product written out)"
    if compiled:
        return f"{note}; the step compiled first (--compile), the kernel inside it"
    return f"{note}, the block kernel built for this CPU; decoding uncompiled"


def compile_note(prompt_len: int, block_size: int, new_tokens: int, samples: int,
                 on_cpu: bool = True) -> str:
    """What --compile is about to cost, and whether this sample can win it back on a CPU."""
    # Cached steps: the first token comes from the prompt's pass, and past the context each
    # token recomputes the window instead.
    steps = samples * max(0, min(new_tokens - 1, block_size - prompt_len))
    doing = ("compiling the decoding step (measured 40-75 s on 2 shared cores, a third of "
             "that once torch has it cached; longer on a busier machine)")
    if steps >= COMPILE_PAYS_OFF_STEPS or not on_cpu:
        return doing
    return (f"{doing}; note: it speeds up only the steps inside the {block_size}-token context, "
            f"{steps:,} here, and pays off after about {COMPILE_PAYS_OFF_STEPS:,}: this sample "
            f"is faster without --compile")
