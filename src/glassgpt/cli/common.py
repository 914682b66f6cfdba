"""Flags that several commands share, and how they turn into library calls.

Light on imports (no torch, no model): a command's parser is built from these before anything
heavy loads, so `--help` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
