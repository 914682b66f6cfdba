"""`glassgpt convert`: Hugging Face GPT-2 weights into a run directory, and back out.

    glassgpt convert --from-hf NAME_OR_DIR --out RUN_DIR   # hub name (e.g. gpt2) or local dir
    glassgpt convert RUN_DIR --to-hf OUT_DIR               # a save_pretrained directory

Exporting, and downloading a hub name, need the optional extra `hf` (transformers); importing a
local directory needs nothing more, because glassgpt reads it itself (safetensors only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from glassgpt import files, interop
from glassgpt.checkpoint import describe_weights, load_model, save_model
from glassgpt.cli.common import add_checkpoint_flag, say
from glassgpt.errors import CheckpointError, CommandLineError
from glassgpt.hf_files import MAX_TOKENIZER_BYTES
from glassgpt.tokenizers import END_OF_TEXT, BPETokenizer, Tokenizer, tokenizer_from_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="import or export Hugging Face GPT-2 weights",
        description="Import a Hugging Face GPT-2 (hub name or save_pretrained directory) into a "
                    "run directory, or export a run to a save_pretrained directory. Needs "
                    f"{interop.INSTALL_HINT}.")
    parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                        help="run directory to export (with --to-hf)")
    parser.add_argument("--from-hf", metavar="NAME_OR_DIR",
                        help="hub model name (e.g. gpt2) or a save_pretrained directory")
    parser.add_argument("--out", metavar="RUN_DIR", help="new run directory for --from-hf")
    parser.add_argument("--to-hf", metavar="OUT_DIR", help="new save_pretrained directory")
    parser.add_argument("--tokenizer", metavar="FILE",
                        help="tokenizer file for --from-hf when the model comes without one "
                             "(a tokenizer.json or a glassgpt tokenizer)")
    add_checkpoint_flag(parser, "export with --to-hf")
    parser.add_argument("--force", action="store_true",
                        help="with --to-hf, replace an earlier export in OUT_DIR")
    parser.add_argument("--dropout", type=float, default=None,
                        help="dropout of the imported model (default: the model's own)")
    parser.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    _hide_hf_progress_bars()
    importing = args.from_hf is not None or args.out is not None
    exporting = args.run_dir is not None or args.to_hf is not None
    if importing == exporting:
        raise CommandLineError("convert: give either --from-hf NAME_OR_DIR --out RUN_DIR, or "
                               "RUN_DIR --to-hf OUT_DIR")
    if importing:
        if args.from_hf is None or args.out is None:
            raise CommandLineError("convert: --from-hf and --out go together")
        if args.force:
            raise CommandLineError("convert: --force applies to --to-hf only (an import "
                                   "never replaces a run)")
        return import_from_hf(args.from_hf, Path(args.out), args.tokenizer, args.dropout)
    if args.run_dir is None or args.to_hf is None:
        raise CommandLineError("convert: RUN_DIR and --to-hf go together")
    if args.tokenizer is not None or args.dropout is not None:
        raise CommandLineError("convert: --tokenizer and --dropout apply to --from-hf only")
    return export_to_hf(Path(args.run_dir), Path(args.to_hf), args.checkpoint, args.force)


def _hide_hf_progress_bars() -> None:
    """transformers draws bars for copies that take milliseconds; one summary line is enough."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return  # interop raises the install hint when it needs transformers
    hf_logging.disable_progress_bar()


def import_from_hf(source: str, out: Path, tokenizer_file: str | None,
                   dropout: float | None) -> int:
    """Everything is read and checked first; `out` is created only when all of it is good."""
    files.check_can_make_dir(out, CheckpointError)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} already exists and is not empty; choose a new run "
                              f"directory so no run is overwritten")
    directory = interop.open_hf_source(source)
    # Runs train in float32 whatever precision the weights were published in.
    model = interop.from_hf(directory, dropout=dropout).float()
    tokenizer = _source_tokenizer(directory, tokenizer_file)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the "
                              f"model's vocab_size={model.config.vocab_size}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"cannot create {out} ({error})") from None
    with files.locked_directory(out, CheckpointError):
        save_model(out, model, tokenizer, extra={"converted_from": source})
    c = model.config
    print(f"wrote {out}: {c.n_layer} layers, {c.n_head} heads, width {c.n_embd}, context "
          f"{c.block_size}, vocabulary {c.vocab_size} ({tokenizer.kind} tokenizer of "
          f"{tokenizer.vocab_size} tokens)")
    return 0


def _source_tokenizer(directory: interop.HFDirectory, tokenizer_file: str | None) -> Tokenizer:
    if tokenizer_file is not None:
        return _user_tokenizer(Path(tokenizer_file))
    hf_tokenizer = interop.load_hf_tokenizer(directory)
    if hf_tokenizer is None:
        raise CheckpointError(f"{directory.name} has no tokenizer (tokenizer.json, or "
                              f"vocab.json and merges.txt); pass one with --tokenizer FILE")
    return BPETokenizer(hf_tokenizer)


def _user_tokenizer(path: Path) -> Tokenizer:
    """--tokenizer FILE: a file the user named (a link to it is fine), read bounded."""
    if not path.exists():
        raise CheckpointError(f"tokenizer file not found: {path}")
    text = files.read_text(path.resolve(), MAX_TOKENIZER_BYTES, CheckpointError)
    files.parse_json(text, str(path), CheckpointError)
    return tokenizer_from_json(text, source=str(path))


def export_to_hf(run_dir: Path, out: Path, checkpoint: str = "best", force: bool = False
                 ) -> int:
    files.check_can_make_dir(out, CheckpointError)  # before the work, not after it
    model, tokenizer = load_model(run_dir, checkpoint=checkpoint)
    say(f"exporting {describe_weights(run_dir, checkpoint)}")
    if isinstance(tokenizer, BPETokenizer):
        interop.save_hf(model, out, tokenizer=tokenizer.tokenizer, eos_token=END_OF_TEXT,
                        overwrite=force)
        print(f"wrote {out}: model and tokenizer (load with "
              f"transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained)")
    else:
        interop.save_hf(model, out, overwrite=force)
        print(f"wrote {out}: model only; its {tokenizer.kind} tokenizer has no Hugging Face "
              f"equivalent, encode text with `glassgpt.tokenizers.load_tokenizer("
              f"'{run_dir / 'tokenizer.json'}')`")
    return 0
