"""`glassgpt prepare | train | sample | eval`: train on a text and sample from the run.

Every model and training setting gets a typed `--kebab-case` flag generated from the fields of
`GPTConfig` and `TrainConfig`, so the command line can never fall behind the dataclasses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from glassgpt import checkpoint as ckpt
from glassgpt import distributed as ddp
from glassgpt import files, rundir
from glassgpt.config import GPTConfig, SamplingConfig, preset_names
from glassgpt.data import (
    DEFAULT_BUFFER_BYTES,
    PreparedData,
    default_data_dir,
    is_prepared_from,
    prepare,
    tinyshakespeare_path,
)
from glassgpt.errors import CheckpointError, CommandLineError, ConfigError
from glassgpt.evaluate import evaluate
from glassgpt.generate import encode_prompt, stream_text
from glassgpt.metrics import RichReporter
from glassgpt.model import GPT, count_parameters
from glassgpt.tokenizers import DEFAULT_BPE_VOCAB, TOKENIZER_KINDS
from glassgpt.train import (
    TrainConfig,
    Trainer,
    TrainResult,
    build_model,
    check_same_tokenizer,
    model_for_finetuning,
    resolve_configs,
    resolve_device,
    resume_settings,
)

FLAG_TYPES = {"int": int, "float": float, "str": str}
DATA_DECIDES = ("vocab_size",)  # set by the tokenizer of the data, never by a flag
INTERRUPTED_EXIT_CODE = 130
DEFAULT_PROMPT = "\n"


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_prepare(subparsers)
    _register_train(subparsers)
    _register_sample(subparsers)
    _register_eval(subparsers)


# --- prepare -------------------------------------------------------------------------------

def _register_prepare(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prepare", help="tokenize a text into a data directory",
                              description="Tokenize UTF-8 text (default: Tiny Shakespeare) into "
                              "train/val token ids, a tokenizer and metadata. Any number of "
                              "files stream through in bounded memory.")
    p.add_argument("--text", nargs="+", metavar="FILE",
                   help="UTF-8 text files or quoted glob patterns ('owt/*.txt', "
                   "'books/**/*.txt'), read in order as one text (default: Tiny Shakespeare)")
    p.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default="char")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_BPE_VOCAB,
                   help="BPE vocabulary size")
    p.add_argument("--tokenizer-file", nargs="+", type=Path, metavar="FILE",
                   help="reuse a tokenizer: a tokenizer JSON (a run's, to fine-tune it; a "
                   "Hugging Face tokenizer.json), GPT-2's vocab.json and merges.txt, or a "
                   "directory holding either")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--out", type=Path, required=True, help="data directory to write")
    p.add_argument("--force", action="store_true", help="replace the prepared data in --out")
    p.add_argument("--workers", type=int, default=1,
                   help="processes that encode pieces of the text in parallel")
    p.add_argument("--buffer-mb", type=float, default=DEFAULT_BUFFER_BYTES / 2**20,
                   help="memory for text and ids in flight (default %(default)g)")
    p.set_defaults(handler=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    meta = prepare(args.out, args.text, args.tokenizer, args.vocab_size, args.val_fraction,
                   args.tokenizer_file, force=args.force, workers=args.workers,
                   buffer_bytes=_megabytes(args.buffer_mb))
    files = f" from {meta['files']:,} files" if meta["files"] > 1 else ""
    print(f"prepared {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens"
          f"{files} ({meta['tokenizer']} tokenizer, vocab {meta['vocab_size']}) in {args.out}")
    return 0


def _megabytes(value: float) -> int:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--buffer-mb must be a positive number, got {value}")
    return int(min(value, 2.0**40) * 2**20)


# --- train ---------------------------------------------------------------------------------

def _register_train(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a GPT on a prepared data directory",
                              description="Train a GPT. Settings come from the preset, then "
                              "--config FILE.toml, then flags. Without --data it trains on "
                              "Tiny Shakespeare with a preset that fits the device.")
    p.add_argument("--data", type=Path, help="prepared data directory (default: Tiny "
                   "Shakespeare, prepared into the cache)")
    p.add_argument("--out", type=Path, help="run directory (default: a new runs/<time>)")
    p.add_argument("--preset", choices=preset_names(),
                   help="model + recipe (default: cpu-small on a CPU, shakespeare-char on CUDA)")
    p.add_argument("--config", type=Path, help="TOML file with [model] and [train] tables")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out up to --max-iters iterations in total")
    p.add_argument("--force", action="store_true", help="overwrite an existing run in --out")
    p.add_argument("--init-from", type=Path,
                   help="start from the weights of this run directory (fine-tuning)")
    _add_dataclass_flags(p.add_argument_group("model settings"), GPTConfig, "model",
                         skip=DATA_DECIDES)
    _add_dataclass_flags(p.add_argument_group(
        "training settings", "defaults shown are TrainConfig's; a preset's [train] table and "
        "--config override them"), TrainConfig, "train")
    p.set_defaults(handler=run_train)


MODEL_HELP = {
    "block_size": "context length in tokens", "n_layer": "Transformer blocks",
    "n_head": "attention heads", "n_embd": "width C", "dropout": "dropout probability",
    "bias": "biases in Linear layers and LayerNorms", "activation": "gelu, gelu_tanh or relu",
    "pre_ln": "Pre-LN blocks (else Post-LN)", "tie_weights": "LM head shares the embedding",
    "ln_eps": "LayerNorm epsilon", "attn_impl": "attention path: fused or explicit",
}


def _add_dataclass_flags(group: argparse._ArgumentGroup, cls: type, prefix: str,
                         skip: tuple[str, ...] = ()) -> None:
    """A `--field-name` flag per dataclass field, typed from its annotation; unset is None."""
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata.get("help") or MODEL_HELP.get(field.name, field.name)
        if field.default is not dataclasses.MISSING and prefix == "train":
            help_text += f" (default {field.default})"
        if field.type == "bool":
            group.add_argument(flag, dest=f"{prefix}_{field.name}",
                               action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f"{prefix}_{field.name}",
                               type=FLAG_TYPES[field.type], default=None,
                               metavar=field.type.upper(), help=help_text)


def _flags(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The settings given on the command line, e.g. {'max_iters': 100}."""
    start = prefix + "_"
    return {key.removeprefix(start): value for key, value in vars(args).items()
            if key.startswith(start) and value is not None}


