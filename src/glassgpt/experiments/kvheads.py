"""Grouped key/value heads: 4, 2 and 1 KV heads for 4 query heads, side by side.

With grouped-query attention (GQA) several query heads share one key/value head; with one KV
head for all (multi-query attention, MQA) the KV cache that decoding keeps holds a quarter of
the numbers. Three character models on Tiny Shakespeare that differ only in `n_kv_head` train
the same steps on the same batches; for each the table shows the bytes its KV cache holds per
token (read off the cache's own buffers), its decoding speed (greedy, with the cache, measured
here and now: a displayed measurement, never a claim, as it depends on the machine and its
load) and its validation loss.
Notation: L = layers, H = query heads, H_kv = key/value heads, d = head width.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from glassgpt.decoding.generate import generate
from glassgpt.experiments.charlm import CharLMSettings, model_config, train_char_lm
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.experiments.tasks import single_thread
from glassgpt.figures import TICK_PT, label_axes, new_figure, save_figure
from glassgpt.model import GPT, count_parameters


@dataclass(frozen=True)
class KVHeadSettings:
    lm: CharLMSettings = CharLMSettings()
    kv_head_counts: tuple[int, ...] = (4, 2, 1)
    decode_repeats: int = 5  # the best of these timings is shown


QUICK = KVHeadSettings(lm=CharLMSettings(block_size=32, steps=100, eval_every=50,
                                         eval_windows=32), decode_repeats=1)


def cache_bytes_per_token(model: GPT) -> int:
    """Bytes the KV cache holds per token, summed over every layer's key and value buffers."""
    model.setup_kv_cache(batch_size=1)
    try:
        caches = [block.attn.kv_cache for block in model.blocks]
        total = sum(cache.k.nbytes + cache.v.nbytes for cache in caches)
        return total // caches[0].max_len
    finally:
        model.remove_kv_cache()


@torch.no_grad()
def decoding_seconds(model: GPT) -> float:
    """Seconds of greedy decoding with the KV cache from a one-token prompt to the full context,
    on the plain model (the eager engine)."""
    prompt = torch.zeros(1, 1, dtype=torch.long)
    started = time.perf_counter()
    generate(model, prompt, max_new_tokens=model.config.block_size - 1, temperature=0.0,
             engine="eager")
    return time.perf_counter() - started


def decoding_tokens_per_second(models: dict[int, GPT], repeats: int) -> dict[int, float]:
    """Each model's decoding speed, the best of `repeats` runs. The models take turns, so a
    burst of load on a shared machine slows all of them alike rather than one."""
    best = {kv: float("inf") for kv in models}
    for _ in range(repeats):
        for kv, model in models.items():
            best[kv] = min(best[kv], decoding_seconds(model))
    return {kv: (model.config.block_size - 1) / best[kv] for kv, model in models.items()}


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    s = QUICK if quick else KVHeadSettings()
    numbers: dict[str, Any] = {"n_head": s.lm.n_head, "n_layer": s.lm.n_layer,
                               "head_dim": s.lm.n_embd // s.lm.n_head,
                               "kv_head_counts": list(s.kv_head_counts)}
    with single_thread():
        trained = {kv: train_char_lm(model_config(s.lm, n_kv_head=kv), s.lm, seed)
                   for kv in s.kv_head_counts}
        speeds = decoding_tokens_per_second({kv: t.model for kv, t in trained.items()},
                                            s.decode_repeats)
    for kv, t in trained.items():
        numbers[str(kv)] = {"parameters": count_parameters(t.model),
                            "cache_bytes_per_token": cache_bytes_per_token(t.model),
                            "tokens_per_second": speeds[kv], "val_loss": t.final_val}
    pictures = [save_figure(kvheads_figure(numbers), out_dir / "kvheads.png")]
    return ExperimentResult(
        name="kvheads",
        summary=f"{s.lm.n_head} query heads with {', '.join(map(str, s.kv_head_counts))} key/value "
                f"heads: cache, decoding speed, loss ({s.lm.steps} steps, seed {seed})",
        tables=[results_table(numbers, s)], pictures=pictures, numbers=numbers,
        checks=expected_outcomes(numbers, s))


