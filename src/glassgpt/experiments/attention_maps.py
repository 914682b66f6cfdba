"""Attention maps of a trained model for a prompt: every layer and head, with readable labels.

Every prompt token gets a row and a column of `CELL_INCHES`, enough for its label at `TICK_PT`:
the panels grow with the prompt instead of the labels shrinking. When the whole grid (one row per
layer, one column per head) would pass `PAGE_INCHES`, the maps are split into one picture per
layer (its heads wrapped into a grid), and when even one layer does not fit, one picture per
panel. Beyond `MAX_PANEL_INCHES` a panel stops growing and labels every 2nd, 3rd, ... token.
In a model with local layers (a sliding window), each panel's title says whether its layer is
local (and its window) or global, and a local layer's keys outside the window are hatched like
the future, as the page of `glassgpt view` draws them: hidden keys, never weights of 0.
Notation: L = layers, H = heads, T = prompt tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.errors import InputError
from glassgpt.figures import (
    MASKED_NOTE,
    SUPTITLE_PT,
    TICK_PT,
    grid_shape,
    label_axes,
    labelled_colorbar,
    new_figure,
    save_figure,
    show_attention,
    text_height,
    wrap_title,
)
from glassgpt.machine.devices import settle_threads
from glassgpt.model import GPT
from glassgpt.tokenizers import Tokenizer

CELL_INCHES = 0.14  # one token's row: an 8 pt label is 0.11 in tall
MIN_PANEL_INCHES = 2.4
MAX_PANEL_INCHES = 9.0  # 64 tokens (the cpu-small context) still get a label each
PAGE_INCHES = 18.0  # the most panels one picture holds, across and down
VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥"}


def token_labels(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """One printable axis label per token: whitespace made visible, long tokens shortened."""
    labels = []
    for token_id in ids:
        text = tokenizer.decode([token_id])
        text = "".join(VISIBLE.get(ch, ch) for ch in text)
        labels.append(text if len(text) <= 8 else text[:7] + "…")
    return labels


def prompt_attention(model: GPT, tokenizer: Tokenizer, prompt: str) -> tuple[Tensor, list[str]]:
    """The attention weights (L, H, T, T) of `model` on `prompt`, and one label per token."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise InputError("the prompt is empty: give at least one token of text")
    idx = torch.tensor([ids], dtype=torch.long, device=model.lm_head.weight.device)  # (1, T)
    maps = model.attention_maps(idx)  # L x (1, H, T, T)
    return torch.stack([m[0] for m in maps]).float().cpu(), token_labels(tokenizer, ids)


def select_panels(weights: Tensor, layer: int | None, head: int | None) -> list[tuple[int, int]]:
    """(layer, head) pairs to draw: all of them, or one layer / one head / one panel."""
    L, H = weights.shape[:2]
    if layer is not None and not 0 <= layer < L:
        raise InputError(f"layer {layer} does not exist: the model has layers 0..{L - 1}")
    if head is not None and not 0 <= head < H:
        raise InputError(f"head {head} does not exist: the model has heads 0..{H - 1}")
    layers = range(L) if layer is None else [layer]
    heads = range(H) if head is None else [head]
    return [(lay, h) for lay in layers for h in heads]


def panel_inches(T: int) -> float:
    """Side of one square panel for T tokens."""
    return min(MAX_PANEL_INCHES, max(MIN_PANEL_INCHES, T * CELL_INCHES))


def label_step(T: int) -> int:
    """Label every token, or every n-th one once the panel has stopped growing."""
    return max(1, math.ceil(T * CELL_INCHES / MAX_PANEL_INCHES))


@dataclass(frozen=True)
class Page:
    """The panels of one picture, drawn row by row in `n_cols` columns."""

    panels: list[tuple[int, int]]
    n_cols: int
    part: str = ""  # "layer 2" or "layer 2, head 1" when the maps are split over pictures

    @property
    def n_rows(self) -> int:
        return math.ceil(len(self.panels) / self.n_cols)

    def path(self, path: Path) -> Path:
        """Where this page goes: `path`, or with "_layer2" / "_layer2_head1" added to its stem."""
        suffix = ("_" + self.part.replace(", ", "_").replace(" ", "")) if self.part else ""
        return path.with_name(f"{path.stem}{suffix}{path.suffix}")


