"""The `glassgpt` command line: a thin layer over the library.

Each command group lives in its own module with a `register(subparsers)` function that adds its
subcommands and sets `handler` on them. `main` turns every `GlassGPTError` (a user mistake) into
one line on stderr and exit code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from glassgpt import __version__
from glassgpt.errors import CommandLineError, GlassGPTError

# Modules under glassgpt.cli that each add a group of subcommands.
COMMAND_MODULES: list[str] = ["runs", "demos", "benchmark", "convert", "view"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake raises instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CommandLineError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="glassgpt", description="A GPT you can see through.")
    parser.add_argument("--version", action="version", version=f"glassgpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"glassgpt.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "handler", None) is None:
            raise CommandLineError("no command given; run `glassgpt --help` to see them")
        return int(args.handler(args) or 0)
    except GlassGPTError as error:
        if debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
