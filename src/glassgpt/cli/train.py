"""`glassgpt train`: train a GPT into a run directory (glassgpt.runs, glassgpt.train).

Every model and training setting gets a typed `--kebab-case` flag generated from the fields of
`GPTConfig` and `TrainConfig`, so the command line can never fall behind the dataclasses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from glassgpt import checkpoint as ckpt
from glassgpt import distributed as ddp
from glassgpt import files, rundir, runs
from glassgpt.cli.common import (
    add_checkpoint_flag,
    add_threads_flag,
    describe_threads,
    say,
    warn_about_bf16,
)
from glassgpt.config import GPTConfig, TrainConfig, preset_names
from glassgpt.data import PreparedData
from glassgpt.devices import ThreadTuner, cpu_threads, resolve_device
from glassgpt.errors import CheckpointError, CommandLineError, ConfigError
from glassgpt.metrics import RichReporter
from glassgpt.model import GPT, count_parameters
from glassgpt.train import Trainer, TrainResult

FLAG_TYPES = {"int": int, "float": float, "str": str}
DATA_DECIDES = ("vocab_size",)  # set by the tokenizer of the data, never by a flag
INTERRUPTED_EXIT_CODE = 130
MODEL_HELP = {
    "block_size": "context length in tokens", "n_layer": "Transformer blocks",
    "n_head": "attention heads", "n_embd": "width C", "dropout": "dropout probability",
    "bias": "biases in Linear layers and LayerNorms", "activation": "gelu, gelu_tanh or relu",
    "pre_ln": "Pre-LN blocks (else Post-LN)", "tie_weights": "LM head shares the embedding",
    "ln_eps": "LayerNorm epsilon", "attn_impl": "attention path: fused or explicit",
}
RESUME_TAKES_NO = {"config": "--config", "preset": "--preset", "init_from": "--init-from",
                   "force": "--force"}


def register(subparsers: argparse._SubParsersAction) -> None:
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
                   help="continue the run in --out (from its last checkpoint) up to "
                   "--max-iters iterations in total")
    p.add_argument("--force", action="store_true", help="overwrite an existing run in --out")
    p.add_argument("--init-from", type=Path,
                   help="start from the weights of this run directory (fine-tuning)")
    add_checkpoint_flag(p, "start from with --init-from")
    add_threads_flag(p)
    _add_dataclass_flags(p.add_argument_group("model settings"), GPTConfig, "model",
                         skip=DATA_DECIDES)
    _add_dataclass_flags(p.add_argument_group(
        "training settings", "defaults shown are TrainConfig's; a preset's [train] table and "
        "--config override them"), TrainConfig, "train")
    p.set_defaults(handler=run_train)


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
    run_dir = args.out or runs.fresh_run_dir()
    rundir.check_out_dir(run_dir, args.force, args.init_from)
    preset = args.preset or runs.preset_for_device(train_flags.get("device", "auto"))
    model_settings, cfg = runs.resolve_configs(preset, args.config, model_flags, train_flags)
    GPTConfig.from_dict({**model_settings, "vocab_size": 1})  # bad sizes fail before any work
    device = resolve_device(cfg.device)
    with ddp.distributed(device.type) as context:
        data = runs.training_data(args.data, context)
        model = _initial_model(args, model_settings, model_flags, data, cfg.seed)
        trainer = Trainer(model, cfg, data, run_dir, RichReporter(), context,
                          threads=args.threads)
        with _writer(run_dir, context):
            if context.is_main:
                rundir.replace_run(run_dir, args.force)
                start = (f"fine-tuning {args.init_from} from "
                         f"{ckpt.describe_weights(args.init_from, args.checkpoint)}"
                         if args.init_from else f"training preset {preset}")
                _announce(f"{start} ({_describe(model)})", trainer, data, run_dir, args)
            ddp.barrier(context)
            return _finish(trainer.run(), run_dir, context, trainer.threads)


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
    cfg, recorded_data = runs.resume_settings(args.out, model_flags, train_flags)
    files.check_can_make_dir(args.out, CheckpointError)  # read-only: say so before the work
    rundir.check_recoverable(args.out)
    data_dir = args.data or recorded_data
    if data_dir is None:
        raise ConfigError(f"{args.out} records no data directory; pass --data")
    device = resolve_device(cfg.device)
    with ddp.distributed(device.type) as context:
        data = PreparedData(data_dir)
        # The last checkpoint's weights: the ones its optimizer state belongs to.
        model = ckpt.load_model(args.out, checkpoint="last")[0].train()
        runs.check_same_tokenizer(data, args.out)
        trainer = Trainer(model, cfg, data, args.out, RichReporter(), context,
                          threads=args.threads)
        trainer.resume(weights=False)
        if trainer.state.iteration >= cfg.max_iters:
            say(f"{args.out} has already trained {trainer.state.iteration} iterations; "
                f"raise --max-iters to train further")
            return 0
        with _writer(args.out, context):
            if context.is_main:
                rundir.continue_run(args.out, validated)
                _announce(f"resuming at iteration {trainer.state.iteration} of "
                          f"{cfg.max_iters}", trainer, data, args.out, args)
            ddp.barrier(context)
            return _finish(trainer.run(), args.out, context, trainer.threads)


def _initial_model(args: argparse.Namespace, model_settings: dict[str, Any],
                   model_flags: dict[str, Any], data: PreparedData, seed: int) -> GPT:
    if args.init_from is None:
        return runs.build_model(model_settings, data.vocab_size, seed)
    # A fine-tune keeps its run's shape; what the user set (config file, flags) may change
    # only dropout, so the preset's model table does not apply.
    overrides = runs.model_overrides(args.config, model_flags)
    return runs.model_for_finetuning(args.init_from, data, overrides, args.checkpoint)


def _announce(start: str, trainer: Trainer, data: PreparedData, run_dir: Path,
              args: argparse.Namespace) -> None:
    """The start line: what trains, where, with what, and where it goes."""
    device = trainer.device
    threads = f", {describe_threads(trainer.threads)}" if device.type == "cpu" else ""
    say(f"{start} on {device}{threads}, data {data.dir}, run directory {run_dir}")
    warn_about_bf16(trainer.cfg.dtype, device)


@contextlib.contextmanager
def _writer(run_dir: Path, context: ddp.DistContext) -> Iterator[None]:
    """Rank 0 holds the run directory's lock until training ends; other ranks write nothing
    there."""
    if not context.is_main:
        yield
        return
    with rundir.writing(run_dir):
        yield


def _finish(result: TrainResult, run_dir: Path, context: ddp.DistContext,
            threads: ThreadTuner | None = None) -> int:
    if not context.is_main:
        return INTERRUPTED_EXIT_CODE if result.interrupted else 0
    if result.interrupted:
        say(f"interrupted at iteration {result.iteration}; checkpoint saved in {run_dir}; "
            f"continue with: glassgpt train --resume --out {run_dir}")
        return INTERRUPTED_EXIT_CODE
    start = result.iteration - result.iterations_run
    span = (f"{result.iterations_run} iterations" if start == 0 else
            f"{result.iterations_run} iterations ({start} -> {result.iteration})")
    stopped = " (early stop: no better val loss lately)" if result.early_stopped else ""
    best = (f"; best val loss {result.best_val_loss:.4f} at iteration {result.best_iteration}"
            if result.best_iteration is not None else "")
    if threads is not None and threads.probes:
        span += f" on {cpu_threads(threads.threads)} (chosen by timing)"
    print(f"trained {span} in {result.seconds:.1f} s{stopped}: train loss "
          f"{result.train_loss:.4f}, val loss {result.val_loss:.4f}{best}; run saved in "
          f"{run_dir}")
    return 0


def _describe(model: GPT) -> str:
    c = model.config
    params = count_parameters(model)
    return f"{params / 1e6:.2f}M parameters, {c.n_layer} layers, {c.n_head} heads, " \
           f"width {c.n_embd}, context {c.block_size}"
