"""What a training run reports: a progress bar, metrics.jsonl and loss.png.

The trainer calls a `Reporter` (a rich progress bar for the CLI, silence for a library user) and
appends one JSON line per log step and per evaluation to metrics.jsonl; loss.png is drawn from
that file, so the picture of a resumed run shows the whole run. Both files go through
glassgpt.storage.files: a link planted under either name is never followed.
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from glassgpt.errors import CheckpointError
from glassgpt.storage.files import (
    append_text,
    entry_kind,
    open_regular_file,
    parse_json,
    write_bytes_atomic,
    write_text_atomic,
)
from glassgpt.storage.layout import METRICS_FILE, PLOT_FILE


class Reporter(Protocol):
    def start(self, total: int, done: int) -> None: ...

    def log(self, record: dict[str, Any]) -> None: ...

    def eval(self, record: dict[str, Any]) -> None: ...

    def stop(self) -> None: ...


class SilentReporter:
    def start(self, total: int, done: int) -> None: ...

    def log(self, record: dict[str, Any]) -> None: ...

    def eval(self, record: dict[str, Any]) -> None: ...

    def stop(self) -> None: ...


class RichReporter:
    """A rich progress bar (iteration, loss, lr, tokens/s) and one line per evaluation.

    When the reader of stdout goes away (`glassgpt train ... | head -1`), the bar falls silent
    and `stop` (the event given, kept as `stop_event`) is set: the trainer saves a checkpoint
    and returns, as after SIGTERM, instead of the process dying mid-run (rich's own answer to
    a closed pipe is to exit).
    """

    def __init__(self, stop: threading.Event | None = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self.stop_event = stop if stop is not None else threading.Event()
        self.output_closed = False
        reporter = self

        class _Console(Console):
            def on_broken_pipe(self) -> None:
                self.quiet = True
                reporter._output_closed()

        self.progress = Progress("[bold]train", BarColumn(), MofNCompleteColumn(),
                                 "{task.fields[stats]}", TimeRemainingColumn(), transient=False,
                                 console=_Console())
        self.task = None

    def _output_closed(self) -> None:
        silence_stdout()
        self.output_closed = True
        self.stop_event.set()

    def start(self, total: int, done: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=done, stats="")

    def log(self, record: dict[str, Any]) -> None:
        stats = (f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                 f"{record['tokens_per_s']:,.0f} tok/s")
        self.progress.update(self.task, completed=record["iter"], stats=stats)

    def eval(self, record: dict[str, Any]) -> None:
        self.progress.console.print(f"step {record['iter']}: train loss "
                                    f"{record['train_loss']:.4f}, val loss "
                                    f"{record['val_loss']:.4f}")

    def stop(self) -> None:
        self.progress.stop()


def silence_stdout() -> None:
    """After the reader of stdout left, point stdout at /dev/null, so that later writes (and
    the flush at exit) do not fail again (Python's own advice for a closed pipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


MAX_METRICS_BYTES = 2**30  # a million log lines; a bigger file is not the trainer's
MAX_LINE_BYTES = 4096  # a record is ~100 bytes
NUMBER_FIELDS = ("loss", "lr", "tokens_per_s", "train_loss", "val_loss")


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    """One JSON line more; a link planted as metrics.jsonl is refused, never followed."""
    append_text(run_dir / METRICS_FILE, json.dumps(record) + "\n", CheckpointError)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl that are whole and well-formed.

    A line cut short by a crash mid-append, or one a hand edited into nonsense (a string loss,
    a 100k-deep list), is skipped: the run goes on without it.
    """
    path = Path(run_dir) / METRICS_FILE
    if entry_kind(path) == "missing":
        return []
    fd = open_regular_file(path, CheckpointError)
    with os.fdopen(fd, "rb") as file:
        if os.fstat(fd).st_size > MAX_METRICS_BYTES:
            raise CheckpointError(f"{path} is larger than {MAX_METRICS_BYTES:,} bytes; move it "
                                  f"away to start a fresh log")
        records = [_record(line) for line in _bounded_lines(file)]
    return [record for record in records if record is not None]


def _bounded_lines(file: BinaryIO) -> Iterator[bytes]:
    """The lines of `file`, each read at most MAX_LINE_BYTES at a time; a longer one (no log
    line is) is skipped without ever being held whole."""
    while line := file.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES:
            yield line
            continue
        while line and not line.endswith(b"\n"):  # the rest of the overlong line
            line = file.readline(MAX_LINE_BYTES + 1)


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        record = parse_json(line.decode("utf-8"), METRICS_FILE, CheckpointError)
    except (CheckpointError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not _is_int(record.get("iter")) or record["iter"] < 0:
        return None
    numbers_ok = all(isinstance(record[k], int | float) and not isinstance(record[k], bool)
                     for k in NUMBER_FIELDS if k in record)
    return record if numbers_ok else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def truncate_metrics(run_dir: Path, iteration: int) -> None:
    """Drop lines logged after the checkpoint a run resumes from: they will be logged again."""
    kept = [r for r in read_metrics(run_dir) if r["iter"] <= iteration]
    try:
        write_text_atomic(run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))
    except OSError as error:
        raise CheckpointError(f"cannot rewrite {run_dir / METRICS_FILE} ({error})") from None


def best_evaluation(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluation with the lowest val loss after step 0 (whose weights a run keeps as its
    best), or None before there is one."""
    evals = [r for r in records if "val_loss" in r and r["iter"] > 0
             and isinstance(r["val_loss"], float | int)]
    return min(evals, key=lambda r: r["val_loss"], default=None)


def plot_losses(run_dir: Path) -> None:
    """loss.png: training loss per log line and train/val loss per evaluation."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state

    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot([r["iter"] for r in steps], [r["loss"] for r in steps], lw=0.8, alpha=0.6,
            label="train (batch)")
    for split in ("train", "val"):
        ax.plot([r["iter"] for r in evals], [r[f"{split}_loss"] for r in evals], marker="o",
                label=f"{split} (eval)")
    best = best_evaluation(records)
    if best is not None:  # the weights best.safetensors holds
        ax.plot([best["iter"]], [best["val_loss"]], marker="*", markersize=14, color="black",
                linestyle="none", label=f"best val {best['val_loss']:.4f} (iteration "
                                        f"{best['iter']})")
    ax.set(xlabel="iteration", ylabel="cross-entropy loss", title=run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    try:
        write_bytes_atomic(run_dir / PLOT_FILE, buffer.getvalue())
    except OSError as error:  # a full disk: one clear line, the last checkpoint is kept
        raise CheckpointError(f"cannot write {run_dir / PLOT_FILE} ({error}); the last "
                              f"checkpoint in {run_dir} is kept") from None
