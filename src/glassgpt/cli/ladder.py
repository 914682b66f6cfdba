"""`glassgpt bench ladder`: time to a target val loss, one speedrun change at a time.

The measuring is glassgpt.bench.ladder; this module adds the flags, prints the table and writes
the JSON and the picture.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from glassgpt.cli.common import output_console, path_arg
from glassgpt.config import NOISE, QUICK_TARGET, TARGET_LOSS
from glassgpt.errors import ConfigError
from glassgpt.storage.files import write_text_atomic
from glassgpt.storage.outputs import check_output_file

if TYPE_CHECKING:  # the ladder trains models (torch): it loads in the handler, not for --help
    from glassgpt.bench import ladder

DEFAULT_PLOT = Path("ladder.png")


def add_ladder_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("bench ladder")
    group.add_argument("--target-loss", type=float, default=None, metavar="X",
                       help=f"val loss every rung trains to (default {TARGET_LOSS}; "
                       f"{QUICK_TARGET} with --quick)")
    group.add_argument("--seeds", type=int, default=1,
                       help="seeds per rung (default 1); the verdicts compare their ranges")
    group.add_argument("--recheck-close", type=int, default=0, metavar="N",
                       help="give each rung whose gain is close (under "
                       f"{NOISE:.0%}%) and the rung before it N seeds in all")
    group.add_argument("--rungs", nargs="+", metavar="NAME",
                       help="train only these rungs (default: all, in ladder order; an "
                       "unknown name is refused with the list)")
    group.add_argument("--plot", type=path_arg, default=DEFAULT_PLOT,
                       help=f"picture of val loss against wall time (default {DEFAULT_PLOT}; "
                       f"an existing one is replaced only with --force)")
    group.add_argument("--data", type=path_arg,
                       help="prepared data directory (default: Tiny Shakespeare, character "
                       "level, prepared into the cache)")


def run_ladder_command(args: argparse.Namespace) -> int:
    from glassgpt.bench import ladder
    from glassgpt.machine import distributed as ddp
    from glassgpt.training.runs import training_data

    target = args.target_loss if args.target_loss is not None else \
        (QUICK_TARGET if args.quick else TARGET_LOSS)
    check_ladder_flags(args, target, ladder.MAX_SEEDS)
    data = training_data(args.data, ddp.DistContext())
    with Console(stderr=True).status("climbing the ladder") as status:
        report = ladder.run_ladder(data, target, quick=args.quick, seeds=args.seeds,
                                   recheck_close=args.recheck_close, only=args.rungs,
                                   progress=status.update)
    console = output_console()
    m = report.machine
    console.print(f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average "
                  f"{m['load_before']:.2f} before, {m['load_after']:.2f} after; the ladder took "
                  f"{report.seconds:.0f} s" if m.get("load_before") is not None else m["cpu"])
    console.print(ladder_table(report, console.width))
    print_changes(report, console)
    ladder.plot_ladder(report, args.plot)
    console.print(f"picture: {args.plot}")
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return 0


def check_ladder_flags(args: argparse.Namespace, target: float, max_seeds: int) -> None:
    """Refuse, before the minutes of training, what cannot give an answer or a picture."""
    if not 0 < target < float("inf"):  # NaN too
        raise ConfigError(f"--target-loss must be a positive number (a cross-entropy is never "
                          f"below 0), got {target}")
    if not 1 <= args.seeds <= max_seeds or not 0 <= args.recheck_close <= max_seeds:
        raise ConfigError(f"--seeds must be between 1 and {max_seeds} and --recheck-close "
                          f"between 0 and {max_seeds} (each seed trains every rung again), "
                          f"got {args.seeds} and {args.recheck_close}")
    if args.json is not None and args.plot.resolve() == args.json.resolve():
        raise ConfigError(f"--json and --plot both name {args.plot}; give two files")
    check_output_file(args.plot, args.force, ConfigError)  # --json: checked by `bench`


# Below this width the 11 columns fold into fragments: a terminal that narrow gets the 7 that
# say what each rung bought (the JSON keeps every figure).
FULL_TABLE_WIDTH = 150
FULL_COLUMNS = ("rung", "steps", "seconds", "CPU s", "tokens/s", "evals", "val", "full val",
                "vs previous", "vs base", "verdict")
NARROW_COLUMNS = ("rung", "steps", "seconds", "val", "vs prev", "vs base", "verdict")
CAPTION = ("seconds: the trainer's wall time to the first evaluation at or below the target "
           "(median over seeds, \\[range]); evals: the share of it spent outside training "
           "steps (evaluations, checkpoints, compiling); CPU s: this process's CPU seconds for "
           "the whole run, all threads; full val: the stopped weights on the whole val split")
NARROW_CAPTION = ("seconds: wall time to the first evaluation at or below the target; val: "
                  "the loss there (or at the end); close: check with --recheck-close 3")


def ladder_table(report: ladder.LadderReport, width: int = FULL_TABLE_WIDTH) -> Table:
    """The ladder as a table: every column when `width` has room, else the narrow seven."""
    narrow = width < FULL_TABLE_WIDTH
    columns = NARROW_COLUMNS if narrow else FULL_COLUMNS
    table = Table(title=f"Time to val loss {report.target_loss:g}, one change at a time "
                  f"(Tiny Shakespeare, char" + (", --quick" if report.quick else "") + ")",
                  caption=NARROW_CAPTION if narrow else CAPTION)
    for column in columns:
        table.add_column(column, justify="left" if column in ("rung", "verdict") else "right",
                         overflow="fold", no_wrap=column == "rung")
    for rung in report.rungs:
        if rung.skipped:
            table.add_row(rung.name, *[""] * (len(columns) - 2),
                          "skipped" if narrow else f"skipped: {rung.skipped}")
            continue
        cells = rung_cells(rung, narrow)
        table.add_row(*(cells[column] for column in columns))
    return table


def rung_cells(rung: ladder.RungResult, narrow: bool) -> dict[str, str]:
    """Column -> text of one rung that ran."""
    seconds, spread = rung.seconds(), rung.seconds_range()
    seconds_text = "-" if seconds is None else f"{seconds:.1f}"
    if spread and len(rung.runs) > 1:
        seconds_text += f" [{spread[0]:.0f}-{spread[1]:.0f}]"
    steps, overhead = rung.median("steps"), rung.median("overhead_share")
    cpu = rung.median("cpu_seconds")
    verdict = rung.verdict
    if verdict == "close" and not narrow:
        verdict = "close (check with --recheck-close 3)"
    elif verdict.startswith("reached (") and narrow:
        verdict = "reached"
    return {"rung": rung.name, "steps": "-" if steps is None else f"{steps:.0f}",
            "seconds": seconds_text, "CPU s": "-" if cpu is None else f"{cpu:.0f}",
            "tokens/s": f"{rung.median('tokens_per_s'):,.0f}",
            "evals": "-" if overhead is None else f"{overhead:.0%}",
            "val": f"{rung.median('val_loss'):.3f}",
            "full val": f"{rung.median('full_val_loss'):.3f}",
            "vs previous": _ratio(rung.gain_over_previous),
            "vs prev": _ratio(rung.gain_over_previous),
            "vs base": _ratio(rung.gain_over_base), "verdict": verdict}


def print_changes(report: ladder.LadderReport, console: Console) -> None:
    """What each rung adds, and its size (or, where the narrow table has no room to say, why
    it was skipped)."""
    narrow = console.width < FULL_TABLE_WIDTH
    for rung in report.rungs:
        size = f" ({rung.parameters:,} parameters)" if rung.parameters else ""
        skipped = f"; skipped: {rung.skipped}" if rung.skipped and narrow else ""
        console.print(f"  {rung.name}: {rung.change}{size}{skipped}")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
