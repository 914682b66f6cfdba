"""Why multi-head: one attention layer must copy the tokens 1, 2 and 4 positions back at once.

A one-layer, attention-only model (token + learned position embeddings, one causal multi-head
attention with a residual, one linear output per target) is trained with 1, 2, 3 and 6 heads at a
fixed width, so every variant has the same number of parameters. One head mixes everything it reads
into a single weighted average, so it can follow one offset well and the others only partly; with a
head per offset each can put all its weight on its own offset. Notation: B = batch, T = positions,
C = width, H = heads, K = targets (offsets), V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from glassgpt.attention import MultiHeadSelfAttention
from glassgpt.experiments.results import Check, ExperimentResult, Table
from glassgpt.experiments.tasks import (
    accuracy_per_target,
    copy_back_batch,
    single_thread,
    train_copier,
)
from glassgpt.figures import (
    MASKED_NOTE,
    SUPTITLE_PT,
    label_axes,
    labelled_colorbar,
    new_figure,
    save_figure,
    show_attention,
    wrap_title,
)
from glassgpt.hooks import recorded
from glassgpt.model import count_parameters

OFFSETS = (1, 2, 4)
CHANCE = 0.1  # vocabulary of 10


@dataclass(frozen=True)
class MultiheadSettings:
    vocab_size: int = 10
    seq_len: int = 12
    d_model: int = 24
    head_counts: tuple[int, ...] = (1, 2, 3, 6)
    n_seeds: int = 3
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-2
    eval_sequences: int = 1000


QUICK = MultiheadSettings(head_counts=(1, 3, 6), n_seeds=2, steps=300)


class AttentionOnlyCopier(nn.Module):
    """Embeddings, one causal multi-head attention with a residual, one output layer per target."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_heads: int,
                 n_targets: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.attn = MultiHeadSelfAttention(d_model, n_heads, causal=True)
        self.heads = nn.ModuleList(nn.Linear(d_model, vocab_size) for _ in range(n_targets))

    def embed(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(positions)  # (B, T, C)

    def forward(self, idx: Tensor) -> Tensor:
        """idx (B, T) -> logits (B, T, K, V)."""
        x = self.embed(idx)
        x = x + self.attn(x)
        return torch.stack([head(x) for head in self.heads], dim=2)

    @torch.no_grad()
    def attention_weights(self, idx: Tensor) -> Tensor:
        """The attention weights (B, H, T, T) for idx (B, T)."""
        with recorded(self.attn.hook_pattern) as weights:
            self.attn(self.embed(idx))
        return weights[0]


def train_one(n_heads: int, seed: int, s: MultiheadSettings) -> AttentionOnlyCopier:
    """A model with `n_heads` heads, initialised and fed data from `seed`, trained."""
    torch.manual_seed(seed)
    model = AttentionOnlyCopier(s.vocab_size, s.seq_len, s.d_model, n_heads, len(OFFSETS))
    data = torch.Generator().manual_seed(seed + 10_000)
    train_copier(model, OFFSETS, s.vocab_size, s.seq_len, s.steps, s.batch_size, s.lr, data)
    return model


def held_out_batch(s: MultiheadSettings) -> tuple[Tensor, Tensor]:
    """The same evaluation sequences for every model, independent of the training seed."""
    return copy_back_batch(s.eval_sequences, s.seq_len, s.vocab_size, OFFSETS,
                           torch.Generator().manual_seed(123_456))


def weight_per_offset(weights: Tensor, max_offset: int) -> Tensor:
    """Share of its attention each head puts on the key o positions back, o = 0..max_offset,
    and (last column) on every key further back.

    weights (B, H, T, T) -> (H, max_offset + 2). Every offset is averaged over the same queries,
    those with t >= max_offset (where all the offsets exist), so each head's row sums to 1.
    """
    T = weights.shape[-1]
    queries = torch.arange(max_offset, T).view(-1, 1)  # (T', 1)
    back = queries - torch.arange(T).view(1, -1)  # (T', T): how far key s lies behind query t
    rows = weights[:, :, max_offset:, :]  # (B, H, T', T)
    columns = [(rows * (back == o)).sum(dim=-1) for o in range(max_offset + 1)]
    columns.append((rows * (back > max_offset)).sum(dim=-1))
    return torch.stack([c.mean(dim=(0, 2)) for c in columns], dim=1)  # (H, max_offset + 2)


def train_every_head_count(s: MultiheadSettings, seeds: list[int]) -> tuple[dict, dict, dict]:
    """Train each head count on each seed. Returns per head count: the accuracy per target of
    every seed, the parameter count, and the attention weights (B, H, T, T) of the first seed."""
    idx, targets = held_out_batch(s)
    accuracy: dict[int, list[list[float]]] = {}
    params: dict[int, int] = {}
    maps: dict[int, Tensor] = {}
    for n_heads in s.head_counts:
        accuracy[n_heads] = []
        for model_seed in seeds:
            with single_thread():
                model = train_one(n_heads, model_seed, s)
            with torch.no_grad():
                accuracy[n_heads].append(accuracy_per_target(model(idx), targets))
            if model_seed == seeds[0]:
                maps[n_heads] = model.attention_weights(idx[:200])
        params[n_heads] = count_parameters(model)
    return accuracy, params, maps


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    s = QUICK if quick else MultiheadSettings()
    seeds = [seed + i for i in range(s.n_seeds)]
    accuracy, params, maps = train_every_head_count(s, seeds)
    specialisation = {h: weight_per_offset(m, max(OFFSETS)) for h, m in maps.items()}
    pictures = [save_figure(head_maps_figure(maps), out_dir / "multihead_heads.png")]
    result = ExperimentResult(
        name="multihead",
        summary=f"one attention layer copies the tokens {OFFSETS} back at every position",
        tables=[accuracy_table(accuracy, params, s), specialisation_table(specialisation)],
        pictures=pictures,
        numbers={"offsets": list(OFFSETS), "seeds": seeds, "chance": CHANCE,
                 "accuracy": {str(h): a for h, a in accuracy.items()},
                 "worst_target": {str(h): [min(a) for a in runs] for h, runs in accuracy.items()},
                 "parameters": {str(h): p for h, p in params.items()},
                 "dominant_offset": {str(h): dominant_offsets(w)
                                     for h, w in specialisation.items()}},
    )
    result.checks = expected_outcomes(accuracy, params, specialisation)
    return result


def dominant_offsets(offset_weights: Tensor) -> list[int]:
    """For each head, the offset (0 = the token itself) it attends to most. (H, O) -> H ints.

    The last column of `offset_weights` gathers every key further back, so its index means
    "that far back or further".
    """
    return offset_weights.argmax(dim=1).tolist()


def worst_per_seed(runs: list[list[float]]) -> str:
    """The worst target's accuracy of every seed, as the table and the checks both print it."""
    return ", ".join(f"{min(accuracy):.1%}" for accuracy in runs)


def accuracy_table(accuracy: dict[int, list[list[float]]], params: dict[int, int],
                   s: MultiheadSettings) -> Table:
    columns = ["heads", "head width", "parameters"]
    columns += [f"acc t-{o}" for o in OFFSETS] + ["worst target, each seed"]
    table = Table(f"width {s.d_model}, {s.steps} Adam steps (lr {s.lr:g}): accuracy per target "
                  f"(mean of {s.n_seeds} seeds), and each seed's worst target (chance = "
                  f"{CHANCE:.0%})", columns, formats={c: ".1%" for c in columns[3:-1]})
    for n_heads, runs in accuracy.items():
        mean_per_target = torch.tensor(runs).mean(dim=0).tolist()
        table.add_row(n_heads, s.d_model // n_heads, params[n_heads], *mean_per_target,
                      worst_per_seed(runs))
    return table


def offset_names() -> list[str]:
    """Column names of `weight_per_offset`: t-0 (the token itself) .. t-4, then further back."""
    furthest = max(OFFSETS)
    return [f"w t-{o}" for o in range(furthest + 1)] + [f"w t-{furthest + 1}.."]


def specialisation_table(specialisation: dict[int, Tensor]) -> Table:
    names = offset_names()
    table = Table(f"where each head looks (first seed): w t-o = share of attention on the token "
                  f"o back (t-0 = itself), over queries t >= {max(OFFSETS)}; rows sum to 1",
                  ["heads", "head", *names, "looks at"],
                  formats={name: ".2f" for name in names})
    for n_heads, offset_weights in specialisation.items():
        looks_at = looked_at(offset_weights)
        for head, row in enumerate(offset_weights.tolist()):
            table.add_row(n_heads, head, *row, looks_at[head])
    return table


def looked_at(offset_weights: Tensor) -> list[str]:
    """Where each head looks most, as the table's last column says it: "t-4" (the token 4
    back), "t-0" (itself) or "t-5.." (further back). (H, O) -> H names."""
    names = offset_names()
    return [names[o].removeprefix("w ") for o in dominant_offsets(offset_weights)]


def looks_back(offset_weights: Tensor) -> list[str]:
    """The same offsets as `looked_at` (one source: `dominant_offsets`), as the picture's
    titles say them: "looks 4 back", "looks at itself", "looks 5+ back"."""
    furthest = max(OFFSETS) + 1  # the last column: that far back or further
    return ["looks at itself" if o == 0 else f"looks {o}{'+' if o == furthest else ''} back"
            for o in dominant_offsets(offset_weights)]


def expected_outcomes(accuracy: dict[int, list[list[float]]], params: dict[int, int],
                      specialisation: dict[int, Tensor]) -> list[Check]:
    checks = [Check("every head count has the same number of parameters",
                    len(set(params.values())) == 1)]
    if 1 in accuracy:
        runs = accuracy[1]
        checks.append(Check(f"1 head fails some target in every seed (worst target < 50% in "
                            f"each; got {worst_per_seed(runs)}; chance is {CHANCE:.0%})",
                            all(min(a) < 0.5 for a in runs)))
    for n_heads in (3, 6):
        if n_heads in accuracy:
            runs = accuracy[n_heads]
            checks.append(Check(f"{n_heads} heads solve all three targets in every seed (worst "
                                f"target > 90% in each; got {worst_per_seed(runs)})",
                                all(min(a) > 0.9 for a in runs)))
    if 3 in specialisation:
        looks_at = sorted(dominant_offsets(specialisation[3]))
        checks.append(Check(f"the 3 heads specialise on offsets {list(OFFSETS)} (got "
                            f"{looks_at})", looks_at == list(OFFSETS)))
    return checks


def head_maps_figure(maps: dict[int, Tensor]) -> Figure:
    """One row per head count, one panel per head: the attention map averaged over sequences,
    titled with where the head looks as the specialisation table measures it (`looks_back`)."""
    head_counts = list(maps)
    n_cols = max(head_counts)
    width = 1.7 * n_cols + 1.2
    fig = new_figure(width, 2.1 * len(head_counts) + 0.7)  # two-line titles: head, offset
    axes = fig.subplots(len(head_counts), n_cols, squeeze=False)
    for row, n_heads in enumerate(head_counts):
        mean_map = maps[n_heads].mean(dim=0)  # (H, T, T)
        looks = looks_back(weight_per_offset(maps[n_heads], max(OFFSETS)))  # H titles
        for col in range(n_cols):
            ax = axes[row][col]
            ax.set_xticks([])
            ax.set_yticks([])
            if col >= n_heads:
                ax.axis("off")
                continue
            image = show_attention(ax, mean_map[col])
            label_axes(ax, xlabel="key s", ylabel="query t" if col == 0 else "",
                       title=f"{n_heads} head{'s' if n_heads > 1 else ''}: head {col}\n"
                             f"{looks[col]}")
    labelled_colorbar(fig, image, axes, f"attention weight\n({MASKED_NOTE})", shrink=0.6)
    title = "each head's attention (mean over sequences): a diagonal = one fixed offset"
    fig.suptitle(wrap_title(title, width), fontsize=SUPTITLE_PT)
    return fig
