"""Sliding-window attention: what a local layer cannot see, what a global layer adds, and the
KV-cache bytes each needs.

A local layer's query sees itself and the W - 1 keys before it (`sliding_window`, Gemma 2 and
3, Mistral). Stacked, L local layers pass information at most L * (W - 1) positions forward:
that is their receptive field, exact, not a tendency. Three parts, each measured here:
  * the receptive field of untrained models, from the gradient of the last position's logits
    with respect to every input embedding: exactly 0 beyond L * (W - 1) positions back when
    every layer is local, non-zero everywhere once one layer is global;
  * a task that needs the first token at every position ("recall the first token"), trained
    on models that differ only in `local_layers`: all-local stays at chance beyond its reach,
    one global layer among the local ones solves it at every distance;
  * the KV cache a context of N needs, from the config: every layer global holds N positions
    per layer, a local layer needs only W. glassgpt's own `KVCache` keeps every position of
    every layer (read off its buffers here); a ring buffer of W for the local layers is what
    Gemma's implementations use, and glassgpt does not have one.
Notation: L = layers, W = window, T = positions, N = a context length, H_kv = key/value heads,
d = head width, V = vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.config import GPTConfig, load_preset, preset_names
from glassgpt.experiments.results import Check, ExperimentResult, Table, step_taken
from glassgpt.experiments.tasks import single_thread
from glassgpt.figures import TICK_PT, label_axes, new_figure, save_figure
from glassgpt.model import GPT

FLOAT32_BYTES = 4
BFLOAT16_BYTES = 2  # what the real-size presets' weights (and caches) are published in


@dataclass(frozen=True)
class WindowSettings:
    vocab_size: int = 8
    seq_len: int = 16
    n_layer: int = 2
    window: int = 3  # L * (W - 1) = 4: far less than the 15 positions back the task needs
    n_embd: int = 32
    n_head: int = 2
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    eval_sequences: int = 1000
    contexts: tuple[int, ...] = (16, 1024, 8192, 32768)  # N for the cache table
    min_global_accuracy: float = 0.9  # beyond the local reach, after training


QUICK = WindowSettings(n_embd=16, steps=150, batch_size=32, lr=1e-2, eval_sequences=500,
                       min_global_accuracy=0.75)


def variants(s: WindowSettings) -> dict[str, tuple[int, ...] | None]:
    """name -> local_layers: every layer local (None), or all but the last (one global)."""
    return {"all local": None, "last layer global": tuple(range(s.n_layer - 1))}


def window_config(s: WindowSettings, local_layers: tuple[int, ...] | None) -> GPTConfig:
    """The demo's model: rotary positions, RMSNorm, the window on `local_layers` (None: on
    every layer)."""
    return GPTConfig(vocab_size=s.vocab_size, block_size=s.seq_len, n_layer=s.n_layer,
                     n_head=s.n_head, n_embd=s.n_embd, position="rope", norm="rmsnorm",
                     bias=False, dropout=0.0, sliding_window=s.window, local_layers=local_layers)


def input_gradient(model: GPT, idx: Tensor) -> Tensor:
    """|d (last position's logits . r) / d embedding_t| for every input position t: (T,).

    r is a random direction, so no logit is favoured; the token embeddings are read at the
    model's own `tok_emb` output (a forward hook keeps its gradient)."""
    kept: dict[str, Tensor] = {}

    def keep(module: Any, args: Any, output: Tensor) -> None:
        output.retain_grad()
        kept["x"] = output

    handle = model.tok_emb.register_forward_hook(keep)
    try:
        logits, _ = model.eval()(idx)  # (1, T, V)
    finally:
        handle.remove()
    direction = torch.randn(logits.shape[-1])
    (logits[0, -1] @ direction).backward()
    return kept["x"].grad[0].norm(dim=-1).detach()  # (T,)


def receptive_fields(s: WindowSettings, seed: int) -> dict[str, Any]:
    """For each variant (and every layer global), the gradient's size at each distance back
    from the last position, and the farthest distance where it is not exactly 0."""
    found: dict[str, Any] = {}
    models = {**{name: window_config(s, local) for name, local in variants(s).items()},
              "all global": dataclasses.replace(window_config(s, None), sliding_window=None)}
    for name, config in models.items():
        torch.manual_seed(seed)
        idx = torch.randint(s.vocab_size, (1, s.seq_len))
        grad = input_gradient(GPT(config), idx).flip(0)  # (T,): distance 0 (itself) first
        reached = torch.nonzero(grad).flatten()
        found[name] = {"gradient": (grad / grad.max()).tolist(),
                       "reach": int(reached.max()), "zeros": int((grad == 0).sum())}
    return found


def first_token_batch(batch_size: int, s: WindowSettings,
                      data: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random tokens (B, T); the target at every position is the sequence's first token."""
    idx = torch.randint(s.vocab_size, (batch_size, s.seq_len), generator=data)
    return idx, idx[:, :1].expand(batch_size, s.seq_len)


def train_recall(config: GPTConfig, s: WindowSettings, seed: int) -> tuple[GPT, list[float]]:
    """Train a model to name the first token at every position (Adam, fresh batches)."""
    torch.manual_seed(seed)
    model = GPT(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=s.lr)
    data = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(s.steps):
        idx, targets = first_token_batch(s.batch_size, s, data)
        logits, _ = model(idx)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        step_taken()
    return model.eval(), losses


@torch.no_grad()
def accuracy_by_distance(model: GPT, s: WindowSettings, seed: int) -> list[float]:
    """Share of held-out sequences whose first token is named right at each position t (the
    distance from that token): (T,)."""
    idx, targets = first_token_batch(s.eval_sequences, s,
                                     torch.Generator().manual_seed(seed + 10_000))
    logits, _ = model(idx)  # (N, T, V)
    return (logits.argmax(dim=-1) == targets).float().mean(dim=0).tolist()


def cache_bytes(config: GPTConfig, n_tokens: int, windowed: bool,
                dtype_bytes: int = FLOAT32_BYTES) -> int:
    """Bytes of K and V a context of `n_tokens` needs for one sequence: every layer holds
    min(N, W) positions if it is local and `windowed` (a ring buffer of W), else N."""
    per_position = 2 * config.kv_width * dtype_bytes  # K and V: H_kv x d each
    held = [min(n_tokens, config.sliding_window) if windowed and config.is_local(layer)
            else n_tokens for layer in range(config.n_layer)]
    return per_position * sum(held)


def glassgpt_cache_bytes(model: GPT) -> int:
    """Bytes glassgpt's own KVCache allocates for one sequence of the full context (read off
    its buffers: it keeps every position of every layer, local or not)."""
    model.setup_kv_cache(batch_size=1)
    try:
        return sum(block.attn.kv_cache.k.nbytes + block.attn.kv_cache.v.nbytes
                   for block in model.blocks)
    finally:
        model.remove_kv_cache()


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    s = QUICK if quick else WindowSettings()
    reach = s.n_layer * (s.window - 1)
    numbers: dict[str, Any] = {"n_layer": s.n_layer, "window": s.window, "seq_len": s.seq_len,
                               "local_reach": reach, "chance": 1 / s.vocab_size,
                               "steps": s.steps}
    with single_thread():
        numbers["receptive_field"] = receptive_fields(s, seed)
        trained = {name: train_recall(window_config(s, local), s, seed)
                   for name, local in variants(s).items()}
        numbers["accuracy"] = {name: accuracy_by_distance(model, s, seed)
                               for name, (model, _) in trained.items()}
    numbers["final_loss"] = {name: losses[-1] for name, (_, losses) in trained.items()}
    numbers["cache"] = cache_numbers(s, trained["last layer global"][0])
    numbers["presets"] = preset_caches(local_presets())
    pictures = [save_figure(windows_figure(numbers), out_dir / "windows.png")]
    return ExperimentResult(
        name="windows",
        summary=f"{s.n_layer} layers with a sliding window of {s.window}: what a local layer "
                f"cannot see, what one global layer adds, the KV cache ({s.steps} steps, "
                f"seed {seed})",
        tables=[reach_table(numbers, s), cache_table(numbers, s),
                *([presets_table(numbers)] if numbers["presets"] else [])], pictures=pictures,
        numbers=numbers, checks=expected_outcomes(numbers, s))


def cache_numbers(s: WindowSettings, model: GPT) -> dict[str, Any]:
    """The cache a context of each N needs (every layer global / all local but the last with a
    ring of W), and what glassgpt's KVCache really allocates at the trained context."""
    config = model.config
    return {"contexts": list(s.contexts),
            "all_global": [cache_bytes(config, n, windowed=False) for n in s.contexts],
            "windowed": [cache_bytes(config, n, windowed=True) for n in s.contexts],
            "glassgpt_allocates": glassgpt_cache_bytes(model),
            "glassgpt_context": config.block_size}


def local_presets() -> dict[str, GPTConfig]:
    """The shipped presets with local layers (Gemma 3's 5 local to 1 global, say)."""
    return {name: GPTConfig.from_preset(name) for name in preset_names()
            if load_preset(name).get("model", {}).get("sliding_window") is not None}


def preset_caches(configs: dict[str, GPTConfig]) -> dict[str, Any]:
    """The same comparison for each of `configs` (presets), in bfloat16, at its own context:
    from the config alone."""
    found = {}
    for name, config in configs.items():
        n = config.block_size
        found[name] = {"context": n, "window": config.sliding_window,
                       "local_layers": sum(config.is_local(i) for i in range(config.n_layer)),
                       "n_layer": config.n_layer,
                       "all_global": cache_bytes(config, n, False, BFLOAT16_BYTES),
                       "windowed": cache_bytes(config, n, True, BFLOAT16_BYTES)}
    return found


def beyond(accuracy: list[float], reach: int) -> float:
    """Mean accuracy at the positions farther from the first token than the local reach."""
    far = accuracy[reach + 1:]
    return sum(far) / len(far)


def reach_table(numbers: dict[str, Any], s: WindowSettings) -> Table:
    reach = numbers["local_reach"]
    table = Table(f"Receptive field (untrained, gradient of the last position's logits) and "
                  f"'recall the first token' after {s.steps} Adam steps; {s.n_layer} layers, "
                  f"window W = {s.window}, so L x (W - 1) = {reach}; context {s.seq_len}, "
                  f"chance {numbers['chance']:.3f}",
                  ["layers", "reach (positions back)", "inputs with gradient exactly 0",
                   f"accuracy within {reach}", f"accuracy beyond {reach}"],
                  formats={f"accuracy within {reach}": ".3f", f"accuracy beyond {reach}": ".3f"})
    for name, field in numbers["receptive_field"].items():
        accuracy = numbers["accuracy"].get(name)
        within = sum(accuracy[:reach + 1]) / (reach + 1) if accuracy else None
        table.add_row(name, field["reach"], field["zeros"], within,
                      beyond(accuracy, reach) if accuracy else None)
    return table


def cache_table(numbers: dict[str, Any], s: WindowSettings) -> Table:
    cache = numbers["cache"]
    table = Table(f"KV-cache bytes of one sequence of N tokens, float32, from the config "
                  f"(2 x H_kv x d x 4 bytes a position a layer); layer {s.n_layer - 1} global, "
                  f"the others local (W = {s.window}). glassgpt's KVCache keeps every "
                  f"position ({cache['glassgpt_allocates']:,} bytes at its context of "
                  f"{cache['glassgpt_context']}: the first column); the second is what a ring "
                  f"cache of W for the local layers would hold, which glassgpt does not have",
                  ["N", "every layer global", "local layers hold W", "ratio"],
                  formats={"ratio": ".2f"})
    for n, full, windowed in zip(cache["contexts"], cache["all_global"], cache["windowed"],
                                 strict=True):
        table.add_row(n, full, windowed, full / windowed)
    return table


def presets_table(numbers: dict[str, Any]) -> Table:
    table = Table("The shipped presets with local layers, at their own context N, bfloat16 "
                  "(2 bytes a number), from the config: what a ring cache of W would save "
                  "(glassgpt's KVCache would hold the 'every layer global' bytes)",
                  ["preset", "N", "local / layers", "W", "every layer global",
                   "local layers hold W", "ratio"], formats={"ratio": ".2f"})
    for name, p in numbers["presets"].items():
        table.add_row(name, p["context"], f"{p['local_layers']} / {p['n_layer']}", p["window"],
                      p["all_global"], p["windowed"], p["all_global"] / p["windowed"])
    return table


def expected_outcomes(numbers: dict[str, Any], s: WindowSettings) -> list[Check]:
    reach, fields = numbers["local_reach"], numbers["receptive_field"]
    local, mixed = numbers["accuracy"]["all local"], numbers["accuracy"]["last layer global"]
    chance = numbers["chance"]
    cache = numbers["cache"]
    exact = fields["all local"]["reach"] == reach \
        and fields["all local"]["zeros"] == s.seq_len - reach - 1
    return [
        Check(f"all-local: the gradient is exactly 0 beyond L x (W - 1) = {reach} positions "
              f"back and non-zero within (reach {fields['all local']['reach']})", exact),
        Check(f"one global layer (or all): every input reaches the last position (reach "
              f"{fields['last layer global']['reach']} and {fields['all global']['reach']} of "
              f"{s.seq_len - 1})",
              fields["last layer global"]["reach"] == fields["all global"]["reach"]
              == s.seq_len - 1 and fields["last layer global"]["zeros"] == 0),
        Check(f"all-local names the first token at chance beyond {reach} (accuracy "
              f"{beyond(local, reach):.3f}, chance {chance:.3f})",
              beyond(local, reach) < 2 * chance),
        Check(f"one global layer names it beyond {reach} too (accuracy "
              f"{beyond(mixed, reach):.3f} >= {s.min_global_accuracy})",
              beyond(mixed, reach) >= s.min_global_accuracy),
        Check(f"glassgpt's KVCache holds every position ({cache['glassgpt_allocates']:,} bytes "
              f"= every layer global at N = {cache['glassgpt_context']})",
              cache["glassgpt_allocates"] == cache_bytes(
                  window_config(s, variants(s)["last layer global"]),
                  cache["glassgpt_context"], windowed=False)),
    ]


def windows_figure(numbers: dict[str, Any]) -> Figure:
    fig = new_figure(12.0, 3.6)
    field_ax, accuracy_ax, cache_ax = fig.subplots(1, 3)
    reach = numbers["local_reach"]
    fields = numbers["receptive_field"]
    # A log scale, so the small gradients of far inputs show; the exact zeros sit on a floor
    # line of their own (a log axis has no 0), marked x.
    nonzero = [g for field in fields.values() for g in field["gradient"] if g > 0]
    floor = min(nonzero) / 10
    for i, (name, field) in enumerate(fields.items()):
        grad = field["gradient"]
        seen = [(d, g) for d, g in enumerate(grad) if g > 0]
        field_ax.semilogy(*zip(*seen, strict=True), marker="o", markersize=3, label=name,
                          color=f"C{i}")
        zeros = [d for d, g in enumerate(grad) if g == 0]
        if zeros:
            field_ax.scatter(zeros, [floor] * len(zeros), marker="x", color=f"C{i}")
    field_ax.axhline(floor, color="0.6", linestyle=":", linewidth=1)
    field_ax.text(len(grad) - 1, floor * 1.6, "exactly 0", ha="right", fontsize=TICK_PT)
    field_ax.axvline(reach + 0.5, color="0.3", linestyle="--", linewidth=1)
    field_ax.text(reach + 0.7, 0.5, f"L x (W - 1) = {reach}", fontsize=TICK_PT)
    field_ax.legend(fontsize=TICK_PT, loc="upper right")
    label_axes(field_ax, xlabel="positions back from the last", ylabel="|gradient| / max",
               title="receptive field (untrained)")
    for i, (name, accuracy) in enumerate(numbers["accuracy"].items()):
        accuracy_ax.plot(range(len(accuracy)), accuracy, marker="o", markersize=3, label=name,
                         color=f"C{i}")
    accuracy_ax.axhline(numbers["chance"], color="0.5", linestyle=":", linewidth=1)
    accuracy_ax.text(len(accuracy) - 1, numbers["chance"] + 0.03, "chance", ha="right",
                     fontsize=TICK_PT)
    accuracy_ax.axvline(reach + 0.5, color="0.3", linestyle="--", linewidth=1)
    accuracy_ax.set_ylim(0, 1.05)
    accuracy_ax.legend(fontsize=TICK_PT, loc="center right")
    label_axes(accuracy_ax, xlabel="positions after the first token",
               ylabel="accuracy naming it", title=f"recall the first token ({numbers['steps']} "
               f"steps)")
    cache = numbers["cache"]
    cache_ax.loglog(cache["contexts"], cache["all_global"], marker="o", color="C1",
                    label="every layer global")
    cache_ax.loglog(cache["contexts"], cache["windowed"], marker="o", color="C0",
                    label=f"local layers hold W = {numbers['window']}")
    cache_ax.loglog([cache["glassgpt_context"]], [cache["glassgpt_allocates"]], marker="x",
                    markersize=9, linestyle="none", color="k", label="glassgpt's KVCache")
    cache_ax.legend(fontsize=TICK_PT)
    label_axes(cache_ax, xlabel="context N (tokens)", ylabel="KV-cache bytes",
               title="KV cache of one sequence")
    return fig
