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

from glassgpt.choices import NOISE, QUICK_TARGET, TARGET_LOSS
from glassgpt.errors import ConfigError
from glassgpt.storage.files import check_can_write_file, write_text_atomic

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
    group.add_argument("--plot", type=Path, default=DEFAULT_PLOT,
                       help=f"picture of val loss against wall time (default {DEFAULT_PLOT})")
    group.add_argument("--data", type=Path,
                       help="prepared data directory (default: Tiny Shakespeare, character "
                       "level, prepared into the cache)")


def run_ladder_command(args: argparse.Namespace) -> int:
    from glassgpt.bench import ladder
    from glassgpt.machine import distributed as ddp
    from glassgpt.training.runs import training_data

    if args.seeds < 1 or args.recheck_close < 0:
        raise ConfigError(f"--seeds must be >= 1 and --recheck-close >= 0, got {args.seeds} "
                          f"and {args.recheck_close}")
    for path in (args.json, args.plot):
        if path is not None:
            check_can_write_file(path, ConfigError)  # before the minutes of training
    target = args.target_loss if args.target_loss is not None else \
        (QUICK_TARGET if args.quick else TARGET_LOSS)
    data = training_data(args.data, ddp.DistContext())
    with Console(stderr=True).status("climbing the ladder") as status:
        report = ladder.run_ladder(data, target, quick=args.quick, seeds=args.seeds,
                                   recheck_close=args.recheck_close, only=args.rungs,
                                   progress=status.update)
    console = Console()
    m = report.machine
    console.print(f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average "
                  f"{m['load_before']:.2f} before, {m['load_after']:.2f} after; the ladder took "
                  f"{report.seconds:.0f} s" if m.get("load_before") is not None else m["cpu"])
    console.print(ladder_table(report))
    print_changes(report, console)
    ladder.plot_ladder(report, args.plot)
    console.print(f"picture: {args.plot}")
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return 0


def ladder_table(report: ladder.LadderReport) -> Table:
    table = Table(title=f"Time to val loss {report.target_loss:g}, one change at a time "
                  f"(Tiny Shakespeare, char" + (", --quick" if report.quick else "") + ")",
                  caption="seconds: the trainer's wall time to the first evaluation at or "
                  "below the target (median over seeds, \\[range]); evals: the share of it "
                  "spent outside training steps (evaluations, checkpoints, compiling); CPU s: "
                  "this process's CPU seconds for the whole run, all threads; full val: the "
                  "stopped weights on the whole val split")
    for column in ("rung", "steps", "seconds", "CPU s", "tokens/s", "evals", "val",
                   "full val", "vs previous", "vs base", "verdict"):
        table.add_column(column, justify="left" if column in ("rung", "verdict") else "right",
                         overflow="fold")
    for rung in report.rungs:
        if rung.skipped:
            table.add_row(rung.name, *[""] * 9, f"skipped: {rung.skipped}")
            continue
        seconds, spread = rung.seconds(), rung.seconds_range()
        seconds_text = "-" if seconds is None else f"{seconds:.1f}"
        if spread and len(rung.runs) > 1:
            seconds_text += f" [{spread[0]:.0f}-{spread[1]:.0f}]"
        steps, overhead = rung.median("steps"), rung.median("overhead_share")
        cpu = rung.median("cpu_seconds")
        table.add_row(rung.name, "-" if steps is None else f"{steps:.0f}", seconds_text,
                      "-" if cpu is None else f"{cpu:.0f}",
                      f"{rung.median('tokens_per_s'):,.0f}",
                      "-" if overhead is None else f"{overhead:.0%}",
                      f"{rung.median('val_loss'):.3f}", f"{rung.median('full_val_loss'):.3f}",
                      _ratio(rung.gain_over_previous), _ratio(rung.gain_over_base),
                      "close (check with --recheck-close 3)" if rung.verdict == "close"
                      else rung.verdict)
    return table


def print_changes(report: ladder.LadderReport, console: Console) -> None:
    """What each rung adds, and its size."""
    for rung in report.rungs:
        size = f" ({rung.parameters:,} parameters)" if rung.parameters else ""
        console.print(f"  {rung.name}: {rung.change}{size}")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
