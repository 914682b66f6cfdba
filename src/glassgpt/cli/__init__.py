"""The `glassgpt` command line: a thin layer over the library.

Each command group lives in its own module with a `register(subparsers)` function that adds its
subcommands and sets `handler` on them. `main` turns every `GlassGPTError` (a user mistake) into
one line on stderr and exit code 2; `--debug`, anywhere on the line, shows the traceback
instead. A reader that closes the pipe (`glassgpt sample RUN | head`) ends the command quietly.

Ctrl-C: the command does what it must (training saves a checkpoint), one line says so, and then
the process exits with 130, quietly. Called in-process with a list of arguments (a test, a
notebook), `main` raises KeyboardInterrupt after that line instead, so that the interrupt
reaches the caller: pytest stops rather than counting one failed test and running on.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence

from glassgpt import __version__
from glassgpt.cli import (
    benchmark,
    convert,
    demos,
    finetune,
    graph,
    prepare,
    sae,
    sample,
    timeline,
    train,
    view,
)
from glassgpt.errors import CommandLineError, GlassGPTError

# The modules that each add a group of subcommands, in the order `--help` lists them.
COMMAND_MODULES = (prepare, train, finetune, sample, demos, benchmark, convert, view, sae, graph,
                   timeline)
BROKEN_PIPE_EXIT_CODE = 141  # 128 + SIGPIPE, what a Unix tool killed by a closed pipe returns
INTERRUPTED_EXIT_CODE = train.INTERRUPTED_EXIT_CODE  # 128 + SIGINT


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake raises instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.endswith("expected one argument"):  # argparse read `--lr -1e-3` as two flags
            message += " (write a value that starts with '-' as --flag=VALUE, e.g. --lr=-1e-3)"
        raise CommandLineError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="glassgpt", description="A GPT you can see through.")
    parser.add_argument("--version", action="version", version=f"glassgpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: this process's own, `sys.argv[1:]`); returns the
    exit code. With `argv` given, a Ctrl-C is raised again as KeyboardInterrupt once handled."""
    in_process = argv is not None  # the console script and `python -m glassgpt` pass none
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]  # a global flag, wherever it is given
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "handler", None) is None:
            raise CommandLineError("no command given; run `glassgpt --help` to see them")
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # a full disk under `> out.txt` fails here, not silently at exit
    except GlassGPTError as error:
        if debug:
            raise
        print(f"error: {one_line(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        if in_process:
            raise
        return INTERRUPTED_EXIT_CODE
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_EXIT_CODE
    except OSError as error:
        if debug or not _is_output_failure(error):
            raise
        _silence_stdout()
        print(f"error: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return 1
    if code == INTERRUPTED_EXIT_CODE and in_process:  # a stop signal, saved and said (train)
        raise KeyboardInterrupt
    return code


# Errors of a write to stdout (`glassgpt sample RUN > /dev/full`): every file glassgpt itself
# writes goes through glassgpt.storage.files, which turns such errors into a GlassGPTError
# naming the file, so an OSError without a file name that reaches main is the output's.
OUTPUT_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT)


def _is_output_failure(error: OSError) -> bool:
    return error.errno in OUTPUT_ERRNOS and error.filename is None


def one_line(message: str) -> str:
    """The message with every character that is not printable (a newline or a terminal escape
    in a file name, say) written as Python writes it in a string (\\n, \\x1b): an error stays
    one line, and a name cannot paint the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def _silence_stdout() -> None:
    """After the reader left, point stdout at /dev/null, so that flushing it at exit does not
    raise a second BrokenPipeError (Python's own advice for this case)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
