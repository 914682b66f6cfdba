"""`glassgpt demo NAME` (the experiments) and `glassgpt attention RUN_DIR` (attention maps).

The experiments live in `glassgpt.experiments` and return numbers; this module only parses flags,
renders the tables with rich, writes `--json`, and moves what an experiment made (its pictures,
the run `induction` saves) into --out, replacing nothing there without --force.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.rule import Rule
from rich.table import Table as RichTable

from glassgpt.cli.common import (
    add_checkpoint_flag,
    add_threads_flag,
    output_console,
    path_arg,
    say,
    stderr_progress,
)
from glassgpt.config_checks import INT64_MAX
from glassgpt.errors import CommandLineError
from glassgpt.experiments import EXPERIMENTS, ExperimentResult, Table, run_experiment
from glassgpt.experiments.results import listening_to_steps
from glassgpt.storage.files import (
    KIND_PHRASES,
    check_unlocked,
    entry_kind,
    write_bytes_atomic,
    write_text_atomic,
)
from glassgpt.storage.layout import LOCK_FILE, RUN, SNAPSHOTS_DIR
from glassgpt.storage.outputs import check_output_file

RULE_WIDTH = 80  # of the line above each experiment, in a file or a pipe
STEPS_PER_UPDATE = 10  # training steps between redraws of the progress line
SHAPES_FLAGS = {"batch_size": "--batch-size", "seq_len": "--seq-len", "d_model": "--d-model",
                "n_heads": "--n-heads"}


def register(subparsers: argparse._SubParsersAction) -> None:
    add_demo_command(subparsers)
    add_attention_command(subparsers)


def add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    listing = "\n".join(f"  {name:<10} {what}" for name, what in EXPERIMENTS.items())
    demo = subparsers.add_parser(
        "demo", help="run one of the 'seeing inside' experiments (or all)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"Run an experiment: print its tables, check its expected outcome, save its "
                    f"pictures.\nExit code 1 if an expected outcome was not shown.\n\n{listing}")
    demo.add_argument("name", choices=[*EXPERIMENTS, "all"], metavar="NAME",
                      help=f"one of {', '.join(EXPERIMENTS)}, or all")
    demo.add_argument("--out", type=path_arg, default=Path("demo_out"), metavar="DIR",
                      help="folder for the pictures (default: demo_out)")
    demo.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default: 0)")
    demo.add_argument("--quick", action="store_true",
                      help="the reduced size the tests use (seconds instead of a minute)")
    demo.add_argument("--json", type=path_arg, metavar="FILE",
                      help="also write the numbers as JSON")
    demo.add_argument("--force", action="store_true",
                      help="replace pictures in --out, the run `induction` saves there and the "
                           "--json file if they exist")
    add_threads_flag(demo)
    shapes = demo.add_argument_group("shapes only")
    shapes.add_argument("--batch-size", type=int, metavar="B", help="batch (default 2)")
    shapes.add_argument("--seq-len", type=int, metavar="T", help="positions (default 5)")
    shapes.add_argument("--d-model", type=int, metavar="C", help="width (default 16)")
    shapes.add_argument("--n-heads", type=int, metavar="H", help="heads (default 4)")
    features = demo.add_argument_group("features only")
    features.add_argument("--snapshots", type=int, metavar="N",
                          help="also train a toy model of superposition keeping N snapshots "
                               "at log-spaced steps and draw each feature's strength over "
                               "time, by its own weights and through a dictionary trained at "
                               "the end (features_over_time.png)")
    demo.set_defaults(handler=run_demo)


def add_attention_command(subparsers: argparse._SubParsersAction) -> None:
    attention = subparsers.add_parser(
        "attention", help="draw the attention maps of a trained run for a prompt",
        description="Draw every layer's and head's attention weights for a prompt as a grid "
                    "(queries down, keys across, token labels on the axes). Labels keep their "
                    "size: when a prompt is too long for one readable grid, FILE.png becomes "
                    "one picture per layer (FILE_layer0.png, ...) or per head "
                    "(FILE_layer0_head0.png, ...).")
    attention.add_argument("run_dir", type=path_arg, metavar="RUN_DIR", help="a trained run")
    attention.add_argument("--prompt", required=True, help="the text to look at")
    attention.add_argument("--layer", type=int, help="draw only this layer (0-based)")
    attention.add_argument("--head", type=int, help="draw only this head (0-based)")
    attention.add_argument("--out", type=path_arg, default=Path("demo_out") / "attention.png",
                           metavar="FILE.png",
                           help="where to write the picture, split by layer or head for long "
                                "prompts (default: demo_out/attention.png, beside the demos' "
                                "pictures)")
    attention.add_argument("--force", action="store_true",
                           help="replace the pictures if they exist")
    add_checkpoint_flag(attention, "draw")
    add_threads_flag(attention)
    attention.set_defaults(handler=run_attention)


# --- demo ----------------------------------------------------------------------------------

def shapes_options(args: argparse.Namespace) -> dict[str, int]:
    """The --batch-size/--seq-len/--d-model/--n-heads values given, which only `shapes` takes."""
    given = {key: getattr(args, key) for key in SHAPES_FLAGS if getattr(args, key) is not None}
    if given and args.name != "shapes":
        flags = [SHAPES_FLAGS[key] for key in given]
        verb = "applies" if len(flags) == 1 else "apply"
        raise CommandLineError(f"{' and '.join(flags)} only {verb} to `glassgpt demo shapes`, "
                               f"not to `glassgpt demo {args.name}`")
    return given


def features_options(args: argparse.Namespace) -> dict[str, int]:
    """--snapshots, which only `features` takes."""
    if args.snapshots is None:
        return {}
    if args.name != "features":
        raise CommandLineError(f"--snapshots only applies to `glassgpt demo features`, not to "
                               f"`glassgpt demo {args.name}`")
    return {"snapshots": args.snapshots}


def run_demo(args: argparse.Namespace) -> int:
    options = shapes_options(args) | features_options(args)
    if not 0 <= args.seed <= INT64_MAX:  # as train's and sample's seeds
        raise CommandLineError(f"--seed must be between 0 and 2**63 - 1, got {args.seed}")
    if args.out.exists() and not args.out.is_dir():
        raise CommandLineError(f"--out {args.out} is a file; give a folder for the pictures")
    names = list(EXPERIMENTS) if args.name == "all" else [args.name]
    if args.json is not None:
        check_output_file(args.json, args.force, CommandLineError)  # before the run
    for run_name in runs_saved_by(names):
        check_run_destination(args.out / run_name, args.force)  # before the training
    from glassgpt.machine.devices import cpu_threads

    console = output_console()
    results = {}
    threads = args.threads
    for number, name in enumerate(names, 1):
        started = time.perf_counter()
        with experiment_progress(name, number, len(names)), staged_pictures(args) as staging:
            result = run_experiment(name, staging, seed=args.seed, quick=args.quick,
                                    threads=threads, **options)
            result.pictures = deliver_pictures(result.pictures, staging, args.out, args.force)
            if "run" in result.numbers:
                run = deliver_run(Path(result.numbers["run"]), args.out, args.force)
                result.numbers["run"] = str(run)
        if not results:
            console.print(f"[dim]{cpu_threads(result.threads)}[/dim]")
        threads = result.threads  # auto is settled once, by the first experiment
        results[name] = result
        print_result(console, result, time.perf_counter() - started)
    if args.json is not None:
        write_json(args.json, results, args.seed, args.quick)
        console.print(f"numbers written to {args.json}")
    failed = [name for name, result in results.items() if not result.all_checks_hold]
    if len(results) > 1:
        shown = len(results) - len(failed)
        colour = "red" if failed else "green"
        console.print(f"[bold {colour}]{shown}/{len(results)} experiments showed what they "
                      f"claim[/bold {colour}]")
    if failed:
        console.print(f"[red]expected outcome not shown by: {', '.join(failed)}[/red]")
        return 1
    return 0


@contextlib.contextmanager
def staged_pictures(args: argparse.Namespace) -> Iterator[Path]:
    """A fresh folder inside --out for one experiment's pictures, removed afterwards: what the
    experiment draws reaches --out only through `deliver_pictures`. An --out made here and
    left empty (the experiment refused its options, say) is removed again."""
    made = not args.out.exists()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=args.out, prefix=".glassgpt-demo-") as staging:
            yield Path(staging)
    finally:
        if made and not any(args.out.iterdir()):
            args.out.rmdir()


def deliver_pictures(pictures: list[Path], staging: Path, out: Path, force: bool) -> list[Path]:
    """An experiment's pictures from `staging` written into `out`, each whole or not at all
    (files.write_bytes_atomic; `staging` goes with its folder). Every destination is checked
    first (a file that is already there, from an earlier run or the user's, is replaced only
    with --force), so a refusal leaves `out` as it was."""
    destinations = [out / picture.relative_to(staging) for picture in pictures]
    for destination in destinations:
        check_output_file(destination, force, CommandLineError)
    for picture, destination in zip(pictures, destinations, strict=True):
        destination.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(destination, picture.read_bytes())  # the one atomic writer
    return destinations


def runs_saved_by(names: list[str]) -> list[str]:
    """The run directories (their names under --out) the experiments `names` will save."""
    if "induction" not in names:
        return []
    from glassgpt.experiments.induction import RUN_NAME  # here: it imports torch

    return [RUN_NAME]


def check_run_destination(run_dir: Path, force: bool) -> bool:
    """Refuse a place the demo may not save its run in; True when it replaces an earlier run
    there. A new or empty directory takes the run; anything else only with --force, and then
    only a run glassgpt wrote that holds nothing but a run's files (it is replaced whole, so
    nothing of the user's may be in it), and not while another command writes it."""
    kind = entry_kind(run_dir)
    if kind == "missing":
        return False
    if kind != "directory":
        raise CommandLineError(f"{run_dir} is {KIND_PHRASES[kind]}, where the demo saves its "
                               f"run; move it, or give another --out")
    present = sorted(path.name for path in run_dir.iterdir())
    if not present:
        return False
    if not force:
        raise CommandLineError(f"{run_dir} already exists; pass --force to replace the run "
                               f"there, or give another --out")
    others = [name for name in present if name not in (*RUN.own_files, LOCK_FILE,
                                                        SNAPSHOTS_DIR)]
    from glassgpt.rundir.directory import is_glassgpt_run

    if others or not is_glassgpt_run(run_dir):
        what = f"{others[0]!r}, which is no file of a run" if others else "no glassgpt run"
        raise CommandLineError(f"{run_dir} holds {what}; --force replaces only a run glassgpt "
                               f"wrote: move it, or give another --out")
    check_unlocked(run_dir, CommandLineError)
    return True


