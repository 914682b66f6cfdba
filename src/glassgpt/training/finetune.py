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

With `lora` (glassgpt.adapters.settings.LoraSettings) only low-rank adapters train, the base
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
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glassgpt.adapters.lora import (
    add_lora,
    apply_run_adapter,
    load_lora_state_dict,
    run_adapter_files,
)
from glassgpt.adapters.settings import LoraSettings
from glassgpt.config import TrainConfig
from glassgpt.data.sft import (
    ConversationSampler,
    ConversationSet,
    encode_conversations,
    read_conversations,
    show_mask,
    simple_template,
)
from glassgpt.errors import ConfigError, InputError
from glassgpt.machine.devices import AUTO, cpu_bf16_support, resolve_device
from glassgpt.machine.memory import return_large_buffers
from glassgpt.model import GPT, count_parameters
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.rundir import directory as rundir
from glassgpt.storage import files
from glassgpt.storage.layout import CHAT_TEMPLATE_FILE
from glassgpt.tokenizers import Tokenizer
from glassgpt.tokenizers.chat import ChatTemplate
from glassgpt.training import arguments, lifecycle, runs
from glassgpt.training.metrics import Reporter
from glassgpt.training.steps import fused_loss, recompute_blocks
from glassgpt.training.trainer import Trainer, TrainResult

VAL_FRACTION = 0.1  # of the conversations held out for the val loss, without val_sft
BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # and "auto"
# Tokens a training window holds by default: the longest conversation's, at most the model's
# context and this. An imported model's context (Qwen3's 40,960) would pad a few conversations
# into one window a laptop cannot train.
DEFAULT_SEQ_LEN = 1024
# What a tune derives from its data where the user set nothing, chosen by measurement
# (docs/finetune.md, "The defaults, measured"): the steps are TUNE_EPOCHS passes over the
# conversations' tokens, at least MIN_TUNE_ITERS (a small set needs many passes) and at most
# MAX_TUNE_ITERS; under LoRA the peak lr is LORA_LR_FACTOR times a whole-model tune's (the
# adapters start at zero and are few: they take larger steps, ~10x in the literature).
TUNE_EPOCHS = 3
MIN_TUNE_ITERS = 2000
MAX_TUNE_ITERS = 4000
LORA_LR_FACTOR = 10


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
    window: int = 0  # tokens of a training window, once chosen (default_window)

    @property
    def longest(self) -> int:
        """Tokens of the longest conversation, of either split."""
        return max(len(e.ids) for split in self.splits.values() for e in split.examples)

    @property
    def train_tokens(self) -> int:
        """Tokens of the training conversations packed end to end: one pass over them."""
        return sum(len(e.ids) for e in self.splits["train"].examples)

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


@dataclass
class FinetuneRequest(lifecycle.TrainRequest):
    """A fine-tune's request: train_run's (`init_from` is the run it starts from) with the
    conversations and how the weights train (`finetune_run` says what each is)."""

    sft: str | Path | None = None
    val_sft: str | Path | None = None
    lora: LoraSettings | None = None
    adapter: tuple[LoraSettings, dict[str, Any]] | None = None
    recompute: bool = False
    base_dtype: str = "auto"
    seq_len: int | None = None


