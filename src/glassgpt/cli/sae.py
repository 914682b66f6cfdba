"""`glassgpt sae train` and `glassgpt sae eval`: sparse dictionaries on a run's hook points
(glassgpt.interp.sae.training.train_dictionary, glassgpt.interp.sae.evaluate.evaluate_on_run).

The training's flags are made from `DictionarySettings`'s fields (their types, defaults and
help), which import without torch, so `--help` answers at once."""

from __future__ import annotations

import argparse
import json
from typing import Any

from glassgpt.cli import crosslayer
from glassgpt.cli.common import (
    DefaultsHelpFormatter,
    add_checkpoint_flag,
    add_settings_flags,
    path_arg,
    say,
    train_with_bar,
)
from glassgpt.cli.train import INTERRUPTED_EXIT_CODE
from glassgpt.interp.sae.architectures import find
from glassgpt.interp.sae.training.settings import (
    ARCHITECTURES,
    NORMALIZATIONS,
    DictionarySettings,
)

# Each flag of `sae train` that is a setting -> its DictionarySettings field.
SETTINGS = {"hook": "hook", "d_sae": "d_sae", "architecture": "architecture",
            "transcoder": "transcoder", "hook_out": "hook_out", "k": "k", "l1": "l1_coefficient",
            "l0": "l0_coefficient", "tokens": "tokens", "batch_tokens": "batch_tokens",
            "lr": "lr", "normalize_activations": "normalize_activations",
            "resample_every": "resample_every", "eval_every": "eval_every",
            "checkpoint_every": "checkpoint_every", "seed": "seed"}
HISTOGRAM_WIDTH = 60  # characters of the longest bar
ANY_RUN_HELP = ("use a dictionary glassgpt trained on another run's model (neither this run's "
                "directory nor its weights)")


