"""The pictures' helpers: matplotlib without pyplot, written atomically.

One layer down from everything that draws (the experiments, the speedrun ladder of
`glassgpt.bench.ladder`): it imports only `storage/`, so a benchmark does not sit on the
experiments to borrow a type size.

Figures are built from `matplotlib.figure.Figure` directly, so no global pyplot state or GUI
backend is involved and experiments run the same in tests and on headless machines.

Every picture uses the same type sizes, so a student reads them all at the same size: nothing is
smaller than `TICK_PT`. A figure that has more to show grows (or is split) instead of shrinking
its text; `tests/test_figures.py` renders every picture and checks both.
"""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colorbar import Colorbar
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle
from torch import Tensor

from glassgpt.storage.files import write_bytes_atomic

DPI = 100
TICK_PT = 8.0  # tick labels and notes written on a plot: the smallest text of any picture
LABEL_PT = 9.0  # axis titles, legends, colour-bar labels
TITLE_PT = 10.0  # the title of one panel
SUPTITLE_PT = 11.0  # the title of a whole figure
# Average width of a DejaVu Sans character as a fraction of its size; a little generous, so a
# title wrapped to this estimate always fits.
CHAR_WIDTH_EM = 0.62
# Masked attention cells (the future a causal model cannot see) are hatched grey, never a colour
# of the map's scale: a weight of 0 and a cell the mask removed must not look alike.
MASKED_FACE = "#e4e7ec"
MASKED_HATCH = "#8a93a0"
MASKED_NOTE = "hatched: masked"


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


def label_axes(ax: Axes, xlabel: str = "", ylabel: str = "", title: str = "") -> None:
    """Axis titles, panel title and tick labels at the shared type sizes."""
    if xlabel:
        ax.set_xlabel(xlabel, fontsize=LABEL_PT)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=LABEL_PT)
    if title:
        ax.set_title(title, fontsize=TITLE_PT)
    ax.tick_params(labelsize=TICK_PT)


def labelled_colorbar(fig: Figure, mappable, axes, label: str, shrink: float = 0.8) -> Colorbar:
    """A colour bar beside `axes` that says what its colours measure."""
    colorbar = fig.colorbar(mappable, ax=axes, shrink=shrink)
    colorbar.set_label(label, fontsize=LABEL_PT)
    colorbar.ax.tick_params(labelsize=TICK_PT)
    return colorbar


def show_attention(ax: Axes, weights: Tensor, cmap: str = "viridis", vmin: float = 0.0,
                   vmax: float = 1.0, causal: bool = True, window: int | None = None
                   ) -> AxesImage:
    """Attention weights (T, S), queries down, as an image. With `causal`, the keys after each
    query (masked) are left out of the image and show a hatched grey patch beneath it; with a
    sliding `window` (a local layer), so are the keys `window` or more positions back: hidden
    from the query, not a weight of 0."""
    values = weights.detach().float().cpu().numpy()
    if causal:
        T, S = values.shape
        query = np.arange(T)[:, None] + (S - T)  # (T, 1): each query's position among the keys
        key = np.arange(S)[None, :]  # (1, S)
        hidden = key > query  # (T, S): the future
        if window is not None:
            hidden |= query - key >= window  # outside the window
        values = np.ma.masked_array(values, mask=hidden)
        ax.add_patch(Rectangle((-0.5, -0.5), S, T, facecolor=MASKED_FACE,
                               edgecolor=MASKED_HATCH, hatch="///", linewidth=0, zorder=0))
    colours = matplotlib.colormaps[cmap].with_extremes(bad=(0.0, 0.0, 0.0, 0.0))
    return ax.imshow(values, cmap=colours, vmin=vmin, vmax=vmax, zorder=1)


def wrap_title(text: str, width_inches: float, points: float = SUPTITLE_PT) -> str:
    """`text` broken into lines that fit `width_inches` at `points` (long words broken too)."""
    chars_per_line = max(12, int(width_inches * 72 / (points * CHAR_WIDTH_EM)))
    return textwrap.fill(text, width=chars_per_line)


def text_height(text: str, points: float = SUPTITLE_PT) -> float:
    """Inches that `text` takes up and down, one line per line of text (with line spacing)."""
    return (text.count("\n") + 1) * points * 1.4 / 72


def grid_shape(n_panels: int, max_cols: int) -> tuple[int, int]:
    """(rows, cols) for `n_panels` with at most `max_cols` columns, rows as even as possible.

    Four panels with room for three columns become 2 x 2, not 3 + 1.
    """
    max_cols = max(1, min(max_cols, n_panels))
    rows = math.ceil(n_panels / max_cols)
    return rows, math.ceil(n_panels / rows)
