"""Flags that several commands share, and how they turn into library calls.

Light on imports (no torch, no model): a command's parser is built from these before anything
heavy loads, so `--help` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glassgpt.machine.threadsetting import AUTO, parse_threads
from glassgpt.storage.layout import CHECKPOINTS

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


def say(message: str) -> None:
    """A line for the user that is not the command's output (stderr, so pipes stay clean)."""
    print(message, file=sys.stderr, flush=True)


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=parse_threads, default=AUTO,
                        metavar="N|auto",
                        help="CPU threads: a count, or auto (default: time the first steps at "
                        "one thread and at all cores and keep the faster; OMP_NUM_THREADS, "
                        "when set, is kept)")


def add_checkpoint_flag(parser: argparse.ArgumentParser, what: str = "use") -> None:
    parser.add_argument("--checkpoint", choices=CHECKPOINTS, default="best",
                        help=f"which weights of the run to {what}: the best evaluation's "
                        f"(default) or the last checkpoint's")


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