def deliver_run(run: Path, out: Path, force: bool) -> Path:
    """Copy the run directory an experiment saved into `out`, under its own name, checked again
    first (`check_run_destination`); it appears whole, and an earlier run there (--force) goes
    only once the new one is complete."""
    from glassgpt.storage.commit import staged_directory

    destination = out / run.name
    replacing = check_run_destination(destination, force)
    with staged_directory(destination, replacing=replacing) as staging:
        for file in run.iterdir():
            if file.name == SNAPSHOTS_DIR:  # the weights at log-spaced steps, a folder
                shutil.copytree(file, staging / file.name)
            else:
                shutil.copyfile(file, staging / file.name)
    return destination


@contextlib.contextmanager
def experiment_progress(name: str, number: int, count: int) -> Iterator[None]:
    """While one experiment runs (a minute at full size), a line on stderr with its name, the
    training steps it has taken and the time it has run; gone once its tables print."""
    from rich.progress import SpinnerColumn, TimeElapsedColumn

    which = f" ({number}/{count})" if count > 1 else ""
    columns = (SpinnerColumn(), f"[bold]demo {escape(name)}{which}",
               "{task.fields[steps]:,} training steps", TimeElapsedColumn())
    with stderr_progress(*columns) as bar:
        task = bar.add_task(name, total=None, steps=0)
        steps = 0

        def step_taken() -> None:
            nonlocal steps
            steps += 1
            if steps % STEPS_PER_UPDATE == 0:
                bar.update(task, steps=steps)

        with listening_to_steps(step_taken):
            yield


