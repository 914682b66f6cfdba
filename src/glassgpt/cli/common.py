"""Flags that several commands share, and how they turn into library calls."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from glassgpt import checkpoint as ckpt
from glassgpt import devices

DEFAULT_PROMPT = "\n"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each flag's default, except where there is none to show (None, off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def say(message: str) -> None:
    """A line for the user that is not the command's output (stderr, so pipes stay clean)."""
    print(message, file=sys.stderr, flush=True)


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=devices.parse_threads, default=devices.AUTO,
                        metavar="N|auto",
                        help="CPU threads: a count, or auto (default: time the first steps at "
                        "one thread and at all cores and keep the faster; OMP_NUM_THREADS, "
                        "when set, is kept)")


def add_checkpoint_flag(parser: argparse.ArgumentParser, what: str = "use") -> None:
    parser.add_argument("--checkpoint", choices=ckpt.CHECKPOINTS, default="best",
                        help=f"which weights of the run to {what}: the best evaluation's "
                        f"(default) or the last checkpoint's")


def probe_threads(setting: int | str, work: Callable[[], Any]) -> str:
    """--threads for a command without a loop of its own to time (a demo, one picture):
    `auto` times `work` at each candidate count and keeps the faster. Returns what was used."""
    tuner = devices.tuner_for(setting, torch.device("cpu"))
    if tuner is not None:
        steps = 1 + tuner.probe_steps * len(tuner.candidates)  # a warm-up, then each count
        for _ in tuner.tuned(work() for _ in range(steps)):
            pass
    return devices.cpu_threads()


def describe_threads(tuner: devices.ThreadTuner | None) -> str:
    """For a start line: the fixed count, or how auto will choose."""
    return tuner.describe() if tuner is not None else devices.cpu_threads()


def warn_about_bf16(dtype: str, device: torch.device) -> None:
    """One line when bfloat16 was asked for on a CPU that runs it slowly."""
    if dtype == "bfloat16":
        warning = devices.bf16_warning(device)
        if warning:
            say(f"warning: {warning}")
