"""`glassgpt convert` as two library calls: a Hugging Face model into a run, a run back out.

    imported = import_run("gpt2", "runs/gpt2")        # a hub name or a save_pretrained dir
    exported = export_run("runs/mine", "exported/")   # the architecture the run has

Each checks everything before it writes, writes its directory whole or not at all, and returns
what the command line prints (ImportedRun, ExportedRun); neither prints anything itself. The
tensors move through glassgpt.formats.interop; the directories are read by glassgpt.formats.files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from glassgpt.adapters.lora import apply_run_adapter
from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError
from glassgpt.formats import interop
from glassgpt.formats.files import (
    MAX_TOKENIZER_BYTES,
    PADDING_LIMIT,
    UNUSED_TOKEN,
    HFDirectory,
    load_hf_tokenizer,
    name_padding_ids,
    open_hf_source,
)
from glassgpt.formats.peft import adapter_files
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import Run, describe_weights, load_model, save_model
from glassgpt.rundir.directory import commit_files
from glassgpt.storage import files
from glassgpt.storage.commit import staged_directory
from glassgpt.storage.layout import CHAT_TEMPLATE_FILE
from glassgpt.tokenizers import END_OF_TEXT, BPETokenizer, Tokenizer, tokenizer_from_json
from glassgpt.tokenizers.chat import ChatTemplate
from glassgpt.tokenizers.loading import tokenizer_from_hf

EXPORT_ADAPTER_DIR = "adapter"  # `convert --to-hf OUT --adapter`: the base in OUT, this in it


@dataclass(frozen=True)
class ImportedRun:
    """What `import_run` wrote: the run, its model's config, its tokenizer, and notes worth
    telling (padding ids named, a head untied) in words."""

    run_dir: Path
    config: GPTConfig
    tokenizer_kind: str
    tokenizer_size: int
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExportedRun:
    """What `export_run` wrote: the directory, which weights (in words), whether the run's
    tokenizer went with them (a character-level one has no Hugging Face equivalent), and the
    end-of-turn token of the chat template that went with it (an imported instruct model's;
    None when there was none)."""

    out: Path
    weights: str
    with_tokenizer: bool
    tokenizer_kind: str
    chat_end_of_turn: str | None = None
    adapter: Path | None = None  # the run's LoRA adapter, written apart (`adapter=True`)


def import_run(source: str | os.PathLike[str], out: str | os.PathLike[str],
               tokenizer_file: str | os.PathLike[str] | None = None,
               dropout: float | None = None) -> ImportedRun:
    """A run directory at `out` holding a HF model of a family glassgpt imports (GPT-2, the
    Llama family, Gemma, GPT-NeoX: glassgpt.formats.architectures' table; a hub name or a local
    save_pretrained directory) in float32, with the model's tokenizer or `tokenizer_file`.

    Everything is read and checked first; the run is written beside `out` and renamed into
    place whole, so a failure (a full disk) leaves no half-made directory. `out` must be new
    (or an empty directory) and outside the source directory.
    """
    out = Path(out).expanduser()
    files.check_can_make_dir(out, CheckpointError)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} already exists and is not empty; choose a new run "
                              f"directory so no run is overwritten")
    directory = open_hf_source(source)
    check_apart(out, directory.root, f"{directory.name}, the model being imported")
    # Runs train in float32 whatever precision the weights were published in.
    model = interop.from_hf(directory, dropout=dropout).float()
    notes = []
    if not model.config.tie_weights and directory.settings().tie_word_embeddings:
        notes.append(_untied_note(directory))
    tokenizer, padding_note = _source_tokenizer(directory, tokenizer_file,
                                                model.config.vocab_size)
    check_tokenizer_fits(tokenizer.vocab_size, model.config.vocab_size)
    chat = None if tokenizer_file is not None else directory.chat_template()
    if chat is not None:
        notes.append(_chat_note(chat, tokenizer))
        chat = chat if _ends_turns(chat, tokenizer) else None
    with staged_directory(out) as staging:
        save_model(staging, model, tokenizer, extra={"converted_from": str(source)})
        if chat is not None:  # a second commit in the staging directory: it appears whole
            commit_files(staging, {CHAT_TEMPLATE_FILE: chat.to_json().encode("utf-8")})
    return ImportedRun(out, model.config, tokenizer.kind, tokenizer.vocab_size,
                       tuple(notes + padding_note))


def _ends_turns(chat: ChatTemplate, tokenizer: Tokenizer) -> bool:
    """Whether the template's end-of-turn token is one token of the tokenizer: where
    `sample --chat` stops a reply. A template without one is not kept."""
    return chat.end_of_turn is not None and len(tokenizer.encode(chat.end_of_turn)) == 1


def _chat_note(chat: ChatTemplate, tokenizer: Tokenizer) -> str:
    if _ends_turns(chat, tokenizer):
        return f"kept its chat template (`sample --chat`; a reply ends at {chat.end_of_turn})"
    return (f"its chat template is not kept: its end-of-turn token (tokenizer_config.json's "
            f"eos_token, {chat.end_of_turn!r:.40}) is not one token of the tokenizer, so a "
            f"reply could not stop")


def export_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str],
               checkpoint: str = "best", force: bool = False,
               adapter: bool = False) -> ExportedRun:
    """A save_pretrained directory at `out` of the run's `checkpoint` weights ("best" or
    "last"), with its tokenizer when that is BPE (see interop.save_hf). `force` replaces an
    earlier export of glassgpt's there, nothing else; `out` must be outside the run.

    A run holding a LoRA adapter is exported merged (one model); with `adapter`, its base
    goes to `out` and the adapter, in peft's format, to `out`/adapter
    (`PeftModel.from_pretrained(base, out/adapter)`)."""
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    files.check_can_make_dir(out, CheckpointError)  # before the work, not after it
    check_apart(out, run_dir, f"{run_dir}, the run being exported")
    model, tokenizer = load_model(run_dir, checkpoint=checkpoint, adapter=not adapter)
    # read and checked before anything is written: the export then cannot fail half way
    adapter_contents = _adapter_contents(run_dir, model, out) if adapter else None
    weights = describe_weights(run_dir, checkpoint)
    with_tokenizer = isinstance(tokenizer, BPETokenizer)
    if with_tokenizer:
        # An imported instruct model's template and end-of-turn token go back out with it.
        chat = Run(run_dir).chat_template()
        interop.save_hf(model, out, tokenizer=tokenizer.tokenizer, eos_token=END_OF_TEXT,
                        overwrite=force, chat=chat)
    else:
        chat = None
        interop.save_hf(model, out, overwrite=force)
    if adapter_contents is not None:
        with staged_directory(out / EXPORT_ADAPTER_DIR) as staging:
            for name, data in adapter_contents.items():
                (staging / name).write_bytes(data)
    return ExportedRun(out, weights, with_tokenizer, tokenizer.kind,
                       None if chat is None else chat.end_of_turn,
                       out / EXPORT_ADAPTER_DIR if adapter else None)


def _adapter_contents(run_dir: Path, model: GPT, base: Path) -> dict[str, bytes]:
    """The run's adapter as peft's files for the export at `base`; `model` stays the base
    (the adapters added to it are kept apart from its weights)."""
    found = Run(run_dir).adapter_dir()
    if found is None:
        raise CheckpointError(f"{run_dir} holds no LoRA adapter (adapter.json); "
                              f"export it without --adapter")
    apply_run_adapter(model, found)
    return adapter_files(model, base_model=str(base))


def check_apart(out: Path, source: Path, what: str) -> None:
    """`out` may not be, hold or lie inside `source` (what is read while `out` is written)."""
    mine, theirs = out.resolve(), source.resolve()
    if mine == theirs or mine.is_relative_to(theirs) or theirs.is_relative_to(mine):
        raise CheckpointError(f"{out} overlaps {what}; write it to a directory outside "
                              f"{source}")


def check_tokenizer_fits(tokenizer_size: int, vocab_size: int) -> None:
    """A run's tokenizer must name every id its model can emit, and only those: a smaller one
    would let `sample` draw an id it cannot decode (a BPE tokenizer a padding smaller has
    its padding ids named first, see _source_tokenizer), a larger one holds tokens the model
    can never emit."""
    if tokenizer_size > vocab_size:
        raise CheckpointError(f"the tokenizer has {tokenizer_size:,} tokens but the model's "
                              f"vocab_size is {vocab_size:,}: the model could never emit the "
                              f"other {tokenizer_size - vocab_size:,}; give a tokenizer of at "
                              f"most {vocab_size:,} tokens (--tokenizer FILE)")
    if tokenizer_size < vocab_size:
        raise CheckpointError(f"the tokenizer has {tokenizer_size:,} tokens but the model's "
                              f"vocab_size is {vocab_size:,}; give a tokenizer of exactly "
                              f"{vocab_size:,} tokens, or a BPE tokenizer.json at most "
                              f"{PADDING_LIMIT:,} smaller (the ids past it are named as "
                              f"padding) (--tokenizer FILE)")


def _untied_note(directory: HFDirectory) -> str:
    return (f"{directory.name}'s config.json says tie_word_embeddings=true, but its "
            f"lm_head.weight is not its embedding: imported with that head, untied (as "
            f"transformers loads it)")


def _source_tokenizer(directory: HFDirectory,
                      tokenizer_file: str | os.PathLike[str] | None,
                      vocab_size: int) -> tuple[Tokenizer, list[str]]:
    """`tokenizer_file`, or else the model's own tokenizer; when it is BPE and a padding
    smaller than the model's vocabulary, with its padding ids named (see
    glassgpt.formats.files.name_padding_ids), and the note saying so."""
    if tokenizer_file is not None:
        tokenizer = _user_tokenizer(Path(tokenizer_file))
        hf_tokenizer = tokenizer.tokenizer if isinstance(tokenizer, BPETokenizer) else None
    else:
        hf_tokenizer = load_hf_tokenizer(directory)
        if hf_tokenizer is None:
            raise CheckpointError(f"{directory.name} has no tokenizer (tokenizer.json, or "
                                  f"vocab.json and merges.txt); pass one with --tokenizer "
                                  f"FILE")
        # The checks `sample` makes when it reads the run's tokenizer back, made here first.
        tokenizer = tokenizer_from_hf(hf_tokenizer, f"the tokenizer of {directory.name}")
    named = 0 if hf_tokenizer is None else name_padding_ids(hf_tokenizer, vocab_size)
    if not named:
        return tokenizer, []
    return tokenizer, [f"the tokenizer has {vocab_size - named:,} tokens and the model "
                       f"{vocab_size:,} ids; the {named:,} ids past the tokenizer (padding) "
                       f"decode as {UNUSED_TOKEN.format(id='ID')}"]


def _user_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer file the user named (a link to it is fine), read bounded."""
    if not path.exists():
        raise CheckpointError(f"tokenizer file not found: {path}")
    text = files.read_text(path.resolve(), MAX_TOKENIZER_BYTES, CheckpointError)
    files.parse_json(text, str(path), CheckpointError)
    return tokenizer_from_json(text, source=str(path))
