"""Flags that several commands share, and how they turn into library calls.

Light on imports (no torch, no model): a command's parser is built from these before anything
heavy loads, so `--help` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glassgpt.machine.threadsetting import AUTO, parse_threads
from glassgpt.storage.layout import checkpoint_step

if TYPE_CHECKING:
    import torch
    from rich.console import Console
    from rich.progress import Progress

DEFAULT_PROMPT = "\n"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each flag's default, except where there is none to show (None, off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


# In a file or a pipe rich assumes 80 columns and folds or cuts a wider table; there, lines are
# as long as their content instead (a terminal keeps its own width, and so does COLUMNS=N).
UNWRAPPED_WIDTH = 10_000


def output_console(stderr: bool = False) -> Console:
    """A rich Console for a command's tables: the terminal's width, or unwrapped when the output
    goes to a file or a pipe (`glassgpt bench > out.txt`)."""
    from rich.console import Console

    console = Console(stderr=stderr)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=stderr, width=UNWRAPPED_WIDTH)


@contextlib.contextmanager
def stderr_progress(*columns: Any) -> Iterator[Progress]:
    """A rich progress bar on stderr, where training's bar shows the same things (a bar, an
    estimate of the time left), for the minutes a command would otherwise be silent. Only on a
    terminal: in a log or a pipe it draws nothing, so what it leaves there is the output."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    with Progress(*columns, console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        yield progress


# --- a long command's progress -------------------------------------------------------------------

ESTIMATE_AFTER_UNITS = 3  # units timed past the first report (a warm-up) before an estimate
ESTIMATE_AFTER_SECONDS = 3.0  # ... and this long: a fast loop's first steps say little


def duration_text(seconds: float) -> str:
    """"45 s", "3 min 20 s", "1 h 05 min": a wait as a person reads it."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def rate_text(per_second: float, unit: str) -> str:
    """"3,120 tokens/s", or "0.42 s per step" for a rate below one a second."""
    if per_second >= 1:
        return f"{per_second:,.{0 if per_second >= 10 else 1}f} {unit}/s"
    return f"{1 / per_second:.2f} s per {unit.removesuffix('s')}"


class Estimate:
    """The time the rest of a loop takes at its measured rate. The first report ends the
    warm-up (allocations, the first forward, a thread count being timed); the rate is measured
    from there, and once ESTIMATE_AFTER_UNITS units and ESTIMATE_AFTER_SECONDS have gone by,
    `line` returns the estimate, once. `extra_seconds` is work the rate leaves out that the
    caller knows the cost of (evaluations to come), added; `note` says what it is."""

    def __init__(self, total: int, unit: str = "steps", note: str = "",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.unit, self.note, self.clock = total, unit, note, clock
        self.extra_seconds = 0.0
        self.since: tuple[int, float] | None = None  # (units done, time) at the warm-up's end
        self.said = False

    def line(self, done: int) -> str | None:
        now = self.clock()
        if self.since is None:
            self.since = (done, now)
            return None
        units, seconds = done - self.since[0], now - self.since[1]
        if self.said or done >= self.total or units < ESTIMATE_AFTER_UNITS \
                or seconds < ESTIMATE_AFTER_SECONDS:
            return None
        self.said = True
        left = self.total - done
        time_left = left * seconds / units + self.extra_seconds
        return (f"estimated {duration_text(time_left)} for the {left:,} "
                f"{self.unit} left, at {rate_text(units / seconds, self.unit)} (measured over "
                f"{units:,} {self.unit}){self.note}")


class StepBar:
    """A long command's progress on stderr: a bar on a terminal (units done of all, the
    caller's stats, the time left at the recent rate: rich's) and, on a terminal or not, the
    estimate's line (`Estimate`) once a few units ran."""

    def __init__(self, bar: Progress, unit: str = "steps") -> None:
        self.bar, self.unit = bar, unit
        self.task: Any = None
        self.estimate: Estimate | None = None

    def begin(self, total: int, done: int = 0, note: str = "") -> None:
        self.task = self.bar.add_task("", total=total, completed=done, stats="")
        self.estimate = Estimate(total, self.unit, note)

    def advance(self, done: int, stats: str = "") -> None:
        if self.estimate is None:
            return  # no begin: nothing to measure against
        self.bar.update(self.task, completed=done, stats=stats)
        line = self.estimate.line(done)
        if line is not None:
            say(line)


def reports_left(done: int, total: int, every: int) -> int:
    """The reports a loop still makes after `done` of `total` steps: one each `every` steps
    and one at the end (only at the end when `every` is 0)."""
    if done >= total:
        return 0
    if not every:
        return 1
    return total // every - done // every + (1 if total % every else 0)