def run_train(args: argparse.Namespace) -> int:
    """Every input is checked (out directory, data, config file, flags, model shape, the run
    to start from) before the run directory changes; then, holding its lock, the old run is
    replaced (or continued) and training starts."""
    model_flags, train_flags = _flags(args, "model"), _flags(args, "train")
    if args.resume:
        return _resume(args, model_flags, train_flags)
    if args.out is None and ddp.launched_by_torchrun():
        raise ConfigError("under torchrun, name the run directory with --out")
    run_dir = args.out or _fresh_run_dir()
    rundir.check_out_dir(run_dir, args.force, args.init_from)
    preset = args.preset or _preset_for_device(train_flags.get("device", "auto"))
    model_settings, cfg = resolve_configs(preset, args.config, model_flags, train_flags)
    GPTConfig.from_dict({**model_settings, "vocab_size": 1})  # bad sizes fail before any work
    device = resolve_device(cfg.device)
    with ddp.distributed(device.type) as context:
        data = PreparedData(_data_dir(args.data, context))
        model = _initial_model(args.init_from, model_settings, model_flags, data, cfg.seed)
        trainer = Trainer(model, cfg, data, run_dir, RichReporter(), context)
        with _writer(run_dir, context):
            if context.is_main:
                rundir.replace_run(run_dir, args.force)
                start = (f"fine-tuning {args.init_from}" if args.init_from
                         else f"training preset {preset}")
                _say(f"{start} ({_describe(model)}) on {trainer.device}, data {data.dir}, "
                     f"run directory {run_dir}")
            ddp.barrier(context)
            return _finish(trainer.run(), run_dir, context)


