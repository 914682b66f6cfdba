"""Every picture the experiments and `glassgpt attention` draw, rendered from small synthetic
inputs (no training): all text inside the canvas, nothing under 8 pt, tick labels of one axis
never on top of each other, every colour bar and every heatmap's axes labelled.

The checks look at what matplotlib really draws: `Text.draw` is wrapped while the figure is
saved, and each drawn text's window extent is compared with the canvas.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from glassgpt.experiments import (
    EXPERIMENTS,
    attention_maps,
    dropout,
    features,
    induction,
    kvheads,
    layernorm,
    mlps,
    multihead,
    norms,
    params,
    parity,
    positions,
    qknorm,
    residual,
    shapes,
    sharing,
    windows,
)
from glassgpt.experiments.attention_maps import Page, page_figure, plan_pages, select_panels
from glassgpt.figures import DPI

MIN_POINTS = 8.0  # the floor for every text, tick labels included
SLACK_PIXELS = 0.5  # anti-aliasing: a box may touch the edge


def drawn_texts(fig: Figure) -> dict[Text, Bbox]:
    """Save `fig` as the experiments do and return every text drawn with its pixel extent."""
    drawn: dict[Text, Bbox] = {}
    original = Text.draw

    def recording_draw(self: Text, renderer) -> None:
        original(self, renderer)
        if self.get_visible() and self.get_text().strip():
            drawn[self] = self.get_window_extent(renderer)

    with mock.patch.object(Text, "draw", recording_draw):
        fig.savefig(io.BytesIO(), format="rgba", dpi=DPI)  # what PNG draws, less the encoding
    return drawn


def problems(fig: Figure) -> list[str]:
    """Everything unreadable about `fig`, in words; empty when it reads well."""
    drawn = drawn_texts(fig)
    assert drawn, "nothing was drawn"
    canvas = fig.bbox
    found = []
    for text, box in drawn.items():
        if (box.x0 < canvas.x0 - SLACK_PIXELS or box.y0 < canvas.y0 - SLACK_PIXELS
                or box.x1 > canvas.x1 + SLACK_PIXELS or box.y1 > canvas.y1 + SLACK_PIXELS):
            found.append(f"{text.get_text()!r} at {box.bounds} leaves the canvas "
                         f"{canvas.bounds}")
        if text.get_fontsize() < MIN_POINTS:
            found.append(f"{text.get_text()!r} is {text.get_fontsize()} pt")
    found += overlapping(drawn)
    for ax in fig.axes:
        found += unlabelled_images(ax, labels_drawn=set(drawn))
    return found


def overlapping(drawn: dict[Text, Bbox]) -> list[str]:
    """Pairs of texts drawn on top of each other (more than touching)."""
    texts = list(drawn)
    boxes = [drawn[t].padded(-SLACK_PIXELS) for t in texts]
    return [f"{texts[i].get_text()!r} and {texts[j].get_text()!r} overlap"
            for i in range(len(texts)) for j in range(i + 1, len(texts))
            if boxes[i].overlaps(boxes[j])]


def unlabelled_images(ax, labels_drawn: set[Text]) -> list[str]:
    """A heatmap's colour bar must say what it measures, and tick labels need an axis title."""
    found = []
    for image in ax.images:
        bar = image.colorbar
        if bar is not None and not (bar.ax.get_ylabel() or bar.ax.get_xlabel()):
            found.append(f"the colour bar of {ax.get_title()!r} has no label")
    if ax.images:
        if any(t in labels_drawn for t in ax.xaxis.get_ticklabels()) and not ax.get_xlabel():
            found.append(f"{ax.get_title()!r} labels its x ticks without an axis title")
        if any(t in labels_drawn for t in ax.yaxis.get_ticklabels()) and not ax.get_ylabel():
            found.append(f"{ax.get_title()!r} labels its y ticks without an axis title")
    return found


# --- small synthetic inputs --------------------------------------------------------------------