class EstimatingReporter:
    """A training Reporter (training.metrics) that passes everything on to `inner` (train's
    bar) and says, once a few logged steps ran, how long the rest takes: the step time
    measured after the first log (the evaluation at step 0 and the thread count's timing are
    the warm-up), plus each evaluation to come at the cost the first one measured."""

    def __init__(self, inner: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.inner, self.clock = inner, clock
        self.eval_every = 0
        self.estimate: Estimate | None = None
        self.started_at: float | None = None
        self.eval_seconds: float | None = None

    @property
    def output_closed(self) -> bool:
        return self.inner.output_closed

    def start(self, total: int, done: int) -> None:
        self.inner.start(total, done)
        self.estimate = Estimate(total, "steps", clock=self.clock)
        self.started_at = self.clock()

    def log(self, record: dict[str, Any]) -> None:
        self.inner.log(record)
        self.started_at = None  # an evaluation after this one is not the first step's
        if self.estimate is None:
            return
        done = record["iter"]
        evaluations = reports_left(done, self.estimate.total, self.eval_every)
        if evaluations and self.eval_seconds is not None:
            self.estimate.extra_seconds = evaluations * self.eval_seconds
            self.estimate.note = (f", and {evaluations} evaluation"
                                  f"{'s' if evaluations != 1 else ''} of "
                                  f"{duration_text(self.eval_seconds)}")
        line = self.estimate.line(done)
        if line is not None:
            say(line)

    def eval(self, record: dict[str, Any]) -> None:
        self.inner.eval(record)
        if self.started_at is not None:  # the evaluation before any step: its cost measured
            self.eval_seconds = self.clock() - self.started_at
            self.started_at = None

    def stop(self) -> None:
        self.inner.stop()


@contextlib.contextmanager
def step_bar(label: str, unit: str = "steps") -> Iterator[StepBar]:
    """A StepBar drawn as training's bar is (`label`, the bar, done/total, stats, time left),
    on stderr and only on a terminal (stderr_progress)."""
    from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn

    with stderr_progress(f"[bold]{label}", BarColumn(), MofNCompleteColumn(),
                         "{task.fields[stats]}", TimeRemainingColumn()) as bar:
        yield StepBar(bar, unit)


def say(message: str) -> None:
    """A line for the user that is not the command's output (stderr, so pipes stay clean)."""
    print(message, file=sys.stderr, flush=True)


def train_with_bar(args: argparse.Namespace, label: str, train: Callable[..., Any],
                   settings: Any, start_line: Callable[[Any, Path], str],
                   metrics_line: Callable[[dict[str, Any]], str],
                   note: Callable[[Any], str] | None = None) -> Any:
    """What `sae train` and `sae train-clt` do around their library call `train` (both take
    the same arguments): the start line, training's bar with its estimate (`note`: what it
    leaves out), a line per metric report, and on Ctrl-C the command that continues. The
    result, or None when interrupted (saved, and said)."""
    stop = threading.Event()
    with step_bar(label) as bar:
        def announce(start: Any) -> None:
            say(start_line(start, args.run_dir))
            bar.begin(settings.steps, start.step, note(start) if note else "")

        result = train(args.run_dir, settings, args.out, data=args.data,
                       checkpoint=args.checkpoint, device=args.device, resume=args.resume,
                       force=args.force, report=dictionary_reporter(bar, metrics_line),
                       stop=stop, on_start=announce)
    if not result.interrupted:
        return result
    say(f"interrupted at step {result.step}; saved in {result.out}; continue with: "
        f"{resume_command(args)}")
    return None


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues a dictionary's training (`args.command_words`, e.g.
    "sae train"): the run, --resume, --out, and the flags that are not settings (the resume
    reads the settings from the saved training)."""
    words = ["glassgpt", *args.command_words, str(args.run_dir), "--resume", "--out",
             str(args.out)]
    if args.data is not None:
        words += ["--data", str(args.data)]
    if args.device != "cpu":
        words += ["--device", args.device]
    if args.checkpoint != "best":
        words += ["--checkpoint", args.checkpoint]
    return shlex.join(words)


def dictionary_reporter(bar: StepBar, metrics_line: Callable[[dict[str, Any]], str]
                        ) -> Callable[[int, dict[str, Any]], None]:
    """A dictionary trainer's `report` (an SAE's, a transcoder's, a CLT's): each step on the bar
    with its batch's MSE, L0 and dead latents, and a line on stderr per metric report, written
    by `metrics_line` from the record's eval_ values."""
    def report(step: int, record: dict[str, Any]) -> None:
        bar.advance(step, f"mse {record['mse_loss']:.4g}  l0 {record['l0']:.1f}  dead "
                    f"{record['dead']}")
        if "eval_l0" in record:
            say(f"step {step}: " + metrics_line(
                {k.removeprefix("eval_"): v for k, v in record.items()
                 if k.startswith("eval_")}))

    return report


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=parse_threads, default=AUTO,
                        metavar="N|auto",
                        help="CPU threads: a count, or auto (default: time the first steps at "
                        "one thread and at all cores and keep the faster; OMP_NUM_THREADS, "
                        "when set, is kept)")