RESUME_TAKES_NO = {"config": "--config", "preset": "--preset", "init_from": "--init-from",
                   "force": "--force"}


def _resume(args: argparse.Namespace, model_flags: dict[str, Any],
            train_flags: dict[str, Any]) -> int:
    if args.out is None:
        raise ConfigError("--resume needs --out RUN_DIR, the run to continue")
    given = [flag for name, flag in RESUME_TAKES_NO.items() if getattr(args, name)]
    if given:
        raise CommandLineError(f"--resume continues {args.out} with its own model and recipe; "
                               f"{', '.join(given)} cannot go with it (change training settings "
                               f"with their own flags, or start a new run with --init-from)")
    files.check_unlocked(args.out, CheckpointError)  # a run in use: say so before reading it
    validated = rundir.fingerprint(args.out)  # what is read next must be what is continued
    cfg, recorded_data = resume_settings(args.out, model_flags, train_flags)
    files.check_can_make_dir(args.out, CheckpointError)  # read-only: say so before the work
    rundir.check_recoverable(args.out)
    data_dir = args.data or recorded_data
    if data_dir is None:
        raise ConfigError(f"{args.out} records no data directory; pass --data")
    device = resolve_device(cfg.device)
    with ddp.distributed(device.type) as context:
        data = PreparedData(data_dir)
        model = ckpt.load_model(args.out)[0].train()  # checks config.json against the weights
        check_same_tokenizer(data, args.out)
        trainer = Trainer(model, cfg, data, args.out, RichReporter(), context)
        trainer.resume(weights=False)
        if trainer.state.iteration >= cfg.max_iters:
            _say(f"{args.out} has already trained {trainer.state.iteration} iterations; "
                 f"raise --max-iters to train further")
            return 0
        with _writer(args.out, context):
            if context.is_main:
                rundir.continue_run(args.out, validated)
                _say(f"resuming {args.out} at iteration {trainer.state.iteration} of "
                     f"{cfg.max_iters}")
            ddp.barrier(context)
            return _finish(trainer.run(), args.out, context)


@contextlib.contextmanager
def _writer(run_dir: Path, context: ddp.DistContext) -> Iterator[None]:
    """Rank 0 holds the run directory's lock until training ends; other ranks write nothing
    there."""
    if not context.is_main:
        yield
        return
    with rundir.writing(run_dir):
        yield


def _finish(result: TrainResult, run_dir: Path, context: ddp.DistContext) -> int:
    if not context.is_main:
        return INTERRUPTED_EXIT_CODE if result.interrupted else 0
    if result.interrupted:
        _say(f"interrupted at iteration {result.iteration}; checkpoint saved in {run_dir}; "
             f"continue with: glassgpt train --resume --out {run_dir}")
        return INTERRUPTED_EXIT_CODE
    print(f"trained {result.iteration} iterations in {result.seconds:.1f} s: train loss "
          f"{result.train_loss:.4f}, val loss {result.val_loss:.4f}; run saved in {run_dir}")
    return 0


def _fresh_run_dir() -> Path:
    """runs/<time>, a name no directory has yet (said when training starts)."""
    run_dir = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    while run_dir.exists():
        run_dir = run_dir.with_name(run_dir.name + "-1")
    return run_dir


def _preset_for_device(device: str) -> str:
    on_gpu = resolve_device(device).type == "cuda"
    return "shakespeare-char" if on_gpu else "cpu-small"


def _data_dir(data: Path | None, context: ddp.DistContext) -> Path:
    """--data, or Tiny Shakespeare prepared once (character level) into the cache."""
    if data is not None:
        return data
    default = default_data_dir()
    if context.is_main and not is_prepared_from(default, tinyshakespeare_path()):
        _say(f"preparing Tiny Shakespeare (character level) into {default}")
        prepare(default)
    ddp.barrier(context)
    return default