class Given(argparse.Action):
    """Stores a flag's value and notes that it was given: with --resume, the settings not
    given are the saved training's, not the flags' defaults."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        namespace.given = {*(getattr(namespace, "given", None) or ()), self.dest}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sae", help="train and evaluate sparse dictionaries (SAELens's "
                              "format) on a run's hook points")
    commands = p.add_subparsers(dest="sae_command", metavar="COMMAND")
    _register_train(commands)
    _register_eval(commands)
    crosslayer.register(commands)
    _register_convert(commands)
    p.set_defaults(handler=lambda args: p.error("give a command: train, eval, train-clt or "
                                                "convert"))


def _register_train(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", formatter_class=DefaultsHelpFormatter,
                            help="train a sparse autoencoder or transcoder on a hook point",
                            description="Train a dictionary on activations of RUN_DIR's model "
                            "at --hook, streamed from the run's data or a text file; saved in "
                            "SAELens's format, with its trainer state for --resume.")
    p.add_argument("run_dir", type=path_arg, metavar="RUN_DIR")
    p.add_argument("--out", type=path_arg, required=True, help="directory to write")
    add_settings_flags(p, DictionarySettings, SETTINGS, Given,
                       choices={"architecture": ARCHITECTURES,
                                "normalize_activations": NORMALIZATIONS})
    p.set_defaults(hook=None, d_sae=None)  # no default: a new training is told both
    p.add_argument("--data", type=path_arg, help="prepared data directory, or a text file "
                   "(tokenised with the run's tokenizer into the cache) (default: the run's)")
    p.add_argument("--resume", action="store_true", help="continue the training in --out; "
                   "the settings not given are its own (--tokens may grow)")
    p.add_argument("--force", action="store_true", help="replace the dictionary glassgpt "
                   "trained in --out")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    add_checkpoint_flag(p, "read")
    p.set_defaults(handler=run_sae_train, command_words=("sae", "train"))


def _register_eval(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("eval", formatter_class=DefaultsHelpFormatter,
                            help="SAELens's metrics of a dictionary on a run's data",
                            description="L0, MSE, explained variance, CE loss recovered, dead "
                            "and dense latents and the density histogram of SAE on windows of "
                            "RUN's validation data.")
    p.add_argument("sae", type=path_arg, metavar="SAE")
    p.add_argument("--run", type=path_arg, required=True, metavar="RUN_DIR")
    p.add_argument("--tokens", type=int, default=65_536, help="tokens to evaluate on")
    p.add_argument("--data", type=path_arg, help="prepared data directory (default: the run's)")
    p.add_argument("--split", choices=("train", "val"), default="val")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cpu")
    p.add_argument("--any-run", action="store_true", help=ANY_RUN_HELP)
    add_checkpoint_flag(p, "read")
    p.set_defaults(handler=run_sae_eval)


def _register_convert(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("convert", formatter_class=DefaultsHelpFormatter,
                            help="write transcoders in circuit-tracer's files",
                            description="glassgpt's transcoders (SAELens's format, one a layer, "
                            "or one directory holding them; or a CLT) written as "
                            "circuit-tracer 0.5's directory: layer_i.safetensors and "
                            "config.yaml (a TranscoderSet, which load_transcoder_set and its "
                            "cache read), or a CLT's W_enc_i/W_dec_i.safetensors.")
    p.add_argument("sources", type=path_arg, nargs="+", metavar="DIR")
    p.add_argument("--to", choices=("circuit-tracer",), default="circuit-tracer",
                   help="the format to write")
    p.add_argument("--out", type=path_arg, required=True, help="directory to write")
    p.add_argument("--no-pad", action="store_true", help="refuse layers of different widths "
                   "(by default a narrower layer is padded with dead latents: circuit-tracer's "
                   "TranscoderSet holds one width)")
    p.add_argument("--force", action="store_true", help="replace transcoders written in --out")
    p.set_defaults(handler=run_sae_convert)


def run_sae_convert(args: argparse.Namespace) -> int:
    from glassgpt.interp.sae.circuit_tracer import convert_to_circuit_tracer

    done = convert_to_circuit_tracer(args.sources, args.out, overwrite=args.force,
                                     pad=not args.no_pad)
    what = "cross-layer transcoder" if done.kind == "cross_layer_transcoder" else \
        "transcoder set"
    print(f"wrote circuit-tracer's {what} of {done.n_layers} layers, {max(done.widths)} "
          f"latents each, in {done.path}")
    for layer in done.padded_layers:
        print(f"  layer {layer}: padded from {done.widths[layer]} to {max(done.widths)} "
              f"latents with dead ones (never active)")
    return 0


def run_sae_train(args: argparse.Namespace) -> int:
    from glassgpt.interp.sae.training import train_dictionary

    settings = _settings(args)
    result = train_with_bar(args, "sae", train_dictionary, settings, start_line, _metrics_line,
                            lambda start: _reports_note(settings, start.step))
    if result is None:
        return INTERRUPTED_EXIT_CODE
    print(f"trained {settings.architecture} dictionary ({settings.d_sae} latents) at "
          f"{settings.hook} for {result.step} steps in {result.seconds:.1f}s; saved in "
          f"{result.out}" + (f"; {_metrics_line(result.metrics.summary())}"
                             if result.metrics else ""))
    return 0


def start_line(start: Any, run_dir: Any) -> str:
    """"training a topk SAE of 1,024 latents, k 32, on blocks.1.hook_resid_post (width 128) of
    RUN: 488 steps of 4,096 activations (2,000,000 in all, windows of 128 tokens), metrics every
    100 steps": what trains, on what, and how much of it (a resume: from which step)."""
    s = start.settings
    k = "" if s.k is None else f", k {s.k:g},"
    kind = "transcoder" if s.transcoder else "SAE"
    where = (f"from {s.hook} (width {start.d_in}) to {s.hook_out} (width {start.d_out})"
             if s.transcoder else f"on {s.hook} (width {start.d_in})")
    verb, resumed = ("resuming", f", from step {start.step}") if start.step else ("training", "")
    metrics = f"metrics every {s.eval_every} steps" if s.eval_every else "metrics at the end"
    return (f"{verb} a {s.architecture} {kind} of {s.d_sae:,} latents{k} {where} of "
            f"{run_dir}: {s.steps:,} steps of {s.batch_tokens:,} activations ({s.tokens:,} in "
            f"all, windows of {start.context} tokens){resumed}, {metrics}")