def print_result(console: Console, result: ExperimentResult, seconds: float) -> None:
    # Experiment text is plain, never markup: "[block] * L" must print as written.
    rule = Rule(f"[bold]{result.name}[/bold]: {escape(result.summary)}")
    console.print(rule, width=console.width if console.is_terminal else RULE_WIDTH)
    for table in result.tables:
        console.print(rich_table(table))
    for check in result.checks:
        mark = "[green]✓[/green]" if check.holds else "[red]✗[/red]"
        console.print(f"{mark} {escape(check.claim)}")
    for picture in result.pictures:
        console.print(f"picture: {escape(str(picture))}")
    if "run" in result.numbers:
        run = escape(result.numbers["run"])
        console.print(f"run: {run} (open it with `glassgpt view {run}` or `glassgpt sample {run}`)")
    console.print(f"[dim]{result.name} took {seconds:.1f} s[/dim]\n")


def rich_table(table: Table) -> RichTable:
    out = RichTable(title=escape(table.title), title_justify="left")
    for column in table.columns:
        out.add_column(escape(column), overflow="fold")
    for row in table.rows:
        out.add_row(*(escape(format_value(value, table.formats.get(column)))
                      for column, value in zip(table.columns, row, strict=True)))
    return out


def format_value(value: Any, spec: str | None = None) -> str:
    """A table cell as text: the column's format if it has one, else a default per type."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if spec is not None:
        return format(value, spec)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0.0:
            return "0"
        return f"{value:.1e}" if abs(value) < 1e-3 or abs(value) >= 1e6 else f"{value:.3f}"
    return str(value)


def write_json(path: Path, results: dict[str, ExperimentResult], seed: int, quick: bool) -> None:
    payload = {"seed": seed, "quick": quick,
               "experiments": {name: result.to_dict() for name, result in results.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


# --- attention -----------------------------------------------------------------------------

def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def drawn_panels(L: int, H: int, layer: int | None, head: int | None) -> str:
    """What `--layer`/`--head` selected, in words: "4 layers x 4 heads", "layer 1, head 3",
    "4 heads of layer 1", "head 3 of 4 layers"."""
    layers = plural(L, "layer") if layer is None else f"layer {layer}"
    heads = plural(H, "head") if head is None else f"head {head}"
    if layer is None and head is None:
        return f"{layers} x {heads}"
    if layer is not None and head is not None:
        return f"{layers}, {heads}"
    return f"{heads} of {layers}"


def picture_paths(model: Any, tokenizer: Any, args: argparse.Namespace) -> list[Path]:
    """The pictures `draw_prompt_attention` will write for this prompt, known before it draws
    (a long prompt's maps are split over one picture per layer or per head)."""
    import torch

    from glassgpt.experiments.attention_maps import plan_pages, select_panels

    config = model.config
    shape = torch.empty(config.n_layer, config.n_head, 0, 0)  # (L, H, ., .): only its size
    panels = select_panels(shape, args.layer, args.head)
    return [page.path(args.out) for page in plan_pages(panels, len(tokenizer.encode(args.prompt)))]


def run_attention(args: argparse.Namespace) -> int:
    from glassgpt.experiments.attention_maps import draw_prompt_attention
    from glassgpt.machine.devices import cpu_threads
    from glassgpt.rundir.checkpoint import Run

    if args.out.is_dir():
        raise CommandLineError(f"--out {args.out} is a folder; give a file name such as maps.png")
    check_output_file(args.out, args.force, CommandLineError)  # before loading the model
    run = Run(args.run_dir)  # resolved once
    model, tokenizer = run.load_model(checkpoint=args.checkpoint)
    for path in picture_paths(model, tokenizer, args):  # a long prompt's split pictures too
        check_output_file(path, args.force, CommandLineError)
    title = f"{args.run_dir.name}: attention for {args.prompt!r}"
    drawn = draw_prompt_attention(model, tokenizer, args.prompt, args.out, layer=args.layer,
                                  head=args.head, threads=args.threads,
                                  title=title if len(title) <= 100 else title[:99] + "…")
    say(f"drew {run.describe_weights(args.checkpoint)} ({cpu_threads(drawn.threads)})")
    L, H, T = drawn.shape
    paths = drawn.paths
    what = f"attention maps of {drawn_panels(L, H, args.layer, args.head)} over " \
           f"{plural(T, 'token')}"
    if len(paths) == 1:
        print(f"{what} written to {paths[0]}")
    else:
        print(f"{what} written to {len(paths)} pictures (one grid would shrink the labels):")
        for path in paths:
            print(f"  {path}")
    return 0
