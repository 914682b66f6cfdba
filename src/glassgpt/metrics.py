"""What a training run reports: a progress bar, metrics.jsonl and loss.png.

The trainer calls a `Reporter` (a rich progress bar for the CLI, silence for a library user) and
appends one JSON line per log step and per evaluation to metrics.jsonl; loss.png is drawn from
that file, so the picture of a resumed run shows the whole run.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Protocol

from glassgpt.files import write_bytes_atomic, write_text_atomic

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


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
    """A rich progress bar (iteration, loss, lr, tokens/s) and one line per evaluation."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self.progress = Progress("[bold]train", BarColumn(), MofNCompleteColumn(),
                                 "{task.fields[stats]}", TimeRemainingColumn(), transient=False)
        self.task = None

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


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    with open(run_dir / METRICS_FILE, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash mid-append: the run goes on without it
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("iter"), int)]


def truncate_metrics(run_dir: Path, iteration: int) -> None:
    """Drop lines logged after the checkpoint a run resumes from: they will be logged again."""
    kept = [r for r in read_metrics(run_dir) if r["iter"] <= iteration]
    write_text_atomic(run_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))


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
    ax.set(xlabel="iteration", ylabel="cross-entropy loss", title=run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    write_bytes_atomic(run_dir / PLOT_FILE, buffer.getvalue())
