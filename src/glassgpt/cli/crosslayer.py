"""`glassgpt sae train-clt RUN --d-transcoder N --out DIR`: a cross-layer transcoder over
every MLP of a run's model (glassgpt.interp.sae.training.crosslayer_run.train_crosslayer),
saved in circuit-tracer's layout. Its flags are CrossLayerSettings's fields, which import
without torch."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from glassgpt.cli.common import (
    DefaultsHelpFormatter,
    add_checkpoint_flag,
    add_settings_flags,
    path_arg,
    train_with_bar,
)
from glassgpt.cli.train import INTERRUPTED_EXIT_CODE
from glassgpt.interp.sae.training.crosslayer_settings import (
    CLT_ARCHITECTURES,
    CrossLayerSettings,
)
from glassgpt.interp.sae.training.settings import NORMALIZATIONS

SETTINGS = {f.name: f.name for f in dataclasses.fields(CrossLayerSettings)}


class Given(argparse.Action):
    """Stores a flag's value and notes that it was given (a resume keeps the others)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        namespace.given = {*(getattr(namespace, "given", None) or ()), self.dest}


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "train-clt", formatter_class=DefaultsHelpFormatter,
        help="train a cross-layer transcoder over every MLP of a run",
        description="Train a cross-layer transcoder on RUN_DIR's model: at each layer an "
        "encoder reading the MLP's input, decoders writing into that MLP's output and every "
        "later one's (Anthropic's Circuit Tracing objective). Saved in circuit-tracer's "
        "layout, with its trainer state for --resume.")
    p.add_argument("run_dir", type=path_arg, metavar="RUN_DIR")
    p.add_argument("--out", type=path_arg, required=True, help="directory to write")
    add_settings_flags(p, CrossLayerSettings, SETTINGS, Given,
                       choices={"architecture": CLT_ARCHITECTURES,
                                "normalize_activations": NORMALIZATIONS})
    p.set_defaults(d_transcoder=None)  # no default: a new training is told it
    p.add_argument("--data", type=path_arg, help="prepared data directory, or a text file "
                   "(default: the run's)")
    p.add_argument("--resume", action="store_true", help="continue the training in --out")
    p.add_argument("--force", action="store_true", help="replace the CLT glassgpt trained in "
                   "--out")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    add_checkpoint_flag(p, "read")
    p.set_defaults(handler=run_train_clt, command_words=("sae", "train-clt"))


def run_train_clt(args: argparse.Namespace) -> int:
    from glassgpt.interp.sae.training.crosslayer_run import train_crosslayer

    settings = settings_of(args)
    result = train_with_bar(args, "sae train-clt", train_crosslayer, settings, start_line,
                            metrics_line)
    if result is None:
        return INTERRUPTED_EXIT_CODE
    print(f"trained a {settings.architecture} cross-layer transcoder ({result.clt.n_layers} "
          f"layers, {settings.d_transcoder} features each) for {result.step} steps in "
          f"{result.seconds:.1f}s; saved in {result.out}"
          + (f"; {metrics_line(result.metrics.summary())}" if result.metrics else ""))
    return 0


def settings_of(args: argparse.Namespace) -> CrossLayerSettings:
    """The flags (their defaults where not given), or with --resume the saved training's
    settings with the flags given in their place."""
    from glassgpt.errors import CommandLineError
    from glassgpt.interp.sae.training.crosslayer_trainer import read_clt_state

    given = {dest: getattr(args, dest) for dest in getattr(args, "given", None) or ()}
    if args.resume:
        fields = read_clt_state(args.out)["settings"]
        if "tokens" in given:  # the decay is planned over the new number of steps
            fields.pop("lr_decay_steps", None)
        fields |= given
    elif args.d_transcoder is None:
        raise CommandLineError("give the number of features a layer (--d-transcoder), or "
                               "--resume to continue the training in --out")
    else:
        fields = {name: getattr(args, name) for name in SETTINGS}
    return CrossLayerSettings(**fields)


def start_line(start: Any, run_dir: Any) -> str:
    """"training a jumprelu cross-layer transcoder of 4 layers x 1,024 features (width 128) of
    RUN: 1,953 steps of 1,024 positions (2,000,000 in all, windows of 64 tokens), ..."."""
    s = start.settings
    verb, resumed = ("resuming", f", from step {start.step}") if start.step else ("training", "")
    metrics = f"metrics every {s.eval_every} steps" if s.eval_every else "metrics at the end"
    return (f"{verb} a {s.architecture} cross-layer transcoder of {start.n_layers} layers x "
            f"{s.d_transcoder:,} features (width {start.d_model}, {s.input_point} -> "
            f"{s.output_point}) of {run_dir}: {s.steps:,} steps of {s.batch_tokens:,} "
            f"positions ({s.tokens:,} in all, windows of {start.context} tokens){resumed}, "
            f"{metrics}")


def metrics_line(m: dict[str, Any]) -> str:
    """Per-layer L0 and explained variance, the spliced CE loss recovered (every MLP replaced),
    the dead features, over how many held-out tokens."""
    l0 = " ".join(f"{v:.1f}" for v in m["l0"])
    ev = " ".join(f"{v:.3f}" for v in m["explained_variance"])
    return (f"L0 by layer {l0}; explained variance {ev}; CE loss recovered "
            f"{m['ce_loss_recovered']:.3f} (every MLP replaced); {m['dead']} of "
            f"{m['features']:,} features dead ({m['tokens']:,} tokens)")
