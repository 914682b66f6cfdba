"""`glassgpt finetune RUN --sft DATA.jsonl --out RUN2`: supervised fine-tuning on conversations,
the assistant's tokens trained only (glassgpt.training.finetune.finetune_run)."""

from __future__ import annotations

import argparse
import dataclasses
import threading
from typing import Any

from glassgpt.adapters.settings import (
    DEFAULT_ALPHA_PER_RANK,
    MAX_SCALING,
    TARGETS,
    LoraSettings,
)
from glassgpt.cli.common import (
    EstimatingReporter,
    add_checkpoint_flag,
    add_dataclass_flags,
    add_threads_flag,
    given_flags,
    path_arg,
    say,
)
from glassgpt.cli.train import HELP_PRESET, INTERRUPTED_EXIT_CODE
from glassgpt.config import TrainConfig, load_preset
from glassgpt.errors import CommandLineError

# --lora-dropout's and --lora-targets' defaults: LoraSettings' own (the command line's too)
LORA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LoraSettings)
                 if f.name in ("dropout", "targets")}
DEFAULT_TARGETS = ",".join(LORA_DEFAULTS["targets"])


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "finetune", help="fine-tune a run on conversations (JSONL), the assistant's replies "
        "trained only",
        description="Supervised fine-tuning: each line of --sft is {\"messages\": [{\"role\": "
        "..., \"content\": ...}, ...]} (roles system, user, assistant), rendered through the "
        "run's chat template (glassgpt's own <|user|>/<|assistant|>/<|end|> one for a run "
        "without one); the loss counts the assistant's tokens only. --out is a new run with "
        "the template it was tuned with.")
    p.add_argument("run_dir", type=path_arg, nargs="?", metavar="RUN",
                   help="the run to start from (not needed with --resume)")
    p.add_argument("--sft", type=path_arg, metavar="DATA.jsonl",
                   help="the conversations (with --resume: the run's own unless given)")
    p.add_argument("--val-sft", type=path_arg, metavar="FILE.jsonl",
                   help="conversations for the val loss (default: the last tenth of --sft)")
    p.add_argument("--out", type=path_arg, help="the new run directory")
    p.add_argument("--show-mask", action="store_true",
                   help="print the first conversation as the model reads it, its trained "
                   "tokens in [[ ]], and exit")
    p.add_argument("--resume", action="store_true",
                   help="continue the fine-tune in --out up to --max-iters in total")
    p.add_argument("--force", action="store_true", help="replace an existing run in --out")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each block's input for the backward and compute the rest "
                   "again there: less memory (BENCHMARKS.md, LoRA at real size), more time "
                   "a step")
    p.add_argument("--seq-len", type=int, metavar="N",
                   help="tokens in a training window of packed conversations (default: the "
                   "model's context, at most 1024)")
    add_checkpoint_flag(p, "start from")
    add_threads_flag(p)
    lora = p.add_argument_group("LoRA", "train low-rank adapters only (all weights without "
                                "--lora-rank)")
    lora.add_argument("--lora-rank", type=int, metavar="R", help="the adapters' rank")
    lora.add_argument("--lora-alpha", type=float, metavar="A",
                      help=f"scale alpha / rank, at most {MAX_SCALING} (default: "
                      f"{DEFAULT_ALPHA_PER_RANK:g} x rank)")
    lora.add_argument("--lora-dropout", type=float, default=LORA_DEFAULTS["dropout"],
                      metavar="P", help=f"dropout on the adapters' input (default "
                      f"{LORA_DEFAULTS['dropout']:g})")
    lora.add_argument("--lora-targets", default=DEFAULT_TARGETS, metavar="LIST",
                      help=f"the projections to adapt, among {','.join(TARGETS)} "
                      f"(default {DEFAULT_TARGETS})")
    lora.add_argument("--base-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                      help="the frozen base's dtype under LoRA (default auto: bfloat16 where "
                      "the CPU has bf16 matrix instructions or the GPU has bf16, else "
                      "float32); the adapters stay float32")
    lora.add_argument("--adapter", type=path_arg, metavar="DIR",
                      help="start from this peft LoRA adapter (adapter_config.json, "
                      "adapter_model.safetensors) of RUN's model instead of new adapters "
                      "(`glassgpt convert RUN2 --to-hf OUT --adapter` writes one)")
    add_dataclass_flags(p.add_argument_group(
        "training settings", "default: the source run's recipe, with a tenth of its lr and "
        "warm-up over a tenth of --max-iters (the defaults shown are the cpu-small preset's)"),
        TrainConfig, "train", load_preset(HELP_PRESET).get("train", {}))
    p.set_defaults(handler=run_finetune)