def _initial_model(init_from: Path | None, model_settings: dict[str, Any],
                   model_flags: dict[str, Any], data: PreparedData, seed: int) -> GPT:
    if init_from is None:
        return build_model(model_settings, data.vocab_size, seed)
    return model_for_finetuning(init_from, data, model_flags)


def _describe(model: GPT) -> str:
    c = model.config
    params = count_parameters(model)
    return f"{params / 1e6:.2f}M parameters, {c.n_layer} layers, {c.n_head} heads, " \
           f"width {c.n_embd}, context {c.block_size}"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- sample --------------------------------------------------------------------------------

SAMPLE_DTYPES = ("float32", "bfloat16")


def _register_sample(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sample", help="generate text from a trained run",
                              description="Continue a prompt with the model of RUN_DIR.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue (default: a "
                   "newline)")
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--stop", help="end a sample where this text appears (not printed)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--stream", action="store_true", help="print tokens as they are sampled")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=SAMPLE_DTYPES, default="float32",
                   help="weights for decoding: bfloat16 halves the bytes read per token")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decoding step: seconds to compile once, then "
                   "1.5-2.5x faster per token on a CPU (pays off for long samples)")
    p.set_defaults(handler=run_sample)


def run_sample(args: argparse.Namespace) -> int:
    if args.num_samples <= 0:
        raise ConfigError(f"--num-samples must be positive, got {args.num_samples}")
    device = resolve_device(args.device)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              compiled=args.compile)
    model, tokenizer = ckpt.load_model(args.run_dir, device)
    if args.dtype == "bfloat16":
        model = model.to(torch.bfloat16)  # half the bytes read per token
    block_size = model.config.block_size
    prompt, length = encode_prompt(tokenizer, args.prompt or DEFAULT_PROMPT, block_size, device)
    if length > block_size:
        _say(f"note: the prompt has {length} tokens, more than the context of {block_size}; "
             f"the model sees its last {block_size}")
    for i in range(args.num_samples):
        if i:
            print("\n" + "-" * 40)
        print(args.prompt, end="", flush=True)
        seed = None if args.seed is None else args.seed + i
        pieces = stream_text(model, tokenizer, prompt, sampling, stop=args.stop, seed=seed)
        if args.stream:
            for piece in pieces:
                print(piece, end="", flush=True)
        else:
            print("".join(pieces), end="")
        print(flush=True)
    return 0


# --- eval ----------------------------------------------------------------------------------

def _register_eval(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="loss, perplexity and bits per byte of a trained run",
                              description="Loss, perplexity and bits per byte of RUN_DIR's "
                              "model on non-overlapping windows of a split of its data.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--split", choices=("train", "val"), default="val")
    p.add_argument("--data", type=Path, help="data directory (default: the run's)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-batches", type=int, default=200, help="upper bound on the work")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    if args.batch_size <= 0 or args.max_batches <= 0:
        raise ConfigError(f"--batch-size and --max-batches must be positive, got "
                          f"{args.batch_size} and {args.max_batches}")
    device = resolve_device(args.device)
    model, _ = ckpt.load_model(args.run_dir, device)
    data_dir = args.data or ckpt.read_run_config(args.run_dir).get("data_dir")
    if data_dir is None:
        raise ConfigError(f"{args.run_dir} records no data directory; pass --data")
    data = PreparedData(data_dir)
    check_same_tokenizer(data, args.run_dir)
    data.check_block_size(model.config.block_size)
    result = evaluate(model, data.splits[args.split], data.tokenizer, args.batch_size,
                      args.max_batches, device)
    if args.json:
        print(json.dumps({"split": args.split, "loss": result.loss,
                          "perplexity": result.perplexity,
                          "bits_per_byte": result.bits_per_byte, "tokens": result.tokens,
                          "bytes": result.text_bytes, "run_dir": str(args.run_dir)},
                         allow_nan=False))
    else:
        print(f"{args.split} loss {result.loss:.4f}, perplexity {result.perplexity:.2f}, "
              f"{result.bits_per_byte:.4f} bits per byte ({result.tokens:,} tokens, "
              f"{result.text_bytes:,} bytes)")
    return 0