def checkpoint_arg(text: str) -> str:
    """The `type` of --checkpoint: best, last, or a snapshot's step:N."""
    try:
        checkpoint_step(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_checkpoint_flag(parser: argparse.ArgumentParser, what: str = "use") -> None:
    parser.add_argument("--checkpoint", type=checkpoint_arg, default="best",
                        metavar="best|last|step:N",
                        help=f"which weights of the run to {what}: the best evaluation's "
                        f"(default), the last checkpoint's, or the snapshot at step N "
                        f"(`train --snapshots`)")


def warn_about_bf16(dtype: str, device: torch.device) -> None:
    """One line when bfloat16 was asked for on a CPU that runs it slowly."""
    if dtype == "bfloat16":
        from glassgpt.machine import devices

        warning = devices.bf16_warning(device)
        if warning:
            say(f"warning: {warning}")


def path_arg(text: str) -> Path:
    """The `type` of every path flag: an empty path (`--out ''`) names no file or directory
    (as a directory it would be the working directory), so it is refused with one line."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names no file or directory; give one")
    return Path(text)


def nonempty_arg(text: str) -> str:
    """The `type` of a flag naming files by pattern: an empty one is refused like a path."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names no file or directory; give one")
    return text


# --- flags made from a dataclass's fields ---------------------------------------------------

def _int_list(text: str) -> tuple[int, ...]:
    """A flag's "3,7,11" as (3, 7, 11) (a per-layer setting such as --nope-layers)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got "
                                         f"{text!r:.80}") from None


FLAG_TYPES = {"int": int, "float": float, "str": str, "tuple[int, ...]": _int_list}


def add_dataclass_flags(group: argparse._ArgumentGroup, cls: type, prefix: str,
                         shown: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    """A `--field-name` flag per dataclass field, typed from its annotation; unset is None.
    The default shown is `shown`'s value for the field (a preset's), else the field's own."""
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata["help"]  # every field says what it is (setting(doc))
        default = shown.get(field.name, field.default)
        if default not in (dataclasses.MISSING, None) and "(default" not in help_text:
            help_text += f" (default {default})"
        if _is_switch(field):  # "bool | None" too: unset is None either way
            group.add_argument(flag, dest=f"{prefix}_{field.name}",
                               action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            kind = _kind(field)
            group.add_argument(flag, dest=f"{prefix}_{field.name}", type=FLAG_TYPES[kind],
                               default=None, metavar="LIST" if "," in kind else kind.upper(),
                               help=help_text)


def add_settings_flags(group: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                       flags: dict[str, str], action: type[argparse.Action],
                       choices: dict[str, tuple[str, ...]] | None = None) -> None:
    """A flag per entry of `flags` (the flag's name, `_` for `-` -> the field of dataclass
    `cls` it sets), typed, explained and defaulted by its field (the default is the field's own,
    shown by the parser's formatter). `action` stores a value, and True for a switch (which
    takes none): it can note which flags were given."""
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for name, field_name in flags.items():
        field = fields[field_name]
        flag = "--" + name.replace("_", "-")
        settings = dict(dest=name, default=field.default, action=action,
                        help=field.metadata["help"])
        if _is_switch(field):
            group.add_argument(flag, nargs=0, **settings)
        else:
            group.add_argument(flag, type=FLAG_TYPES[_kind(field)],
                               choices=(choices or {}).get(name), **settings)


def _is_switch(field: dataclasses.Field) -> bool:
    return field.type.startswith("bool")


def _kind(field: dataclasses.Field) -> str:
    """The flag's type of a field: "float | None" is a float flag."""
    return field.type.partition(" | ")[0]


def given_flags(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The settings given on the command line, e.g. {'max_iters': 100}."""
    start = prefix + "_"
    return {key.removeprefix(start): value for key, value in vars(args).items()
            if key.startswith(start) and value is not None}