def lora_settings(args: argparse.Namespace) -> Any:
    """The LoRA settings the flags ask for, or None (every weight trains)."""
    others = (args.lora_alpha is not None or args.lora_dropout != LORA_DEFAULTS["dropout"]
              or args.lora_targets != DEFAULT_TARGETS)
    if args.lora_rank is None:
        if others:
            raise CommandLineError("--lora-alpha, --lora-dropout and --lora-targets go with "
                                   "--lora-rank R")
        return None
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise CommandLineError(f"--lora-targets {args.lora_targets!r:.60}: choose among "
                               f"{','.join(TARGETS)}")
    # No --lora-alpha: LoraSettings' default, 2 x rank.
    return LoraSettings(args.lora_rank, args.lora_alpha, args.lora_dropout, targets)


def run_finetune(args: argparse.Namespace) -> int:
    from glassgpt.training.finetune import finetune_run, mask_preview
    from glassgpt.training.metrics import RichReporter

    if args.show_mask:
        if args.run_dir is None or args.sft is None:
            raise CommandLineError("--show-mask needs the run and --sft DATA.jsonl")
        print(mask_preview(args.run_dir, args.sft))
        return 0
    if args.out is None:
        raise CommandLineError("name the new run directory with --out")
    if not args.resume and (args.run_dir is None or args.sft is None):
        raise CommandLineError("glassgpt finetune RUN --sft DATA.jsonl --out RUN2: the run to "
                               "start from and --sft are needed (or --resume)")
    lora = lora_settings(args)
    adapter = None
    if args.adapter is not None:
        from glassgpt.formats.peft import read_adapter
        from glassgpt.rundir.checkpoint import Run

        if args.resume or args.run_dir is None:
            raise CommandLineError("--adapter starts a new fine-tune from a peft adapter: give "
                                   "the run it was trained on, not --resume")
        adapter = read_adapter(args.adapter, Run(args.run_dir).model_config)
    stop = threading.Event()
    reporter = EstimatingReporter(RichReporter(stop))

    def announce(start: Any, data: Any) -> None:
        _announce(start, data)
        reporter.eval_every = start.cfg.eval_interval

    outcome = finetune_run(args.run_dir, args.sft, args.out, val_sft=args.val_sft,
                           train=given_flags(args, "train"), lora=lora, adapter=adapter,
                           recompute=args.recompute, base_dtype=args.base_dtype,
                           seq_len=args.seq_len,
                           resume=args.resume,
                           force=args.force, checkpoint=args.checkpoint, threads=args.threads,
                           reporter=reporter, stop=stop, on_start=announce, wording="cli")
    return _finish(outcome)


def _announce(start: Any, data: Any) -> None:
    from glassgpt.training.lifecycle import start_line

    say(start_line(start))
    say(f"conversations rendered through {data.template_source} chat template; {plan(start, data)}")
    for warning in start.warnings:
        say(f"warning: {warning}")


def plan(start: Any, data: Any) -> str:
    """"1,000 steps of 8 windows of 40 tokens (111 passes over the 2,880 tokens of 72
    conversations), peak lr 0.003": how much the tune reads, and how fast it moves."""
    cfg, conversations = start.cfg, len(data.splits["train"].examples)
    per_step = cfg.batch_size * cfg.grad_accum * data.window
    passes = (cfg.max_iters - start.first_iteration) * per_step / data.train_tokens
    return (f"{cfg.max_iters - start.first_iteration:,} steps of {cfg.batch_size * cfg.grad_accum}"
            f" windows of {data.window} tokens ({passes:,.3g} passes over the "
            f"{data.train_tokens:,} tokens of {conversations:,} conversation"
            f"{'s' if conversations != 1 else ''}), peak lr {cfg.lr:.3g}")


def _finish(outcome: Any) -> int:
    from glassgpt.training.finetune import summary_line

    result, run_dir = outcome.result, outcome.run_dir
    if result is None:
        say(f"{run_dir} has already trained {outcome.start.first_iteration} iterations; raise "
            f"--max-iters to train further")
        return 0
    if result.interrupted:
        saved = (f"checkpoint saved in {run_dir}; continue with: glassgpt finetune --resume "
                 f"--out {run_dir}" if result.saved else f"nothing was saved in {run_dir}")
        say(f"interrupted at iteration {result.iteration}; {saved}")
        return INTERRUPTED_EXIT_CODE
    print(summary_line(outcome), flush=True)
    return 0