def plan_pages(panels: list[tuple[int, int]], T: int) -> list[Page]:
    """Lay (layer, head) panels out on as few pictures as keep every label at full size.

    One picture with a row per layer if it fits `PAGE_INCHES` both ways; else a picture per
    layer with its heads in a grid as even as possible; else a picture per panel. A page's
    `part` names it only when there are several.
    """
    side = panel_inches(T)
    fits = max(1, int(PAGE_INCHES // side))  # panels per row (and per column) of one picture
    layers = sorted({lay for lay, _ in panels})
    heads = sorted({h for _, h in panels})
    rows, cols = grid_shape(len(heads), fits)
    if len(layers) <= fits and len(heads) <= fits:
        pages = [Page(panels, len(heads))]
    elif rows <= fits:
        pages = [Page([p for p in panels if p[0] == lay], cols, f"layer {lay}") for lay in layers]
    else:
        pages = [Page([(lay, h)], 1, f"layer {lay}, head {h}") for lay, h in panels]
    return pages if len(pages) > 1 else [Page(pages[0].panels, pages[0].n_cols)]


def layer_title(layer: int, head: int, windows: list[int | None]) -> str:
    """A panel's title: "layer 0, head 1", and when any layer is local a second line saying
    which this one is ("local (window 4)" or "global"), as the page names layers."""
    title = f"layer {layer}, head {head}"
    if all(window is None for window in windows):
        return title
    window = windows[layer]
    return f"{title}\n" + ("global" if window is None else f"local (window {window})")


def page_figure(weights: Tensor, labels: list[str], page: Page, title: str = "",
                windows: list[int | None] | None = None) -> Figure:
    """Draw the panels of `page` from weights (L, H, T, T), with one colour bar.

    Queries run down each panel and keys across, so row t shows where token t looked; the
    upper triangle is hatched (masked: the model is causal), never coloured as a weight of 0,
    and so are a local layer's keys outside its window (`windows`: each layer's sliding window,
    None for a global layer; default: every layer global).
    Token labels and the axis titles sit on the outer edges: queries on the left column, keys
    under the lowest panel of each column.
    """
    T, side = len(labels), panel_inches(len(labels))
    windows = windows if windows is not None else [None] * weights.shape[0]
    step = label_step(T)
    ticks, shown = list(range(0, T, step)), labels[::step]
    rotation = 0 if all(len(label) == 1 for label in shown) else 90  # characters stand upright
    longest = max(len(label) for label in shown) if rotation else 1
    margin = 0.5 + 0.08 * longest  # room for the labels, rotated or not
    width = page.n_cols * side + margin + 1.2  # + the colour bar
    title = wrap_title(title, width) if title else ""
    fig = new_figure(width, page.n_rows * (side + 0.3) + margin + 0.4 + text_height(title))
    axes = fig.subplots(page.n_rows, page.n_cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(page.panels):
            ax.axis("off")
            continue
        lay, h = page.panels[i]
        image = show_attention(ax, weights[lay, h], window=windows[lay])
        left, lowest = i % page.n_cols == 0, i + page.n_cols >= len(page.panels)
        # Inner panels carry no ticks at all: fewer artists, a much faster drawing.
        ax.set_xticks(ticks if lowest else [], shown if lowest else [], rotation=rotation)
        ax.set_yticks(ticks if left else [], shown if left else [])
        label_axes(ax, xlabel="key (attended to)" if lowest else "",
                   ylabel="query (looking)" if left else "", title=layer_title(lay, h, windows))
        ax.tick_params(length=0, labelsize=TICK_PT)
    # A colour bar about 4 inches tall, however many panels it stands beside.
    local = any(window is not None for window in windows)
    masked = f"{MASKED_NOTE}:\nthe future or outside the window" if local else MASKED_NOTE
    labelled_colorbar(fig, image, axes, f"attention weight\n({masked})",
                      shrink=min(0.9, 4.0 / (page.n_rows * side)))
    if title:
        fig.suptitle(title, fontsize=SUPTITLE_PT)
    return fig


def draw_attention_maps(weights: Tensor, labels: list[str], path: Path, layer: int | None = None,
                        head: int | None = None, title: str = "",
                        windows: list[int | None] | None = None) -> list[Path]:
    """Draw weights (L, H, T, T), all panels or the ones `layer`/`head` select (`windows`:
    each layer's sliding window, None for a global layer).

    Writes `path` when everything fits one readable picture, else `path` with `_layerN` (or
    `_layerN_headM`) added to its stem, one picture each. Returns the paths written, in order.
    """
    written = []
    for page in plan_pages(select_panels(weights, layer, head), len(labels)):
        page_title = f"{title} ({page.part})" if title and page.part else title
        figure = page_figure(weights, labels, page, page_title, windows)
        written.append(save_figure(figure, page.path(path)))
    return written


@dataclass
class AttentionDrawing:
    """What `draw_prompt_attention` drew."""

    paths: list[Path]  # the pictures written, in order
    shape: tuple[int, int, int]  # (L, H, T) of the maps
    threads: int  # the CPU threads the maps were computed with


def draw_prompt_attention(model: GPT, tokenizer: Tokenizer, prompt: str, path: Path,
                          layer: int | None = None, head: int | None = None, title: str = "",
                          threads: int | str | None = None) -> AttentionDrawing:
    """`glassgpt attention` as one call: the maps of `prompt`, drawn as `draw_attention_maps`
    does. `threads` (a count, "auto" or None: glassgpt.machine.threadsetting) is the CPU's thread
    count; "auto" times the forward that computes the maps and keeps the faster count."""
    chosen = settle_threads(threads, model.lm_head.weight.device,
                            lambda: prompt_attention(model, tokenizer, prompt))
    weights, labels = prompt_attention(model, tokenizer, prompt)  # (L, H, T, T)
    windows = [model.config.attention_kind(lay).window for lay in range(weights.shape[0])]
    paths = draw_attention_maps(weights, labels, path, layer=layer, head=head, title=title,
                                windows=windows)
    L, H, T = weights.shape[:3]
    return AttentionDrawing(paths, (L, H, T), chosen)