def _reports_note(settings: Any, step: int) -> str:
    """", plus 4 metric reports": what the step time leaves out of the estimate."""
    from glassgpt.cli.common import reports_left

    reports = reports_left(step, settings.steps, settings.eval_every)
    return f", plus {reports} metric report{'s' if reports != 1 else ''}" if reports else ""


def _settings(args: argparse.Namespace) -> Any:
    """The DictionarySettings of the command line: the flags (their defaults where not given),
    or with --resume the saved training's settings with the flags given in their place (one
    that differs from the saved setting is then refused by the resume)."""
    from glassgpt.errors import CommandLineError
    from glassgpt.interp.sae.training.state import saved_settings

    given = {SETTINGS[dest]: getattr(args, dest) for dest in getattr(args, "given", None) or ()}
    if args.resume:
        fields = saved_settings(args.out)
        if "tokens" in given:  # the decay is planned over the new number of steps
            fields.pop("lr_decay_steps", None)
        fields |= given
    elif args.hook is None or args.d_sae is None:
        raise CommandLineError("give the hook point and the number of latents (--hook, "
                               "--d-sae), or --resume to continue the training in --out")
    else:
        fields = {field: getattr(args, dest) for dest, field in SETTINGS.items()}
    fields["k"] = _k(fields.get("k"), fields.get("architecture"))
    return DictionarySettings(**fields)


def _k(k: float | int | None, architecture: str | None) -> float | int | None:
    if k is None or getattr(find(architecture), "k", None) != "count":  # whole latents
        return k
    return int(k) if float(k).is_integer() else k


def _metrics_line(m: dict[str, Any]) -> str:
    """The metrics in one line, saying over how many held-out tokens: a latent dead on a few
    thousand tokens of training's quick evaluations may fire on `sae eval`'s 65,536."""
    ce = "" if m.get("ce_loss_recovered") is None else \
        f", CE loss recovered {m['ce_loss_recovered']:.3f}"
    return (f"L0 {m['l0']:.2f}, explained variance {m['explained_variance']:.3f}, MSE "
            f"{m['mse']:.4g}{ce}, {m['dead']} dead, {m['dense']} dense "
            f"({m['tokens']:,} tokens)")


def run_sae_eval(args: argparse.Namespace) -> int:
    from glassgpt.cli.common import step_bar
    from glassgpt.interp.sae.evaluate import evaluate_on_run

    with step_bar("sae eval", "tokens") as bar:
        def progress(done: int, total: int) -> None:
            if bar.estimate is None:  # before the first batch
                say(eval_start_line(args, total))
                bar.begin(total)
            bar.advance(done)

        metrics = evaluate_on_run(args.sae, args.run, args.tokens, args.data, args.split,
                                  args.device, args.checkpoint, args.any_run, wording="cli",
                                  progress=progress)
    counts, edges = metrics.density_histogram(bins=10)
    if args.json:
        print(json.dumps({**metrics.summary(), "log10_density_histogram":
                          {"counts": counts.tolist(), "edges": edges.tolist()}}))
        return 0
    print(_metrics_line(metrics.summary()))
    print("log10 feature density:")
    largest = max(counts.tolist(), default=0)
    for count, low, high in zip(counts.tolist(), edges[:-1].tolist(), edges[1:].tolist(),
                                strict=True):
        print(f"  [{low:5.1f}, {high:5.1f})  {count:6d}  {'#' * bar_length(count, largest)}")
    return 0


def eval_start_line(args: argparse.Namespace, tokens: int) -> str:
    """"evaluating SAE on 65,536 tokens of the val split of RUN's data (fewer with --tokens N)"."""
    data = f"{args.data}" if args.data is not None else f"{args.run}'s data"
    return (f"evaluating {args.sae} on {tokens:,} tokens of the {args.split} split of {data} "
            f"(fewer with --tokens N)")


def bar_length(count: int, largest: int) -> int:
    """A histogram bar's characters: the largest count fills HISTOGRAM_WIDTH, the others in
    proportion, and a count that is not zero shows at least one."""
    if count <= 0 or largest <= 0:
        return 0
    return max(1, round(HISTOGRAM_WIDTH * count / largest))