def finetune_run(source: str | Path | None, sft: str | Path | None, out: str | Path, *,
                 val_sft: str | Path | None = None, train: dict[str, Any] | None = None,
                 lora: LoraSettings | None = None,
                 adapter: tuple[LoraSettings, dict[str, Any]] | None = None,
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
    what glassgpt.formats.peft.read_adapter reads from a peft directory) starts the LoRA tune
    from those adapters instead of new ones. `recompute` keeps only each block's input for the
    backward and computes the rest again there (kept for a resume). `base_dtype` (auto,
    float32, bfloat16) is the frozen base's under LoRA; auto is bf16 where the device has bf16
    matrix instructions (module docstring). `seq_len` is the tokens of a training window
    (default: the model's context, at most DEFAULT_SEQ_LEN; kept for a resume). Raises
    glassgpt.errors exceptions, having changed nothing, for bad input."""
    spell = arguments.spelling(wording)
    out = files.check_path_given(out, ConfigError, spell("out"))
    return_large_buffers()  # freed activations go back to the OS, not into a fragmented heap
    request = FinetuneRequest(out, dict(train or {}), force, init_from=source,
                              checkpoint=checkpoint, threads=threads, reporter=reporter,
                              stop=stop, on_start=on_start, spell=spell, sft=sft,
                              val_sft=val_sft, lora=lora, adapter=adapter, recompute=recompute,
                              base_dtype=base_dtype, seq_len=seq_len)
    _check_request(request, resume)
    if resume:
        return _resume(request)
    if source is None or sft is None:
        raise ConfigError("a fine-tune needs the run to start from and the conversations "
                          f"({spell('sft')})")
    return _start(request)


def _check_request(request: FinetuneRequest, resume: bool) -> None:
    """Settings that cannot go together, or of the wrong kind: refused before anything is
    read."""
    spell, seq_len = request.spell, request.seq_len
    if request.lora is not None and request.adapter is not None:
        raise ConfigError("an adapter to start from brings its own LoRA settings; drop "
                          f"{spell('lora_rank')} and the other LoRA settings")
    if request.base_dtype != "auto" and request.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"{spell('base_dtype')} must be auto, float32 or bfloat16, got "
                          f"{request.base_dtype!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)
                                or seq_len < 1):
        raise ConfigError(f"{spell('seq_len')} must be a positive number of tokens, got "
                          f"{seq_len!r}")
    if resume and (request.lora is not None or request.adapter is not None
                   or request.base_dtype != "auto" or seq_len is not None):
        raise ConfigError("a resumed fine-tune keeps its own LoRA settings, base dtype and "
                          "window; drop them")


def _start(request: FinetuneRequest) -> FinetuneOutcome:
    out, source_dir, spell = request.out, Path(request.init_from), request.spell
    rundir.check_out_dir(out, request.force, source_dir, spell)
    source = ckpt.Run(source_dir)
    data = sft_data(source, request.sft, request.val_sft)
    block_size = source.model_config.block_size
    if request.seq_len is not None and request.seq_len > block_size:
        raise ConfigError(f"{spell('seq_len')} {request.seq_len} is more than the model's "
                          f"context ({block_size})")
    window = data.window = request.seq_len or default_window(data, block_size)
    adapted = request.lora is not None or request.adapter is not None
    cfg = tune_config(source, request.train, data.train_tokens, window, adapted)
    dtype = frozen_base_dtype(request.base_dtype, adapted, resolve_device(cfg.device), spell)
    model, lora = _model_to_tune(source, request, dtype)
    # The conversation files and the source by absolute path: `eval RUN2` reads them again,
    # and a resume checks its RUN against the source, from anywhere.
    val_sft = None if request.val_sft is None else str(Path(request.val_sft).absolute())
    extra = {"preset": None, "init_from": str(source_dir.absolute()),
             "sft": str(Path(request.sft).absolute()), "recompute": request.recompute,
             "val_sft": val_sft, "chat_template": data.template_source,
             "lora": None if lora is None else dataclasses.asdict(lora),
             "base_dtype": str(dtype).removeprefix("torch."), "seq_len": window}
    trainer = _trainer(model, cfg, data, request, extra)
    start = lifecycle.TrainStart(
        "fine-tune", out, data.dir, trainer.device, cfg, describe_tuned_model(model),
        None, trainer.describe_threads(), 0,
        f"{source.dir} from {source.describe_weights(request.checkpoint)}",
        lifecycle.recipe_warnings(cfg) + data.notes)
    with rundir.writing(out):
        rundir.check_still_free(out, request.force, spell)
        if request.on_start is not None:
            request.on_start(start, data)
        result = trainer.run()
    return FinetuneOutcome(out, "fine-tune", result, start, data)


def default_window(data: SFTData, block_size: int) -> int:
    """The tokens of a training window when seq_len is not given: the longest conversation's
    (a window then holds any one whole; a fixed 256 would pack a dozen 20-token conversations
    into each step), at most the model's context and DEFAULT_SEQ_LEN."""
    return min(data.longest, block_size, DEFAULT_SEQ_LEN)


def default_iterations(train_tokens: int, tokens_per_step: int) -> int:
    """The steps of a tune when max_iters is not given: TUNE_EPOCHS passes over the
    conversations' `train_tokens`, `tokens_per_step` a step, within [MIN_TUNE_ITERS,
    MAX_TUNE_ITERS]."""
    passes = -(-TUNE_EPOCHS * train_tokens // tokens_per_step)
    return max(MIN_TUNE_ITERS, min(MAX_TUNE_ITERS, passes))


def tune_config(source: ckpt.Run, train: dict[str, Any], train_tokens: int, window: int,
                adapted: bool) -> TrainConfig:
    """The recipe of a tune (lifecycle.finetune_config: the source's, a tenth of its lr), with
    what the data decides where `train` (the user's settings) says nothing: the steps from
    the conversations' size (default_iterations; the lr then decays over them), and under
    LoRA (`adapted`), unless the lr is given, an lr and min_lr LORA_LR_FACTOR times higher."""
    preset = runs.preset_for_device(train.get("device", AUTO))
    cfg = lifecycle.finetune_config(source, preset, None, train)
    if "max_iters" not in train:
        steps = default_iterations(train_tokens, cfg.batch_size * cfg.grad_accum * window)
        derived = {"max_iters": steps, **({} if "lr_decay_iters" in train
                                          else {"lr_decay_iters": 0})}
        cfg = lifecycle.finetune_config(source, preset, None, {**train, **derived})
    if adapted and "lr" not in train:
        faster = {name: getattr(cfg, name) * LORA_LR_FACTOR for name in ("lr", "min_lr")
                  if name not in train}
        cfg = dataclasses.replace(cfg, **faster)
    return cfg


def _model_to_tune(source: ckpt.Run, request: FinetuneRequest, dtype: torch.dtype
                   ) -> tuple[GPT, LoraSettings | None]:
    """The source's model to train, its base in `dtype`, with its LoRA adapters (new, or read
    from `request.adapter`) where asked, and the LoRA settings it trains with."""
    lora = request.lora
    model = source.load_model(checkpoint=request.checkpoint, dtype=dtype)[0].train()
    if request.adapter is not None:
        lora, tensors = request.adapter
        add_lora(model, lora)  # a target the model lacks is refused here, before training
        load_lora_state_dict(model, tensors)
    elif lora is not None:
        add_lora(model, lora)
    _save_memory(model, request.recompute)
    return model, lora


def _resume(request: FinetuneRequest) -> FinetuneOutcome:
    out = request.out
    files.check_unlocked(out, ckpt.CheckpointError)
    validated = rundir.fingerprint(out)
    run = ckpt.Run(out)
    recorded = run.extra.get("sft")
    if recorded is None:
        raise ConfigError(f"{out} was not fine-tuned on conversations; continue it with "
                          f"`glassgpt train --resume --out {out}`")
    cfg = lifecycle.resumed_config(run, None, None, request.init_from, {}, request.train,
                                   request.spell)  # RUN checked
    sft = request.sft if request.sft is not None else recorded
    val_sft = request.val_sft if request.val_sft is not None else run.extra.get("val_sft")
    rundir.check_recoverable(out)
    data = sft_data(run, sft, val_sft)
    model = _resumed_model(run)
    _save_memory(model, bool(run.extra.get("recompute")))
    trainer = _trainer(model, cfg, data, request, run.extra)  # its window
    data.window = trainer.window
    trainer.resume(weights=False, run=run)
    start = lifecycle.TrainStart("resume", out, data.dir, trainer.device, cfg,
                                 describe_tuned_model(model), None,
                                 trainer.describe_threads(), trainer.state.iteration)
    if trainer.state.iteration >= cfg.max_iters:
        return FinetuneOutcome(out, "nothing", None, start, data)
    with rundir.writing(out):
        rundir.continue_run(out, validated)
        if request.on_start is not None:
            request.on_start(start, data)
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


def _trainer(model: GPT, cfg: TrainConfig, data: SFTData, request: FinetuneRequest,
             extra: dict[str, Any]) -> Trainer:
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
    return Trainer(model, cfg, data, request.out, request.reporter,  # type: ignore[arg-type]
                   threads=request.threads, stop=request.stop, extra=extra, batches=batches,
                   more_files=more_files, window=window)


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
