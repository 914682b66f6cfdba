"""`glassgpt train`: parse the flags, call glassgpt.training.lifecycle.train_run, print what it did.

Every field of `GPTConfig` and `TrainConfig` is a typed `--kebab-case` flag, generated (so the
command line never falls behind them); `--help` shows the cpu-small preset's defaults."""

from __future__ import annotations

import argparse
import threading
from typing import Any

from glassgpt.cli.common import (
    add_checkpoint_flag,
    add_dataclass_flags,
    add_threads_flag,
    given_flags,
    path_arg,
    say,
)
from glassgpt.config import GPTConfig, TrainConfig, load_preset, preset_names

DATA_DECIDES = ("vocab_size",)  # set by the tokenizer of the data, never by a flag
HELP_PRESET = "cpu-small"  # what a bare `glassgpt train` uses on a CPU: its defaults are shown
INTERRUPTED_EXIT_CODE = 130
OUTPUT_CLOSED_EXIT_CODE = 141  # 128 + SIGPIPE, what a Unix tool whose reader left returns


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a GPT on a prepared data directory",
                              description="Train a GPT. Settings come from the preset, then "
                              "--config FILE.toml, then flags. Without --data it trains on "
                              "Tiny Shakespeare with a preset that fits the device.")
    p.add_argument("--data", type=path_arg, help="prepared data directory (default: Tiny "
                   "Shakespeare, prepared into the cache)")
    p.add_argument("--out", type=path_arg, help="run directory (default: a new runs/<time>)")
    p.add_argument("--preset", choices=preset_names(),
                   help="model + recipe (default: cpu-small on a CPU, shakespeare-char on CUDA)")
    p.add_argument("--config", type=path_arg, help="TOML file with [model] and [train] tables")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (from its last checkpoint) up to "
                   "--max-iters iterations in total; the run's own command line plus "
                   "--resume works, a setting that differs from the run's is refused")
    p.add_argument("--force", action="store_true", help="replace an existing run in --out (it "
                   "stays until the new run's first checkpoint, at step 0)")
    p.add_argument("--init-from", type=path_arg, metavar="RUN_DIR",
                   help="fine-tune the weights of this run: its recipe, with a tenth of its lr "
                   "and warm-up over a tenth of --max-iters unless given")
    add_checkpoint_flag(p, "start from with --init-from")
    add_threads_flag(p)
    preset = load_preset(HELP_PRESET)
    add_dataclass_flags(p.add_argument_group(
        "model settings", f"defaults shown are the {HELP_PRESET} preset's"), GPTConfig, "model",
        preset.get("model", {}), skip=DATA_DECIDES)
    add_dataclass_flags(p.add_argument_group(
        "training settings", f"defaults shown are what a bare `glassgpt train` uses on a CPU "
        f"(the {HELP_PRESET} preset); --preset and --config change them"), TrainConfig, "train",
        preset.get("train", {}))
    p.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> int:
    from glassgpt.training.lifecycle import train_run
    from glassgpt.training.metrics import RichReporter

    stop = threading.Event()  # set by Ctrl-C, SIGTERM, or a closed stdout: save and return
    reporter = RichReporter(stop)
    outcome = train_run(args.out, data=args.data, preset=args.preset, config=args.config,
                        model=given_flags(args, "model"), train=given_flags(args, "train"),
                        resume=args.resume, force=args.force, init_from=args.init_from,
                        checkpoint=args.checkpoint, threads=args.threads, reporter=reporter,
                        stop=stop, on_start=_announce, wording="cli")
    return _finish(outcome, reporter.output_closed)


def _announce(start: Any) -> None:
    """The start line, then any warning about the recipe or the precision."""
    from glassgpt.cli.common import warn_about_bf16
    from glassgpt.training.lifecycle import start_line

    say(start_line(start))
    for warning in start.warnings:
        say(f"warning: {warning}")
    warn_about_bf16(start.cfg.dtype, start.device)


def _finish(outcome: Any, output_closed: bool) -> int:
    from glassgpt.machine.distributed import rank_from_env
    from glassgpt.training.lifecycle import summary_line
    from glassgpt.training.metrics import silence_stdout

    result, run_dir = outcome.result, outcome.run_dir
    if result is None:
        say(f"{run_dir} has already trained {outcome.start.first_iteration} iterations; raise "
            f"--max-iters to train further")
        return 0
    if rank_from_env() != 0:
        return INTERRUPTED_EXIT_CODE if result.interrupted else 0
    resume = f"continue with: glassgpt train --resume --out {run_dir}"
    if result.interrupted and not result.saved:  # stopped in the evaluation at step 0
        say(f"interrupted at iteration 0, before the run's first checkpoint: nothing was "
            f"saved in {run_dir}")
        return OUTPUT_CLOSED_EXIT_CODE if output_closed else INTERRUPTED_EXIT_CODE
    if result.interrupted:
        why = "stdout was closed: stopped" if output_closed else "interrupted"
        say(f"{why} at iteration {result.iteration}; checkpoint saved in {run_dir}; {resume}")
        return OUTPUT_CLOSED_EXIT_CODE if output_closed else INTERRUPTED_EXIT_CODE
    try:
        print(summary_line(result, run_dir), flush=True)
    except BrokenPipeError:  # the reader left just as training ended: the run is whole
        silence_stdout()
        say(f"stdout was closed; the run finished and is saved in {run_dir}")
        return OUTPUT_CLOSED_EXIT_CODE
    return 0
