"""What an experiment hands back: tables of numbers, the claims it checked, the pictures it drew.

Experiments never print; the CLI renders these objects (rich tables, JSON), and may listen to
their training steps to show progress (`listening_to_steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Who hears of each training step an experiment takes (the CLI's progress bar), so that a demo
# that trains for a minute shows it is moving. A context variable rather than an argument
# threaded through every experiment: it changes no result, only what a watcher sees.
_step_listener: ContextVar[Callable[[], None] | None] = ContextVar("step_listener",
                                                                   default=None)


@contextmanager
def listening_to_steps(listener: Callable[[], None]) -> Iterator[None]:
    """Call `listener()` after every training step the experiments take inside the block."""
    token = _step_listener.set(listener)
    try:
        yield
    finally:
        _step_listener.reset(token)


def step_taken() -> None:
    """A training loop of an experiment took one step (tells the listener, if any)."""
    listener = _step_listener.get()
    if listener is not None:
        listener()


@dataclass
class Table:
    """One table of results: a title, column names and rows of plain values.

    `formats` maps a column to a format spec for display (e.g. ".1%" for an accuracy); columns
    without one are shown with a default for their type.
    """

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)

    def add_row(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"row has {len(values)} values, table has {len(self.columns)} columns")
        self.rows.append(list(values))

    def records(self) -> list[dict[str, Any]]:
        """The rows as dicts keyed by column name (what `--json` writes)."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


@dataclass
class Check:
    """An expected outcome of the experiment and whether this run showed it."""

    claim: str
    holds: bool


@dataclass
class ExperimentResult:
    """Everything one experiment produced. `numbers` holds the key figures in a fixed layout."""

    name: str
    summary: str
    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    pictures: list[Path] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None  # the CPU threads it ran with (what run_experiment chose)

    @property
    def all_checks_hold(self) -> bool:
        return all(check.holds for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of everything except the pictures themselves (their paths only)."""
        return {
            "name": self.name,
            "summary": self.summary,
            "tables": [{"title": t.title, "rows": t.records()} for t in self.tables],
            "checks": [{"claim": c.claim, "holds": c.holds} for c in self.checks],
            "pictures": [str(p) for p in self.pictures],
            "numbers": self.numbers,
            "threads": self.threads,
        }