def kind_of(kv: int, n_head: int) -> str:
    if kv == n_head:
        return "multi-head"
    return "multi-query" if kv == 1 else "grouped-query"


def results_table(numbers: dict[str, Any], s: KVHeadSettings) -> Table:
    L, d = numbers["n_layer"], numbers["head_dim"]
    table = Table(f"{L} layers, {s.lm.n_head} query heads of width {d}, {s.lm.steps} AdamW steps "
                  f"on Tiny Shakespeare (characters), context {s.lm.block_size}; cache bytes = "
                  f"2 (K and V) x L x H_kv x d x 4 bytes (float32); decoding: greedy, batch 1, "
                  f"one thread, measured on this machine now",
                  ["KV heads", "attention", "parameters", "cache bytes per token",
                   "decoding tokens/s", "val loss"],
                  formats={"decoding tokens/s": ",.0f", "val loss": ".3f"})
    for kv in s.kv_head_counts:
        n = numbers[str(kv)]
        table.add_row(kv, kind_of(kv, s.lm.n_head), n["parameters"], n["cache_bytes_per_token"],
                      n["tokens_per_second"], n["val_loss"])
    return table


def expected_outcomes(numbers: dict[str, Any], s: KVHeadSettings) -> list[Check]:
    H, L, d = s.lm.n_head, numbers["n_layer"], numbers["head_dim"]
    full = numbers[str(H)]["cache_bytes_per_token"]
    shrinks = all(numbers[str(kv)]["cache_bytes_per_token"] * H == full * kv
                  and numbers[str(kv)]["cache_bytes_per_token"] == 2 * L * kv * d * 4
                  for kv in s.kv_head_counts)
    fewest = min(s.kv_head_counts)
    worst = numbers[str(fewest)]["val_loss"] - numbers[str(H)]["val_loss"]
    sizes = ", ".join(str(numbers[str(kv)]["cache_bytes_per_token"]) for kv in s.kv_head_counts)
    return [
        Check(f"the cache shrinks by n_head / n_kv_head exactly ({sizes} bytes per token; "
              f"= 2 x L x H_kv x d x 4)", shrinks),
        Check(f"{fewest} KV head costs little loss: val within 0.05 of {H} KV heads "
              f"(+{worst:.3f})", worst <= 0.05),
    ]


def kvheads_figure(numbers: dict[str, Any]) -> Figure:
    fig = new_figure(9.0, 3.0)
    panels = fig.subplots(1, 3)
    kv_head_counts = numbers["kv_head_counts"]
    names = [f"{kv} KV" for kv in kv_head_counts]
    measured = [("cache_bytes_per_token", "bytes per token", "KV cache"),
                ("tokens_per_second", "tokens / s", "decoding speed (this machine)"),
                ("val_loss", "validation loss", "loss")]
    for ax, (key, ylabel, title) in zip(panels, measured, strict=True):
        values = [numbers[str(kv)][key] for kv in kv_head_counts]
        bars = ax.bar(names, values, color=["C0", "C1", "C2"][:len(names)])
        # Every bar starts at 0, so its height is its value: an axis cut at 1.8 made a loss gap
        # of 0.013 look like 10%. The values are written on the bars, for the small differences.
        for bar, value in zip(bars, values, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), VALUE_FORMATS[key](value),
                    ha="center", va="bottom", fontsize=TICK_PT)
        ax.set_ylim(0, 1.18 * max(values))
        label_axes(ax, xlabel="key/value heads", ylabel=ylabel, title=title)
    return fig


VALUE_FORMATS = {"cache_bytes_per_token": "{:,}".format, "tokens_per_second": "{:,.0f}".format,
                 "val_loss": "{:.3f}".format}
