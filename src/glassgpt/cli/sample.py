"""`glassgpt sample` and `glassgpt eval`: use a trained run (glassgpt.decoding.session's
sample_run; glassgpt.training.runs, glassgpt.evals)."""

from __future__ import annotations

import argparse
import functools
import json
import textwrap
from collections.abc import Iterator
from typing import Any

from glassgpt.cli.common import (
    DEFAULT_PROMPT,
    DefaultsHelpFormatter,
    add_checkpoint_flag,
    add_threads_flag,
    path_arg,
    say,
    stderr_progress,
)
from glassgpt.config import SAMPLING_DEFAULTS, SamplingConfig, sampling_defaults
from glassgpt.config_checks import COMPILE_PAYS_OFF_STEPS, DECODE_DTYPES
from glassgpt.errors import CommandLineError


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_sample(subparsers)
    _register_eval(subparsers)


# --- sample --------------------------------------------------------------------------------

def _register_sample(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sample", help="generate text from a trained run",
                              formatter_class=SampleHelpFormatter,
                              description="Continue a prompt with the model of RUN_DIR.",
                              epilog=sampling_table())
    p.add_argument("run_dir", type=path_arg, metavar="RUN_DIR")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--prompt", default=DEFAULT_PROMPT,
                       help="text to continue (default: a newline)")
    given.add_argument("--chat", metavar="MESSAGE",
                       help="a user message, rendered through the run's chat template (an "
                       "imported instruct model's); the reply ends at the template's "
                       "end-of-turn token")
    p.add_argument("--system", metavar="TEXT",
                   help="with --chat: a system message before it")
    start = sampling_defaults("sample")  # this command's row of the table below
    p.add_argument("--max-new-tokens", type=int, default=start.max_new_tokens,
                   help="tokens to sample")
    p.add_argument("--temperature", type=float, default=start.temperature, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=start.top_k, help="sample among the k likeliest")
    p.add_argument("--top-p", type=float, default=start.top_p, help="nucleus sampling threshold")
    p.add_argument("--stop", help="end a sample where this text appears (not printed)")
    p.add_argument("--seed", type=int, default=start.seed, help="the same seed, the same text")
    p.add_argument("--num-samples", type=int, default=1, help="samples, seeds seed, seed+1..")
    p.add_argument("--stream", action="store_true", help="print tokens as they are sampled")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", choices=DECODE_DTYPES, default="float32",
                   help="weights for decoding: bfloat16 halves the bytes read per token; int8 "
                   "and int4 read the model in float32, then store each layer's weight in "
                   "llama.cpp's Q8_0 or Q4_0 blocks of 32 (8.5 or 4.5 bits a weight) and "
                   "multiply with integer dot products (the activations rounded to Q8_0 "
                   "too), uncompiled, through a kernel built for this CPU on first use")
    p.add_argument("--compile", action="store_true",
                   help="compile the decoding step: 40-75 s to compile on 2 shared cores "
                   "(a third of that once torch has cached it), then a faster step for the "
                   f"tokens inside the context; on a CPU it pays off after about "
                   f"{COMPILE_PAYS_OFF_STEPS:,} such steps, so rarely for one sample")
    steer = p.add_argument_group("steering (adds a direction to an activation at every step)")
    steer.add_argument("--steer", action="append", metavar="FEATURE_OR_VECTOR",
                       help="SAE_DIR:INDEX (a dictionary's decoder row, SAELens's format) or a "
                       "vector file (.safetensors of one tensor, or a .json list of numbers); "
                       "repeat to steer along several")
    steer.add_argument("--at", action="append", metavar="HOOK",
                       help="the hook point to add it at, a TransformerLens name such as "
                       "blocks.0.hook_resid_post (default: the dictionary's); once for every "
                       "--steer, or once each")
    steer.add_argument("--scale", action="append", type=float, metavar="S",
                       help="how much of the direction to add; once for every --steer, or "
                       "once each")
    steer.add_argument("--any-run", action="store_true", help="steer along a latent of a "
                       "dictionary glassgpt trained on another run's model")
    add_checkpoint_flag(p, "sample from")
    add_threads_flag(p)
    p.set_defaults(handler=run_sample)


class SampleHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default, and the table of sampling defaults below them as it is written."""


SAMPLING_COLUMNS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


def sampling_table() -> str:
    """SAMPLING_DEFAULTS as `sample --help` prints it: each surface, its settings and why."""
    lines = ["sampling defaults, one table for every surface (glassgpt.config.SAMPLING_DEFAULTS):"]
    for row in SAMPLING_DEFAULTS.values():
        start = SamplingConfig(**row.changes)
        settings = ", ".join(f"{name.replace('_', '-')} {_shown(getattr(start, name), name)}"
                             for name in SAMPLING_COLUMNS)
        lines += [f"  {row.where}", f"      {settings}"]
        lines += textwrap.wrap(row.why, 78, initial_indent="      why: ",
                               subsequent_indent="           ")
    return "\n".join(lines)


def _shown(value: object, name: str) -> str:
    if value is None:
        return "random" if name == "seed" else "off"
    return str(value)


def run_sample(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `sample --help` and a mistyped flag should not load torch.
    from glassgpt.decoding.session import sample_run

    steers = steer_flags(args)  # refused before the model is read
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)

    def show(index: int, pieces: Iterator[str]) -> None:
        if index:
            print("\n" + "-" * 40)
        if args.chat is None:
            print(args.prompt, end="", flush=True)  # a reply is printed alone
        if args.stream:
            for piece in pieces:
                print(piece, end="", flush=True)
        else:
            print("".join(pieces), end="")
        print(flush=True)

    steering = functools.partial(steering_hooks, steers=steers, args=args) if steers else None
    sample_run(args.run_dir, args.prompt, chat=args.chat, system=args.system,
               sampling=sampling, num_samples=args.num_samples, stop=args.stop,
               dtype=args.dtype, device=args.device, compile=args.compile,
               checkpoint=args.checkpoint, threads=args.threads, steering=steering,
               on_note=say, on_sample=show, wording="cli")
    return 0


def steer_flags(args: argparse.Namespace) -> list[tuple[str, str | None, float]]:
    """(FEATURE_OR_VECTOR, HOOK or None, scale) for each --steer: --at and --scale given once
    apply to every --steer, given once per --steer they pair up in order."""
    steers = args.steer or []
    if not steers:
        for flag, given in (("--at", args.at), ("--scale", args.scale),
                            ("--any-run", args.any_run)):
            if given:
                raise CommandLineError(f"{flag} goes with --steer FEATURE_OR_VECTOR")
        return []
    if args.compile:
        raise CommandLineError("--compile cannot go with --steer: a compiled decoding step "
                               "never calls the hook points a steering direction is added at; "
                               "drop --compile")
    if not args.scale:
        raise CommandLineError("--steer needs --scale S: how much of the direction to add")
    ats = _one_each(args.at or [None], "--at", len(steers))
    scales = _one_each(args.scale, "--scale", len(steers))
    return list(zip(steers, ats, scales, strict=True))


def _one_each(values: list, flag: str, count: int) -> list:
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise CommandLineError(f"{flag} is given {len(values)} times for {count} --steer: give "
                               f"it once for all of them, or once each")
    return values


def steering_hooks(model: Any, steers: list[tuple[str, str | None, float]],
                   args: argparse.Namespace) -> tuple[tuple, list[str]]:
    """The (hook, fn) pairs that add each direction, each read and checked against the model
    and, without --any-run, a dictionary's latent against the run it was trained on (() without
    steering: decoding then attaches nothing), and a line for each saying what is added where."""
    from glassgpt.interp.methods.steering import load_steering, steering_hook
    from glassgpt.interp.sae.provenance import check_trained_on

    hooks, lines = [], []
    for spec, at, scale in steers:
        steering = load_steering(model, spec, at)
        if not args.any_run:
            check_trained_on([(f"--steer {spec}", steering.trained_on)], args.run_dir,
                             args.checkpoint, "steer with a dictionary of this run, or pass "
                             "--any-run to use it")
        lines.append(f"steering: {scale:g} x {steering.source} added at {steering.hook}")
        hooks.append((steering.hook, steering_hook(steering.direction, scale)))
    return tuple(hooks), lines


# --- eval ----------------------------------------------------------------------------------

def _register_eval(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="loss, perplexity and bits per byte of a trained "
                              "run, or its scores on a task (--task)",
                              formatter_class=DefaultsHelpFormatter,
                              description="Loss, perplexity and bits per byte of RUN_DIR's "
                              "model on non-overlapping windows of a split of its data (a "
                              "fine-tuned run's: the assistant's tokens of its conversations), "
                              "up to --batch-size x --max-batches windows; with --task, its "
                              "scores "
                              "on a task file instead (glassgpt.evals), as lm-eval scores the "
                              "model exported to Hugging Face.")
    p.add_argument("run_dir", type=path_arg, metavar="RUN_DIR")
    p.add_argument("--split", choices=("train", "val"), default="val",
                   help="which part of the data")
    p.add_argument("--data", type=path_arg, help="data directory (default: the run's)")
    p.add_argument("--batch-size", type=int, help="windows per batch (default: 32, fewer "
                   "where their logits would pass 1 GiB)")
    p.add_argument("--max-batches", type=int, default=200, help="upper bound on the work")
    p.add_argument("--context", type=int, metavar="TOKENS",
                   help="tokens a window holds (default: the model's context, at most 2,048)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--task", metavar="FILE_OR_BUILTIN",
                   help="score the model on a task instead, as lm-eval does: a JSONL file "
                   "(glassgpt.evals.tasks' format: multiple choice by log-likelihood, acc and "
                   "acc_norm; generate-until, exact_match) or builtin:NAME (builtin:arithmetic, "
                   "builtin:word_order); with --json every item's result too")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_checkpoint_flag(p, "evaluate")
    add_threads_flag(p)
    p.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn

    if args.task is not None:
        return run_task_eval(args)

    from glassgpt.machine.devices import resolve_device
    from glassgpt.rundir import checkpoint as ckpt
    from glassgpt.training import runs

    device = resolve_device(args.device)
    run = ckpt.Run(args.run_dir)  # resolved once, for the evaluation and the line about it
    # Training's bar, on stderr: the windows done of all of them (known before the first
    # batch) and the time left.
    with stderr_progress("[bold]eval", BarColumn(), MofNCompleteColumn(), "windows",
                         TimeRemainingColumn()) as bar:
        task = bar.add_task("eval", total=None)
        result = runs.evaluate_run(run, args.split, args.data, args.batch_size,
                                   args.max_batches, device, args.checkpoint, args.threads,
                                   progress=lambda done, total: bar.update(task, completed=done,
                                                                           total=total),
                                   context=args.context)
    scored = _what_eval_scored(run, args)
    if not args.json:
        say(f"evaluated {run.describe_weights(args.checkpoint)}")
    covered = "" if result.whole_split else "; a part: raise --max-batches for all of it"
    if args.json:
        print(json.dumps({"split": args.split, "conversations": scored, "loss": result.loss,
                          "perplexity": result.perplexity,
                          "bits_per_byte": result.bits_per_byte, "tokens": result.tokens,
                          "bytes": result.text_bytes, "whole_split": result.whole_split,
                          "context": result.context,
                          "checkpoint": args.checkpoint, "run_dir": str(args.run_dir)},
                         allow_nan=False))
    else:
        if scored is not None:
            covered = f"; {scored}{covered}"
        print(f"{args.split} loss {result.loss:.4f}, perplexity {result.perplexity:.2f}, "
              f"{result.bits_per_byte:.4f} bits per byte ({result.tokens:,} tokens, "
              f"{result.text_bytes:,} bytes, windows of {result.context:,} tokens{covered})")
    return 0


def _what_eval_scored(run: Any, args: argparse.Namespace) -> str | None:
    """A fine-tuned run, without --data, is scored on its conversations' assistant tokens:
    which (None for a prepared corpus)."""
    if args.data is not None or run.extra.get("sft") is None:
        return None
    from glassgpt.training.finetune_eval import evaluated_conversations

    return evaluated_conversations(run, args.split)


TASK_IGNORES = (("--data", "data"), ("--batch-size", "batch_size"), ("--context", "context"))


def run_task_eval(args: argparse.Namespace) -> int:
    """`eval RUN --task FILE`: glassgpt.evals' scores of the run's model on a task."""
    from rich.progress import BarColumn, MofNCompleteColumn

    from glassgpt.evals import evaluate_task, load_task
    from glassgpt.machine.devices import resolve_device
    from glassgpt.rundir import checkpoint as ckpt

    for flag, name in TASK_IGNORES:
        if getattr(args, name) is not None:
            raise CommandLineError(f"{flag} goes with the loss of a data split, not with --task")
    task = load_task(args.task)  # a bad file is refused before the model is read
    device = resolve_device(args.device)
    run = ckpt.Run(args.run_dir)
    model, tokenizer = run.load_model(device, checkpoint=args.checkpoint)
    with stderr_progress("[bold]eval", BarColumn(), MofNCompleteColumn(), "items") as bar:
        progress = bar.add_task("eval", total=len(task.items))
        result = evaluate_task(model, tokenizer, task,
                               progress=lambda done, total: bar.update(progress,
                                                                       completed=done),
                               threads=args.threads)
    if args.json:
        print(json.dumps({**result.to_json(), "checkpoint": args.checkpoint,
                          "run_dir": str(args.run_dir)}))
        return 0
    say(f"evaluated {run.describe_weights(args.checkpoint)} on {task.source}")
    print(result.summary())
    return 0
