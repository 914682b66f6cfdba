"""Parameter counts: the 12C^2 + 13C formula per block against counting, and GPT-2 small.

Per block with biases and the 4x MLP (C = width):
    attention  qkv 3C^2 + 3C, proj C^2 + C        ->  4C^2 + 4C
    MLP        fc 4C^2 + 4C, proj 4C^2 + C         ->  8C^2 + 5C
    two LayerNorms, gamma and beta each of C       ->        4C
    total                                          -> 12C^2 + 13C
GPT-2 small is built on the meta device: shapes without memory, so counting 124M parameters
costs nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.figure import Figure

from glassgpt.block import TransformerBlock
from glassgpt.config import GPTConfig
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.figures import TICK_PT, label_axes, new_figure, save_figure
from glassgpt.model import GPT, count_parameters

WIDTHS = (64, 128, 256, 384, 512, 768, 1024)
GPT2_SMALL_TOTAL = 124_439_808  # the published count of GPT-2 small with its tied LM head


def block_formula(C: int) -> int:
    return 12 * C * C + 13 * C


def gpt_formula(config: GPTConfig) -> int:
    """V*C + block_size*C + L*(12C^2 + 13C) + 2C: embeddings, blocks, final LayerNorm."""
    C = config.n_embd
    return (config.vocab_size * C + config.block_size * C
            + config.n_layer * block_formula(C) + 2 * C)


def gpt2_small_breakdown() -> dict[str, int]:
    """Counted parameters of each part of GPT-2 small, built with the library's `GPT`."""
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset("gpt2"))
    return {
        "token embedding (V x C, shared with the LM head)": count_parameters(model.tok_emb),
        "position embedding (block_size x C)": count_parameters(model.pos_emb),
        "12 blocks": count_parameters(model.blocks),
        "final LayerNorm": count_parameters(model.ln_f),
        "total (tied weights counted once)": count_parameters(model),
    }


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    del seed  # nothing random is measured
    widths = WIDTHS[:4] if quick else WIDTHS
    formula_table = Table("one block: formula against counting",
                          ["C", "12C^2 + 13C", "counted", "equal"], formats={"C": "d"})
    counted = {}
    for C in widths:
        with torch.device("meta"):
            counted[C] = count_parameters(TransformerBlock(C, max(1, C // 64)))
        formula_table.add_row(C, block_formula(C), counted[C], counted[C] == block_formula(C))

    parts = gpt2_small_breakdown()
    total = parts["total (tied weights counted once)"]
    gpt2_table = Table("GPT-2 small (V=50257, block_size=1024, L=12, C=768)",
                       ["part", "parameters", "share"], formats={"share": ".2%"})
    for part, count in parts.items():
        gpt2_table.add_row(part, count, count / total)
    formula_total = gpt_formula(GPTConfig.from_preset("gpt2"))
    gpt2_table.add_row("formula V*C + T*C + L*(12C^2+13C) + 2C", formula_total,
                       formula_total / total)
    embeddings = (parts["token embedding (V x C, shared with the LM head)"]
                  + parts["position embedding (block_size x C)"])
    picture = save_figure(shares_figure(parts), out_dir / "params_gpt2.png")
    return ExperimentResult(
        name="params", summary="12C^2 + 13C per block, and GPT-2 small's 124,439,808",
        tables=[formula_table, gpt2_table], pictures=[picture],
        numbers={"block": {str(C): {"formula": block_formula(C), "counted": n}
                           for C, n in counted.items()},
                 "gpt2_small": parts, "gpt2_small_total": total,
                 "embedding_share": embeddings / total},
        checks=[Check("every width matches 12C^2 + 13C",
                      all(n == block_formula(C) for C, n in counted.items())),
                Check(f"GPT-2 small has {GPT2_SMALL_TOTAL:,} parameters (counted {total:,})",
                      total == GPT2_SMALL_TOTAL),
                Check("the whole-model formula gives the same total", formula_total == total)])


def shares_figure(parts: dict[str, int]) -> Figure:
    """Horizontal bars: where GPT-2 small's parameters live, each with its share of the total."""
    *components, total_name = parts
    total = parts[total_name]
    fig = new_figure(6.4, 2.6)
    ax = fig.subplots()
    names = [name.split(" (")[0] for name in components]
    values = [parts[name] / 1e6 for name in components]
    bars = ax.barh(names[::-1], values[::-1], color="tab:blue")
    for bar, name in zip(bars, components[::-1], strict=True):
        share = parts[name] / total
        ax.text(bar.get_width() + 1, bar.get_y() + bar.get_height() / 2,
                f"{parts[name]:,} ({share:.1%})" if share >= 0.001 else
                f"{parts[name]:,} ({share:.3%})", va="center", fontsize=TICK_PT)
    ax.set_xlim(0, max(values) * 1.35)
    label_axes(ax, xlabel="millions of parameters", title=f"GPT-2 small: {total:,} parameters")
    return fig
