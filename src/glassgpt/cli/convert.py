"""`glassgpt convert`: Hugging Face GPT-2, Llama and Qwen3 weights into a run directory, and back.

    glassgpt convert --from-hf NAME_OR_DIR --out RUN_DIR   # hub name (e.g. gpt2) or local dir
    glassgpt convert RUN_DIR --to-hf OUT_DIR               # a save_pretrained directory

The export writes the architecture the run has: GPT-2 (learned positions, LayerNorm), Qwen3
(rotary, RMSNorm, SwiGLU and QK-norm) or Llama (the same without QK-norm).

Exporting, and downloading a hub name, need the optional extra `hf` (transformers); importing a
local directory needs nothing more, because glassgpt reads it itself (safetensors only).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from glassgpt.choices import INSTALL_HINT
from glassgpt.cli.common import add_checkpoint_flag, nonempty_arg, say
from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, CommandLineError
from glassgpt.storage import files

# The handlers import torch, the model and the Hugging Face readers when they run, so that
# `convert --help` and a mistyped flag answer at once.
if TYPE_CHECKING:
    from glassgpt.hf import interop
    from glassgpt.tokenizers import Tokenizer


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="import or export Hugging Face GPT-2, Llama and Qwen3 weights",
        description="Import a Hugging Face GPT-2, Llama or Qwen3 (hub name or save_pretrained "
                    "directory) into a run directory, or export a run to a save_pretrained "
                    "directory of the architecture it has. Exporting, and downloading, need "
                    f"{INSTALL_HINT}.")
    parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR", type=nonempty_arg,
                        help="run directory to export (with --to-hf)")
    parser.add_argument("--from-hf", metavar="NAME_OR_DIR", type=nonempty_arg,
                        help="hub model name (e.g. gpt2) or a save_pretrained directory of a "
                             "GPT2LMHeadModel, LlamaForCausalLM or Qwen3ForCausalLM")
    parser.add_argument("--out", metavar="RUN_DIR", type=nonempty_arg,
                        help="new run directory for --from-hf")
    parser.add_argument("--to-hf", metavar="OUT_DIR", type=nonempty_arg,
                        help="new save_pretrained directory")
    parser.add_argument("--tokenizer", metavar="FILE", type=nonempty_arg,
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
    """Everything is read and checked first; the run is written beside `out` and renamed into
    place whole, so a failure (a full disk) leaves no half-made directory."""
    from glassgpt.hf import interop
    from glassgpt.rundir.checkpoint import save_model
    from glassgpt.storage.commit import staged_directory

    files.check_can_make_dir(out, CheckpointError)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} already exists and is not empty; choose a new run "
                              f"directory so no run is overwritten")
    directory = interop.open_hf_source(source)
    # Runs train in float32 whatever precision the weights were published in.
    model = interop.from_hf(directory, dropout=dropout).float()
    tokenizer = _source_tokenizer(directory, tokenizer_file, model.config.vocab_size)
    check_tokenizer_fits(tokenizer.vocab_size, model.config.vocab_size)
    with staged_directory(out) as staging:
        save_model(staging, model, tokenizer, extra={"converted_from": source})
    c = model.config
    print(f"wrote {out}: {_architecture_words(c)}, {c.n_layer} layers, {c.n_head} heads, "
          f"width {c.n_embd}, context {c.block_size}, vocabulary {c.vocab_size} "
          f"({tokenizer.kind} tokenizer of {tokenizer.vocab_size} tokens)")
    return 0


def check_tokenizer_fits(tokenizer_size: int, vocab_size: int) -> None:
    """A run's tokenizer must name every id its model can emit, and only those: a smaller one
    would let `sample` draw an id it cannot decode."""
    if tokenizer_size != vocab_size:
        raise CheckpointError(f"the tokenizer has {tokenizer_size:,} tokens but the model's "
                              f"vocab_size is {vocab_size:,}; give a tokenizer of exactly "
                              f"{vocab_size:,} tokens (--tokenizer FILE)")


def _architecture_words(config: GPTConfig) -> str:
    """"GPT-2", or Llama's switches as "rope, rmsnorm, swiglu, 2 KV heads, qk_norm"."""
    if config.position == "learned":
        return "GPT-2"
    words = [config.position, config.norm, config.activation]
    if config.n_kv_head not in (None, config.n_head):
        words.append(f"{config.n_kv_head} KV heads")
    if config.qk_norm:
        words.append("qk_norm")
    return ", ".join(words)


def _source_tokenizer(directory: interop.HFDirectory, tokenizer_file: str | None,
                      vocab_size: int) -> Tokenizer:
    """--tokenizer FILE as it is, or the model's own, its padding ids named (see
    hf_files.name_padding_ids)."""
    from glassgpt.hf import interop
    from glassgpt.hf.files import UNUSED_TOKEN, name_padding_ids
    from glassgpt.tokenizers import BPETokenizer

    if tokenizer_file is not None:
        return _user_tokenizer(Path(tokenizer_file))
    hf_tokenizer = interop.load_hf_tokenizer(directory)
    if hf_tokenizer is None:
        raise CheckpointError(f"{directory.name} has no tokenizer (tokenizer.json, or "
                              f"vocab.json and merges.txt); pass one with --tokenizer FILE")
    named = name_padding_ids(hf_tokenizer, vocab_size)
    if named:
        say(f"note: the tokenizer has {vocab_size - named:,} tokens and the model "
            f"{vocab_size:,} ids; the {named:,} ids past the tokenizer (padding) decode as "
            f"{UNUSED_TOKEN.format(id='ID')}")
    return BPETokenizer(hf_tokenizer)


def _user_tokenizer(path: Path) -> Tokenizer:
    """--tokenizer FILE: a file the user named (a link to it is fine), read bounded."""
    from glassgpt.hf.files import MAX_TOKENIZER_BYTES
    from glassgpt.tokenizers import tokenizer_from_json

    if not path.exists():
        raise CheckpointError(f"tokenizer file not found: {path}")
    text = files.read_text(path.resolve(), MAX_TOKENIZER_BYTES, CheckpointError)
    files.parse_json(text, str(path), CheckpointError)
    return tokenizer_from_json(text, source=str(path))


def export_to_hf(run_dir: Path, out: Path, checkpoint: str = "best", force: bool = False
                 ) -> int:
    from glassgpt.hf import interop
    from glassgpt.rundir.checkpoint import describe_weights, load_model
    from glassgpt.tokenizers import END_OF_TEXT, BPETokenizer

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
