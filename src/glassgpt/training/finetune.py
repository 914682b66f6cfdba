"""Supervised fine-tuning on conversations, as one library call: what `glassgpt finetune` does.

    from glassgpt.training.finetune import finetune_run

    done = finetune_run("runs/tiny", "chats.jsonl", "runs/tuned", train={"max_iters": 100})
    done = finetune_run(None, "chats.jsonl", "runs/tuned", resume=True,
                        train={"max_iters": 200})                      # continue it

The conversations are rendered through the source run's chat template (glassgpt's own simple
template for a run that has none) and trained on the assistant's tokens only
(glassgpt.data.sft). The trainer is `train`'s own (glassgpt.training.trainer.Trainer), so the
schedule, the evaluations, Ctrl-C saving, atomic commits and `resume` work as they do there; only
its batches differ: windows of packed conversations whose targets are -1 outside the assistant's
replies. The val loss is the loss on assistant tokens of held-out conversations: the last tenth
of the file (at least one; none when the file holds a single conversation, which then serves
both), or the conversations of `val_sft`.

The new run is a whole run: its config, tokenizer and chat template (the template it was tuned
with, so that `sample --chat` renders what it learnt) are in every checkpoint. The recipe is the
source's with a fine-tune's defaults (a tenth of its lr; see lifecycle.finetune_config).

With `lora` (glassgpt.adapters.lora.LoraSettings) only low-rank adapters train, the base
weights frozen: the run's model.safetensors (and best.safetensors) hold the base weights as
they were, and each checkpoint commits the adapters beside them, in the same commit
(adapter.json and adapter.safetensors: glassgpt.adapters.lora; `glassgpt convert --to-hf
--adapter` writes them in peft's format). They
are the last ones (an adapter's best is not kept apart); `load_model` of the run merges them
in. Resuming reads the base and the adapters back, unmerged.

A LoRA tune keeps its frozen base in bf16 where the device has bf16 matrix instructions
(`base_dtype="auto"`; the adapters and their optimizer stay float32): half the memory of the
weights, and faster products on such a CPU. The tuned run then stores that bf16 base, the
weights the adapters were trained against; `load_model` reads it as float32 and merges there.
The loss is always computed chunk by chunk with its gradient (training.steps.fused_loss), so a
large vocabulary's logits never exist whole.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glassgpt.adapters.lora import (
    add_lora,
    apply_run_adapter,
    load_lora_state_dict,
    run_adapter_files,
)
from glassgpt.config import TrainConfig
from glassgpt.data.sft import (
    IGNORED,
    ConversationSampler,
    ConversationSet,
    encode_conversations,
    read_conversations,
    show_mask,
    simple_template,
)
from glassgpt.errors import ConfigError, InputError
from glassgpt.machine.devices import AUTO, cpu_bf16_support, resolve_device, timed, tuner_for
from glassgpt.machine.memory import return_large_buffers
from glassgpt.model import GPT, count_parameters, eval_mode
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.rundir import directory as rundir
from glassgpt.storage import files
from glassgpt.storage.layout import CHAT_TEMPLATE_FILE
from glassgpt.tokenizers import Tokenizer
from glassgpt.tokenizers.chat import ChatTemplate
from glassgpt.training import arguments, lifecycle, runs
from glassgpt.training.evaluate import MAX_LOSS, Evaluation, eval_batch_size, eval_context
from glassgpt.training.metrics import Reporter
from glassgpt.training.steps import fused_loss, recompute_blocks
from glassgpt.training.trainer import Trainer, TrainResult

VAL_FRACTION = 0.1  # of the conversations held out for the val loss, without val_sft
BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # and "auto"
# Tokens a training window holds by default: the model's context up to this. An imported model's
# context (Qwen3's 40,960) would pad a few conversations into one window a laptop cannot train.
DEFAULT_SEQ_LEN = 1024


@dataclass
class SFTData:
    """The conversations to train and evaluate on, in the shape the Trainer reads data
    (PreparedData's `dir`, `tokenizer` and `check_block_size`); `dir` is the conversation file,
    recorded as the run's data."""

    dir: Path
    tokenizer: Tokenizer
    chat: ChatTemplate
    template_source: str  # "the run's" or "glassgpt's simple"
    splits: dict[str, ConversationSet]
    notes: list[str] = field(default_factory=list)

    def check_block_size(self, block_size: int) -> None:
        """Any length works: a short stream is padded (glassgpt.data.sft)."""

    def batches(self, block_size: int, batch_size: int, device: torch.device
                ) -> Callable[[str, int], ConversationSampler]:
        """What the Trainer calls to draw each split's batches."""
        streams = {split: conversations.stream() for split, conversations in self.splits.items()}

        def sampler(split: str, seed: int) -> ConversationSampler:
            ids, trained = streams[split]
            return ConversationSampler(ids, trained, block_size, batch_size, seed, device)
        return sampler


def run_chat_template(run: ckpt.Run) -> tuple[ChatTemplate, str]:
    """The template a run chats with, and whose it is: the run's own, else glassgpt's."""
    chat = run.chat_template()
    return (chat, "the run's") if chat is not None else (simple_template(), "glassgpt's simple")


def sft_data(run: ckpt.Run, sft: str | Path, val_sft: str | Path | None = None) -> SFTData:
    """The conversations of `sft` (and `val_sft`) encoded for `run`: every line checked and
    every conversation rendered before any training starts."""
    chat, source = run_chat_template(run)
    source = run.extra.get("chat_template", source)  # a fine-tune's own: the one it was given
    tokenizer = run.tokenizer()
    train = encode_conversations(read_conversations(sft), chat, tokenizer)
    if not train.examples:
        raise InputError(f"{sft}: no conversation has an assistant reply to train on")
    notes = []
    if val_sft is not None:
        val = encode_conversations(read_conversations(val_sft), chat, tokenizer)
        if not val.examples:
            raise InputError(f"{val_sft}: no conversation has an assistant reply to "
                             f"evaluate on")
    elif len(train.examples) > 1:  # the last tenth of those with a reply, at least one
        held = max(1, round(len(train.examples) * VAL_FRACTION))
        val = ConversationSet(train.examples[-held:], [])
        train = ConversationSet(train.examples[:-held], train.skipped)
    else:
        val = train
        notes.append("one conversation only: the val loss is measured on it too")
    return SFTData(Path(sft), tokenizer, chat, source, {"train": train, "val": val}, notes)


def mask_preview(source: str | Path, sft: str | Path) -> str:
    """The first conversation of `sft` with an assistant reply, as `source`'s template renders
    it, its trained tokens in [[ ]] (glassgpt.data.sft.show_mask)."""
    run = ckpt.Run(source)
    chat, _ = run_chat_template(run)
    encoded = encode_conversations(read_conversations(sft), chat, run.tokenizer())
    if not encoded.examples:
        raise InputError(f"{sft}: no conversation has an assistant reply")
    return show_mask(encoded.examples[0], run.tokenizer())


# --- the run -----------------------------------------------------------------------------------

@dataclass
class FinetuneOutcome:
    run_dir: Path
    action: str  # "fine-tune", "resume", or "nothing" (the run is at max_iters already)
    result: TrainResult | None
    start: lifecycle.TrainStart
    data: SFTData


def finetune_run(source: str | Path | None, sft: str | Path | None, out: str | Path, *,
                 val_sft: str | Path | None = None, train: dict[str, Any] | None = None,
                 lora: Any = None, adapter: tuple[Any, dict[str, Any]] | None = None,
                 recompute: bool = False, base_dtype: str = "auto",
                 seq_len: int | None = None, resume: bool = False,
                 force: bool = False,
                 checkpoint: str = "best", threads: int | str | None = AUTO,
                 reporter: Reporter | None = None, stop: threading.Event | None = None,
                 on_start: Callable[[lifecycle.TrainStart, SFTData], Any] | None = None,
                 wording: str = "api") -> FinetuneOutcome:
    """Fine-tune run `source` on the conversations of `sft` into the new run `out`, or (with
    `resume`) continue `out` (its recorded conversation files unless given). `train` holds
    TrainConfig settings by name. `adapter` (LoraSettings, tensors in lora_state_dict's names:
    what glassgpt.hf.adapter.read_adapter reads from a peft directory) starts the LoRA tune from
    those adapters instead of new ones. `recompute` keeps only each block's input for the
    backward and computes the rest again there (kept for a resume). `base_dtype` (auto,
    float32, bfloat16) is the frozen base's under LoRA; auto is bf16 where the device has bf16
    matrix instructions (module docstring). `seq_len` is the tokens of a training window
    (default: the model's context, at most DEFAULT_SEQ_LEN; kept for a resume). Raises
    glassgpt.errors
    exceptions, having changed nothing, for bad input."""
    spell = arguments.spelling(wording)
    out = files.check_path_given(out, ConfigError, spell("out"))
    return_large_buffers()  # freed activations go back to the OS, not into a fragmented heap
    if lora is not None and adapter is not None:
        raise ConfigError("an adapter to start from brings its own LoRA settings; drop "
                          f"{spell('lora_rank')} and the other LoRA settings")
    if base_dtype != "auto" and base_dtype not in BASE_DTYPES:
        raise ConfigError(f"{spell('base_dtype')} must be auto, float32 or bfloat16, got "
                          f"{base_dtype!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)
                                or seq_len < 1):
        raise ConfigError(f"{spell('seq_len')} must be a positive number of tokens, got "
                          f"{seq_len!r}")
    if resume:
        if lora is not None or adapter is not None or base_dtype != "auto" \
                or seq_len is not None:
            raise ConfigError("a resumed fine-tune keeps its own LoRA settings, base dtype and "
                              "window; drop them")
        return _resume(out, source, sft, val_sft, dict(train or {}), threads, reporter,
                       stop, on_start, spell)
    if source is None or sft is None:
        raise ConfigError("a fine-tune needs the run to start from and the conversations "
                          f"({spell('sft')})")
    return _start(Path(source), sft, out, val_sft, dict(train or {}), force, checkpoint,
                  threads, reporter, stop, on_start, spell, lora, adapter, recompute,
                  base_dtype, seq_len)


def _start(source_dir: Path, sft: str | Path, out: Path, val_sft: str | Path | None,
           train: dict[str, Any], force: bool, checkpoint: str, threads: int | str | None,
           reporter: Reporter | None, stop: threading.Event | None,
           on_start: Callable | None, spell: arguments.Spell, lora: Any,
           adapter: tuple[Any, dict[str, Any]] | None, recompute: bool,
           base_dtype: str, seq_len: int | None) -> FinetuneOutcome:
    rundir.check_out_dir(out, force, source_dir, spell)
    source = ckpt.Run(source_dir)
    cfg = lifecycle.finetune_config(source, runs.preset_for_device(train.get("device", AUTO)),
                                    None, train)
    data = sft_data(source, sft, val_sft)
    adapted = lora is not None or adapter is not None
    dtype = frozen_base_dtype(base_dtype, adapted, resolve_device(cfg.device), spell)
    model = source.load_model(checkpoint=checkpoint, dtype=dtype)[0].train()
    if adapter is not None:
        lora, tensors = adapter
        _add_adapters(model, lora, source_dir)
        load_lora_state_dict(model, tensors)
    elif lora is not None:
        _add_adapters(model, lora, source_dir)
    _save_memory(model, recompute)
    block_size = model.config.block_size
    if seq_len is not None and seq_len > block_size:
        raise ConfigError(f"{spell('seq_len')} {seq_len} is more than the model's context "
                          f"({block_size})")
    window = seq_len or min(block_size, DEFAULT_SEQ_LEN)
    # The conversation files by absolute path: `eval RUN2` reads them again from anywhere.
    extra = {"preset": None, "init_from": str(source_dir), "sft": str(Path(sft).absolute()),
             "recompute": recompute,
             "val_sft": None if val_sft is None else str(Path(val_sft).absolute()),
             "chat_template": data.template_source,
             "lora": None if lora is None else dataclasses.asdict(lora),
             "base_dtype": str(dtype).removeprefix("torch."), "seq_len": window}
    trainer = _trainer(model, cfg, data, out, reporter, threads, stop, extra)
    start = lifecycle.TrainStart(
        "fine-tune", out, data.dir, trainer.device, cfg, describe_tuned_model(model),
        None, trainer.describe_threads(), 0,
        f"{source.dir} from {source.describe_weights(checkpoint)}",
        lifecycle.recipe_warnings(cfg) + data.notes)
    with rundir.writing(out):
        rundir.check_still_free(out, force, spell)
        if on_start is not None:
            on_start(start, data)
        result = trainer.run()
    return FinetuneOutcome(out, "fine-tune", result, start, data)


def _resume(out: Path, source: str | Path | None, sft: str | Path | None,
            val_sft: str | Path | None,
            train: dict[str, Any], threads: int | str | None, reporter: Reporter | None,
            stop: threading.Event | None, on_start: Callable | None,
            spell: arguments.Spell) -> FinetuneOutcome:
    files.check_unlocked(out, ckpt.CheckpointError)
    validated = rundir.fingerprint(out)
    run = ckpt.Run(out)
    recorded = run.extra.get("sft")
    if recorded is None:
        raise ConfigError(f"{out} was not fine-tuned on conversations; continue it with "
                          f"`glassgpt train --resume --out {out}`")
    cfg = lifecycle.resumed_config(run, None, None, source, {}, train, spell)  # RUN checked
    sft = sft if sft is not None else recorded
    val_sft = val_sft if val_sft is not None else run.extra.get("val_sft")
    rundir.check_recoverable(out)
    data = sft_data(run, sft, val_sft)
    model = _resumed_model(run)
    _save_memory(model, bool(run.extra.get("recompute")))
    trainer = _trainer(model, cfg, data, out, reporter, threads, stop, run.extra)  # its window
    trainer.resume(weights=False, run=run)
    start = lifecycle.TrainStart("resume", out, data.dir, trainer.device, cfg,
                                 describe_tuned_model(model), None,
                                 trainer.describe_threads(), trainer.state.iteration)
    if trainer.state.iteration >= cfg.max_iters:
        return FinetuneOutcome(out, "nothing", None, start, data)
    with rundir.writing(out):
        rundir.continue_run(out, validated)
        if on_start is not None:
            on_start(start, data)
        result = trainer.run()
    return FinetuneOutcome(out, "resume", result, start, data)


def describe_tuned_model(model: GPT) -> str:
    """lifecycle.describe_model's line; under LoRA it says that the parameters that train are
    the adapters', of how many in all: "12,288 trainable adapter parameters of 0.82M, ..."."""
    line = lifecycle.describe_model(model)
    if getattr(model, "lora_settings", None) is None:
        return line
    every = sum(p.numel() for p in model.parameters())  # each tensor once, frozen or not
    shape = line.split(", ", 1)[1]  # "4 layers, 4 heads, ..."
    return (f"{lifecycle.parameters_text(count_parameters(model))} trainable adapter "
            f"parameters of {lifecycle.parameters_text(every)}, {shape}")


def _trainer(model: GPT, cfg: TrainConfig, data: SFTData, out: Path,
             reporter: Reporter | None, threads: int | str | None,
             stop: threading.Event | None, extra: dict[str, Any]) -> Trainer:
    """`train`'s Trainer, drawing packed conversations, committing the chat template (and
    any LoRA adapters) with every checkpoint (a run's first commit removes files it does not
    write)."""
    window = extra.get("seq_len") or model.config.block_size  # a run tuned before seq_len: all
    batches = data.batches(window, cfg.batch_size, resolve_device(cfg.device))
    template = {CHAT_TEMPLATE_FILE: data.chat.to_json().encode("utf-8")}
    tuned_with_lora = getattr(model, "lora_settings", None) is not None

    def more_files() -> dict[str, bytes]:
        if not tuned_with_lora:
            return template
        return {**template, **run_adapter_files(model)}
    return Trainer(model, cfg, data, out, reporter, threads=threads,  # type: ignore[arg-type]
                   stop=stop, extra=extra, batches=batches, more_files=more_files,
                   window=window)


def frozen_base_dtype(setting: str, adapted: bool, device: torch.device,
                      spell: arguments.Spell | None = None) -> torch.dtype:
    """The dtype the base is tuned in: float32 when all weights train (bf16 weights would
    round their updates away); under LoRA `setting`, where auto is bf16 on a CPU with bf16
    matrix instructions or a GPU that has bf16, else float32."""
    spell = spell or arguments.spelling("api")
    if not adapted:
        if setting == "bfloat16":
            raise ConfigError(f"{spell('base_dtype')} bfloat16 needs LoRA (all weights train "
                              f"otherwise, and bf16 weights round their updates away; "
                              f"{spell('dtype')} bfloat16 trains in mixed precision)")
        return torch.float32
    if setting != "auto":
        return BASE_DTYPES[setting]
    has_bf16 = (cpu_bf16_support() if device.type == "cpu"
                else device.type == "cuda" and torch.cuda.is_bf16_supported())
    return torch.bfloat16 if has_bf16 else torch.float32


def _save_memory(model: GPT, recompute: bool) -> None:
    """The loss a chunk at a time (always: the same numbers), and with `recompute` each
    block's activations made again in the backward."""
    fused_loss(model)
    if recompute:
        recompute_blocks(model)


def _add_adapters(model: GPT, lora: Any, source_dir: Path) -> None:
    """LoRA adapters on `model`, its base frozen (a target the model lacks is refused at once,
    before any training)."""
    add_lora(model, lora)


def _resumed_model(run: ckpt.Run) -> GPT:
    """The last checkpoint's weights (those its optimizer state belongs to), in train mode;
    a LoRA fine-tune's base with its adapters read back on, unmerged."""
    dtype = BASE_DTYPES[run.extra.get("base_dtype", "float32")]
    model = run.load_model(checkpoint="last", adapter=False, dtype=dtype)[0].train()
    if run.extra.get("lora") is not None:
        adapter = run.adapter_dir()
        if adapter is None:
            raise ckpt.CheckpointError(f"{run.dir} was fine-tuned with LoRA but holds no "
                                       f"adapter directory; it cannot be resumed")
        apply_run_adapter(model, adapter)
    return model


def summary_line(outcome: FinetuneOutcome) -> str:
    """The trainer's summary, with what the conversations gave."""
    train = outcome.data.splits["train"]
    skipped = len(train.skipped)
    note = (f"; {skipped} conversation{'s' if skipped != 1 else ''} without an assistant "
            f"reply skipped (lines {', '.join(map(str, train.skipped[:10]))})" if skipped else "")
    return (f"{lifecycle.summary_line(outcome.result, outcome.run_dir)}; "
            f"{len(train.examples)} conversations, {train.trained_tokens} assistant tokens "
            f"trained, {outcome.data.template_source} chat template{note}")


# --- evaluating a fine-tuned run --------------------------------------------------------------
# A fine-tune has no prepared corpus: its data is conversations. `glassgpt eval RUN2` measures
# what its val loss measured while it trained, the loss on the assistant's tokens of the
# held-out conversations (split "val"; "train": the others), packed as training packs them. The
# base corpus it came from (its source run's data) is `eval RUN2 --data DIR`.

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
