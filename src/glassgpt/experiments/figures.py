"""Small helpers for the experiments' pictures: matplotlib without pyplot, written atomically.

Figures are built from `matplotlib.figure.Figure` directly, so no global pyplot state or GUI
backend is involved and experiments run the same in tests and on headless machines.
"""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.figure import Figure

from glassgpt.files import write_bytes_atomic

DPI = 100


def new_figure(width: float, height: float) -> Figure:
    """A blank figure of width x height inches with a tidy layout."""
    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def save_figure(fig: Figure, path: Path) -> Path:
    """Write `fig` as PNG to `path` atomically (never a half-written picture)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    write_bytes_atomic(path, buffer.getvalue())
    return path
