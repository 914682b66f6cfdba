"""`glassgpt prepare`: tokenize text into a data directory (glassgpt.data.prepare)."""

from __future__ import annotations

import argparse
import math

from glassgpt.cli.common import (
    DefaultsHelpFormatter,
    nonempty_arg,
    path_arg,
    stderr_progress,
)
from glassgpt.config import DEFAULT_BPE_VOCAB, DEFAULT_BUFFER_BYTES, TOKENIZER_KINDS
from glassgpt.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare", help="tokenize a text into a data directory",
        formatter_class=DefaultsHelpFormatter,
        description="Tokenize UTF-8 text (default: Tiny Shakespeare, shipped with glassgpt) into "
        "train/val token ids, a tokenizer and metadata. Any number of files stream through in "
        "bounded memory.")
    p.add_argument("--text", nargs="+", metavar="FILE", type=nonempty_arg,
                   help="UTF-8 text files or quoted glob patterns ('owt/*.txt', "
                   "'books/**/*.txt'), read in order as one text (default: Tiny Shakespeare)")
    p.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default="char",
                   help="char: one id per character; bpe: byte-level BPE trained on the text")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"BPE vocabulary size (default {DEFAULT_BPE_VOCAB}; BPE only)")
    p.add_argument("--tokenizer-file", nargs="+", type=path_arg, metavar="FILE",
                   help="reuse a tokenizer: a tokenizer JSON (a run's, to fine-tune it; a "
                   "Hugging Face tokenizer.json), GPT-2's vocab.json and merges.txt, or a "
                   "directory holding either")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of the tokens, at the end, kept for validation")
    p.add_argument("--out", type=path_arg, required=True, help="data directory to write")
    p.add_argument("--force", action="store_true", help="replace the prepared data in --out "
                   "(without it, prepare refuses a directory holding any file it would write)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes that encode pieces of the text in parallel")
    p.add_argument("--buffer-mb", type=float, default=DEFAULT_BUFFER_BYTES / 2**20,
                   help="memory for text and ids in flight")
    p.set_defaults(handler=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, TimeRemainingColumn

    from glassgpt.data import prepare  # numpy and the tokenizers: not for `prepare --help`

    buffer_bytes = _megabytes(args.buffer_mb)
    columns = ("[bold]prepare", BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with stderr_progress(*columns) as bar:
        task = bar.add_task("prepare", total=None)  # text read, each pass over it counted

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        meta = prepare(args.out, args.text, args.tokenizer, args.vocab_size, args.val_fraction,
                       args.tokenizer_file, force=args.force, workers=args.workers,
                       buffer_bytes=buffer_bytes, progress=progress)
    files = f" from {meta['files']:,} files" if meta["files"] > 1 else ""
    print(f"prepared {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens"
          f"{files} ({meta['tokenizer']} tokenizer, vocab {meta['vocab_size']}) in {args.out}")
    return 0


def _megabytes(value: float) -> int:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--buffer-mb must be a positive number, got {value}")
    return int(min(value, 2.0**40) * 2**20)