def causal_weights(*leading: int, T: int, seed: int = 0) -> torch.Tensor:
    """Random causal attention weights (*leading, T, T): rows sum to 1, zero above the diagonal."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(*leading, T, T, generator=generator)
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1)


PARITY_NUMBERS = {mask: {"per-head loop (ModuleList + cat)": [4.4e-16, 1.1e-16],
                         "fused path (scaled_dot_product_attention)": [0.0, None],
                         "nn.MultiheadAttention": [2.5e-16, 2.2e-16]}
                  for mask in ("causal", "bidirectional")}
GPT2_PARTS = {"token embedding (V x C, shared with the LM head)": 38_597_376,
              "position embedding (block_size x C)": 786_432, "12 blocks": 85_054_464,
              "final LayerNorm": 1_536, "total (tied weights counted once)": 124_439_808}
SHARING_NUMBERS = {"[block] * L (shared)": {"parameters": 12_704,
                                            "layers_changed": [True] * 4},
                   "L independent blocks": {"parameters": 50_816,
                                            "layers_changed": [True, False, False, False]}}


def residual_outcomes() -> dict[str, residual.VariantOutcome]:
    steps = torch.arange(300, dtype=torch.float32)
    learning = (2.3 * torch.exp(-steps / 20)).tolist()
    return {"Pre-LN + residual": residual.VariantOutcome(0.11, learning, 1.0),
            "Post-LN + residual": residual.VariantOutcome(0.22, learning, 1.0),
            "Pre-LN, no residual": residual.VariantOutcome(1.0, [2.31] * 300, 0.095)}


def char_labels(T: int) -> list[str]:
    text = "ROMEO: But soft, what light through yonder window breaks? It is the east, and "
    return [{" ": "␣"}.get(ch, ch) for ch in (text * 4)[:T]]


BPE_LABELS = ["ROM", "EO", ":", "␣But", "␣soft", ",", "␣what", "␣light", "␣through", "␣yonder",
              "␣window", "␣breaks", "?", "␣It", "␣is", "␣the", "␣east", ",", "␣and", "␣Jul…"]
TITLE = "cpu-small: attention for 'ROMEO: But soft, what light through yonder window breaks?'"


def attention_pages(L: int, H: int, labels: list[str], layer: int | None = None,
                    head: int | None = None, title: str = TITLE) -> list[Figure]:
    """Every page `glassgpt attention` would write for this model shape, prompt and selection."""
    weights = causal_weights(L, H, T=len(labels))
    pages = plan_pages(select_panels(weights, layer, head), len(labels))
    return [page_figure(weights, labels, page, title) for page in pages]


def curve(start: float, end: float, points: int = 11) -> list[float]:
    return [end + (start - end) * 0.6 ** i for i in range(points)]


STEPS = list(range(0, 1001, 100))
POSITION_NUMBERS = {"block_size": 64, "long_length": 128, **{
    p: {"val_steps": STEPS, "val_curve": curve(4.2, 2.0 + 0.05 * i),
        "long_loss_per_position": None if p == "learned" else curve(2.6, 2.0, 128)}
    for i, p in enumerate(positions.VARIANTS)}}
NORM_NUMBERS = {"seeds": [0, 1, 2], "counts": {
    "layernorm": norms.count_operations(norms.ManualLayerNorm(8), 8),
    "rmsnorm": norms.count_operations(norms.RMSNorm(8), 8)}, **{
    n: {"val_steps": STEPS, "val_curves": [curve(4.2, 2.03 + 0.01 * s) for s in range(3)]}
    for n in norms.VARIANTS}}
MLP_NUMBERS = {a: {"val_steps": STEPS, "val_curves": [curve(4.2, 2.1), curve(4.1, 2.2)],
                   "mlp_parameters": 18_432, "mlp_hidden": h}
               for a, h in zip(mlps.VARIANTS, (192, 128, 192), strict=True)}
KV_NUMBERS = {"kv_head_counts": [4, 2, 1], **{
    str(kv): {"cache_bytes_per_token": 512 * kv, "tokens_per_second": 900.0 + kv,
              "val_loss": 2.03 + 0.01 / kv} for kv in (4, 2, 1)}}
QK_NUMBERS = {"lr": 0.03, **{
    name: {"logit_steps": list(range(0, 1001, 25)),
           "largest_logits": [0.1 + (561.0 if i == 0 else 13.0) * min(1.0, s / 300)
                              for s in range(0, 1001, 25)],
           "val_steps": STEPS, "val_curve": curve(4.2, 1.9 + 0.3 * (1 - i))}
    for i, name in enumerate(qknorm.VARIANTS.values())}}
IND_STEPS = list(range(0, 1001, 25))
IND_NUMBERS = {"chance_loss": 4.16, "tolerance": 50, **{
    name: {"steps": IND_STEPS, "repeated_loss": [4.2 - 3.5 * (s > 300) for s in IND_STEPS],
           "scores": [[[0.02 + 0.8 * (s > 300 and layer == 1 == head) for head in range(4)]
                       for layer in range(n_layer)] for s in IND_STEPS]}
    for n_layer, name in induction.LAYERS.items()},
    "shakespeare": {"n_layer": 4, "steps": list(range(250, 2001, 250)),
                    "scores": [[[0.02, 0.3, 0.1, 0.05]] * 4 for _ in range(8)]}}
SNAP_STEPS = [0, 1, 2, 3, 5, 8, 12, 19, 29, 44, 67, 100, 151, 228, 343, 517, 778, 1000]


def ind_timeline(n_layer: int, llc: bool) -> dict:
    """A timeline summary as `induction.snapshot_timeline` returns it (a phase change at 228
    for 2 layers, none for 1)."""
    rises = n_layer == 2
    return {"steps": SNAP_STEPS, "loss": [4.2 - 1.5 * (rises and s >= 228) for s in SNAP_STEPS],
            "best_induction": [0.05 + 0.8 * (rises and s >= 228) for s in SNAP_STEPS],
            "icl_score": [-2.0 * (rises and s >= 228) for s in SNAP_STEPS],
            "phase_change": 228 if rises else None, "loss_drop": [151, 343] if rises else None,
            "llc_mean": [10.0 + 20 * (s >= 228) for s in SNAP_STEPS] if llc else [],
            "llc_std": [1.0] * len(SNAP_STEPS) if llc else []}


def ind_timeline_numbers(llc: bool) -> dict:
    return {name: {"timeline": ind_timeline(n_layer, llc)}
            for n_layer, name in induction.LAYERS.items()}

WIN_NUMBERS = {"window": 3, "local_reach": 4, "chance": 0.125, "steps": 400,
               "receptive_field": {name: {"gradient": [max(0.0, 1 - d / reach) for d in range(16)]}
                                   for name, reach in (("all local", 5), ("last layer global", 16),
                                                       ("all global", 16))},
               "accuracy": {"all local": [1.0] * 3 + [0.125] * 13, "last layer global": [1.0] * 16},
               "cache": {"contexts": [16, 1024, 8192, 32768],
                         "all_global": [4096, 262144, 2097152, 8388608],
                         "windowed": [2432, 131456, 1048960, 4194688],
                         "glassgpt_allocates": 4096, "glassgpt_context": 16}}

FEATURE_NUMBERS = {"toy": {"matched": torch.eye(64).clamp(min=0.2).tolist(),
                           "max_cosine": [0.99] * 60 + [0.7] * 4,
                           "random_max_cosine": [0.6] * 64},
                   "char": {"share": [1.0] * 30 + [0.5] * 26,
                            "coordinate_share": [0.4] * 126 + [0.9] * 2}}

# Every figure-drawing function, keyed by the experiment (or command) it belongs to.
FIGURES: dict[str, dict[str, Callable[[], list[Figure]]]] = {
    "shapes": {
        "default B=2 T=5 H=4": lambda: [shapes.head_weights_figure(causal_weights(4, T=5))],
        "T=30 H=6": lambda: [shapes.head_weights_figure(causal_weights(6, T=30))],
        "T=1 H=1": lambda: [shapes.head_weights_figure(causal_weights(1, T=1))],
    },
    "parity": {"numbers": lambda: [parity.differences_figure(PARITY_NUMBERS)]},
    "multihead": {"heads 1, 2, 3, 6": lambda: [multihead.head_maps_figure(
        {h: causal_weights(8, h, T=12, seed=h) for h in (1, 2, 3, 6)})]},
    "layernorm": {"leak": lambda: [layernorm.leak_figure([0.0] * 5,
                                                         [0.88, 0.56, 0.72, 0.48, 0.33])]},
    "params": {"gpt2 small": lambda: [params.shares_figure(GPT2_PARTS)]},
    "residual": {"three stacks": lambda: [residual.loss_curves_figure(residual_outcomes(),
                                                                        2.302)]},
    "dropout": {"eval and train": lambda: [dropout.weights_figure(
        torch.stack([causal_weights(T=6), 2 * causal_weights(T=6, seed=1)]))]},
    "sharing": {"two stacks": lambda: [sharing.counts_figure(SHARING_NUMBERS)]},
    "positions": {"three": lambda: [positions.positions_figure(POSITION_NUMBERS)]},
    "norms": {"two norms": lambda: [norms.norms_figure(NORM_NUMBERS)]},
    "mlps": {"three MLPs": lambda: [mlps.mlps_figure(MLP_NUMBERS)]},
    "kvheads": {"4, 2, 1": lambda: [kvheads.kvheads_figure(KV_NUMBERS)]},
    "qknorm": {"with and without": lambda: [qknorm.qknorm_figure(QK_NUMBERS)]},
    "induction": {"2 and 1 layers": lambda: [induction.induction_figure(IND_NUMBERS)],
                  "timelines with the LLC": lambda: [induction.induction_timeline_figure(
                      ind_timeline_numbers(llc=True))],
                  "timelines without": lambda: [induction.induction_timeline_figure(
                      ind_timeline_numbers(llc=False))]},
    "windows": {"local and global": lambda: [windows.windows_figure(WIN_NUMBERS)]},
    "features": {"toy and char": lambda: [features.features_figure(FEATURE_NUMBERS,
                                                                   features.QUICK)]},
    "attention": {
        "2 layers x 2 heads, 12 chars": lambda: attention_pages(2, 2, char_labels(12)),
        "cpu-small, 27 chars, one grid": lambda: attention_pages(4, 4, char_labels(27)),
        "36 chars, split per layer": lambda: attention_pages(2, 4, char_labels(36)),
        "cpu-small context, 64 chars": lambda: attention_pages(1, 4, char_labels(64)),
        "--layer 1 --head 3": lambda: attention_pages(4, 4, char_labels(27), layer=1, head=3),
        "--layer 1": lambda: attention_pages(4, 4, char_labels(8), layer=1),
        "--head 2": lambda: attention_pages(4, 4, char_labels(8), head=2),
        "one-token prompt": lambda: attention_pages(4, 4, char_labels(1), layer=0, head=0),
        "BPE tokens": lambda: attention_pages(1, 2, BPE_LABELS),
        "200 tokens, thinned labels": lambda: attention_pages(1, 1, char_labels(200)),
    },
}
# The pictures that take over ~3 s each to draw here (marked slow: `-m "not slow"` skips them).
SLOW_FIGURES = {"attention: 200 tokens, thinned labels", "attention: 36 chars, split per layer",
                "attention: cpu-small, 27 chars, one grid",
                "attention: cpu-small context, 64 chars"}
CASES = [pytest.param(name, draw, id=f"{name}: {case}",
                      marks=pytest.mark.slow if f"{name}: {case}" in SLOW_FIGURES else ())
         for name, cases in FIGURES.items() for case, draw in cases.items()]
ATTENTION_TITLES = {"query (looking)", "key (attended to)"}


def test_the_slow_figures_are_cases():
    assert SLOW_FIGURES.issubset(case.id for case in CASES)


@pytest.mark.parametrize(("name", "draw"), CASES)
def test_every_text_is_on_the_canvas_and_readable(name: str,
                                                 draw: Callable[[], list[Figure]]) -> None:
    for fig in draw():
        assert not problems(fig)
        if name == "attention":  # every picture names its axes, however the maps were split
            axis_titles = {ax.get_xlabel() for ax in fig.axes} | {ax.get_ylabel()
                                                                  for ax in fig.axes}
            assert axis_titles >= ATTENTION_TITLES


def test_every_experiment_and_every_figure_function_is_covered() -> None:
    assert set(FIGURES) == {*EXPERIMENTS, "attention"}
    modules = [shapes, parity, multihead, layernorm, params, residual, dropout, sharing,
               positions, norms, mlps, kvheads, qknorm, induction, windows, features,
               attention_maps]
    figure_functions = {f"{module.__name__}.{name}" for module in modules
                        for name, function in inspect.getmembers(module, inspect.isfunction)
                        if function.__module__ == module.__name__
                        and inspect.signature(function).return_annotation in ("Figure", Figure)}
    assert figure_functions == {
        "glassgpt.experiments.shapes.head_weights_figure",
        "glassgpt.experiments.parity.differences_figure",
        "glassgpt.experiments.multihead.head_maps_figure",
        "glassgpt.experiments.layernorm.leak_figure",
        "glassgpt.experiments.params.shares_figure",
        "glassgpt.experiments.residual.loss_curves_figure",
        "glassgpt.experiments.dropout.weights_figure",
        "glassgpt.experiments.sharing.counts_figure",
        "glassgpt.experiments.positions.positions_figure",
        "glassgpt.experiments.norms.norms_figure",
        "glassgpt.experiments.mlps.mlps_figure",
        "glassgpt.experiments.kvheads.kvheads_figure",
        "glassgpt.experiments.qknorm.qknorm_figure",
        "glassgpt.experiments.induction.induction_figure",
        "glassgpt.experiments.induction.induction_timeline_figure",
        "glassgpt.experiments.windows.windows_figure",
        "glassgpt.experiments.features.features_figure",
        "glassgpt.experiments.attention_maps.page_figure",
    }


def test_the_checker_sees_text_off_the_canvas_tiny_labels_and_a_bare_colour_bar() -> None:
    fig = Figure(figsize=(2, 2), dpi=DPI)
    ax = fig.subplots()
    image = ax.imshow(causal_weights(T=20).numpy())
    ax.set_xticks(range(20), [f"token{i}" for i in range(20)])
    ax.tick_params(labelsize=5)
    fig.colorbar(image, ax=ax)
    fig.text(0.5, 1.02, "a title above the top edge")
    found = " | ".join(problems(fig))
    assert "a title above the top edge" in found and "leaves the canvas" in found
    assert "is 5.0 pt" in found
    assert "'token0' and 'token1' overlap" in found
    assert "has no label" in found
    assert "without an axis title" in found


def rendered(fig: Figure) -> np.ndarray:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3]  # (height, width, 3)


@pytest.mark.parametrize("draw", [
    lambda w: shapes.head_weights_figure(w[None]),
    lambda w: dropout.weights_figure(torch.stack([w, w])),
    lambda w: multihead.head_maps_figure({1: w[None, None]}),
    lambda w: attention_maps.page_figure(w[None, None], char_labels(6),
                                         Page([(0, 0)], 1)),
], ids=["shapes", "dropout", "multihead", "attention"])
def test_masked_cells_are_hatched_never_the_colour_of_a_zero_weight(draw) -> None:
    weights = torch.tril(torch.ones(6, 6))
    weights[:, 0] = 0.0  # a real weight of 0 in every row, beside the masked future
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1)
    fig = draw(weights)
    ax = next(ax for ax in fig.axes if ax.images)
    image = ax.images[0]
    assert image.get_array().mask[0, 5] and not image.get_array().mask[5, 0]
    assert any(isinstance(p, Rectangle) and p.get_hatch() for p in ax.patches)
    colorbar_labels = [a.get_ylabel() for a in fig.axes if a not in (ax,)]
    assert any("hatched: masked" in label for label in colorbar_labels)
    # On the canvas: the masked corner holds two colours (hatching), the zero weight one.
    pixels = rendered(fig)
    to_pixel = ax.transData.transform
    height = pixels.shape[0]

    def colours(row: int, col: int) -> int:
        (x0, y0), (x1, y1) = to_pixel((col - 0.4, row - 0.4)), to_pixel((col + 0.4, row + 0.4))
        xs, ys = sorted((int(x0), int(x1))), sorted((height - int(y0), height - int(y1)))
        patch = pixels[ys[0]:ys[1], xs[0]:xs[1]].reshape(-1, 3)
        return len({tuple(p) for p in patch})

    assert colours(0, 5) >= 2 and colours(5, 0) == 1


def test_the_multihead_panels_say_which_offset_each_head_looks_at() -> None:
    T = 6
    maps = {2: torch.stack([torch.eye(T).roll(o, dims=0).tril() for o in (1, 2)])[None]}
    fig = multihead.head_maps_figure(maps)  # (sequences, H, T, T): head h looks h + 1 back
    titles = [ax.get_title() for ax in fig.axes if ax.images]
    assert titles == ["2 heads: head 0\nlooks 1 back", "2 heads: head 1\nlooks 2 back"]


def test_layernorm_zero_bars_are_written_out() -> None:
    fig = layernorm.leak_figure([0.0, 0.0, 0.0], [0.5, 0.4, 0.3])
    written = [t.get_text() for t in drawn_texts(fig)]
    assert written.count("0 (exactly)") == 3


def test_sharing_squares_have_a_legend() -> None:
    fig = sharing.counts_figure(SHARING_NUMBERS)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["weights moved", "unchanged"]


@pytest.mark.parametrize(("L", "H", "T", "layer", "head", "expected"), [
    (4, 4, 27, None, None, [("", 16, 4)]),  # the cpu-small README prompt: one grid
    (4, 4, 36, None, None, [("layer 0", 4, 2), ("layer 1", 4, 2), ("layer 2", 4, 2),
                            ("layer 3", 4, 2)]),
    (4, 4, 64, 2, None, [("", 4, 2)]),  # one layer at the full cpu-small context
    (4, 4, 64, 2, 1, [("", 1, 1)]),
    (6, 6, 256, None, None, [(f"layer {lay}, head {h}", 1, 1)
                             for lay in range(6) for h in range(6)]),  # shakespeare-char
])
def test_attention_is_split_instead_of_shrinking(L: int, H: int, T: int, layer: int | None,
                                                 head: int | None, expected: list) -> None:
    panels = select_panels(torch.zeros(L, H, 1, 1), layer, head)
    pages = plan_pages(panels, T)
    assert [(p.part, len(p.panels), p.n_cols) for p in pages] == expected
    assert Page([(1, 2)], 1, "layer 1, head 2").path(
        Path("maps.png")).name == "maps_layer1_head2.png"
