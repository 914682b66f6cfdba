"""Features with known answers: a dictionary recovers planted features, then reads a char model.

First a toy model of superposition: n sparse ground-truth features, each a random unit direction
in a space of fewer dimensions (64 in 16), each on with a small probability and a random
magnitude; an activation is the sum of the directions that are on. No transformer is involved:
the activations are made directly, so the right answer is known. A dictionary trained on them by
glassgpt's own trainer (glassgpt.interp.sae.training's `DictionaryTrainer`, fed from an
activation source defined here) should find those directions: for each true feature, the best
cosine with a decoder row (the mean of these is the "mean max cosine"), beside the same number
for a random dictionary of the same size, which is what chance gives.

Then a character model trained here on Tiny Shakespeare (experiments.charlm) and a TopK
dictionary on its residual stream after block 0. Nothing is planted there, so its latents are
measured, not assumed: on held-out text, the share of each latent's activation mass that falls
on one class of positions (one character, the character before, the first letter of a word, the
first character of a line, a capital, a punctuation mark), against the same share for the
residual stream's own coordinates (each signed, centred coordinate read as a feature).
Notation: n = true features, d = their width, F = latents, N = activations, K = classes.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.data import tinyshakespeare
from glassgpt.errors import ConfigError
from glassgpt.experiments.charlm import (
    CharLMSettings,
    model_config,
    shakespeare_ids,
    train_char_lm,
    validation_windows,
)
from glassgpt.experiments.results import Check, ExperimentResult, Table, step_taken
from glassgpt.experiments.tasks import single_thread
from glassgpt.figures import LABEL_PT, label_axes, labelled_colorbar, new_figure, save_figure
from glassgpt.interp.core.hooked import run_with_cache
from glassgpt.interp.sae import SAE
from glassgpt.interp.sae.training import DictionarySettings, DictionaryTrainer
from glassgpt.interp.sae.training.activations import WindowActivations
from glassgpt.model import GPT, eval_mode
from glassgpt.tokenizers import CharTokenizer

TOY_HOOK = "toy.hook_features"  # the name the toy dictionary's cfg.json records
RANDOM_SEED_OFFSET = 20_000  # the random control dictionary, apart from every other draw
RECOVERED = 0.9  # a true feature counts as recovered at this cosine (and the mean must reach it)
PUNCTUATION = ".,;:!?'-&$"


@dataclass(frozen=True)
class ToySettings:
    n_features: int = 64
    width: int = 16  # d: fewer dimensions than features, so they share them (superposition)
    firing: float = 0.05  # the chance that each feature is on in an activation
    d_sae: int = 128
    tokens: int = 400_000
    batch_tokens: int = 1024
    lr: float = 3e-3
    l1_coefficient: float = 1.0


@dataclass(frozen=True)
class CharSettings:
    lm: CharLMSettings = CharLMSettings()  # 2 layers, width 64, 1000 steps
    hook: str = "blocks.0.hook_resid_post"
    d_sae: int = 256
    k: int = 8  # TopK: latents on per position
    tokens: int = 1_000_000
    batch_tokens: int = 1024
    lr: float = 3e-3
    dead_tokens: int = 100_000  # silent this long, a latent is dead and AuxK revives it
    windows: int = 256  # held-out windows the latents are read on
    pure: float = 0.8  # a latent is "about one class" when this share of its mass is there
    # The kinds of class some latent is about, as measured at this size (seed 0); a check.
    kinds: tuple[str, ...] = ("one character", "a capital letter", "a word's first letter")


@dataclass(frozen=True)
class FeatureSettings:
    toy: ToySettings = ToySettings()
    char: CharSettings = CharSettings()


QUICK = FeatureSettings(
    toy=ToySettings(tokens=100_000, batch_tokens=512),
    char=CharSettings(lm=CharLMSettings(block_size=32, steps=100, eval_every=100,
                                        eval_windows=16),
                      d_sae=128, k=4, tokens=50_000, batch_tokens=512, windows=128,
                      kinds=("one character", "a capital letter")))


# --- the toy model of superposition ------------------------------------------------------------

def unit_rows(rows: Tensor) -> Tensor:
    return rows / rows.norm(dim=-1, keepdim=True)


class SparseFeatureSource:
    """Activations x = sum_i a_i * directions_i, each a_i on with probability `firing` and then
    uniform in [0, 1): the trainer's activation source (next_batch -> (x, x), the generator's
    state as the data position)."""

    def __init__(self, directions: Tensor, firing: float, batch_tokens: int, seed: int):
        self.directions, self.firing, self.batch_tokens = directions, firing, batch_tokens
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        shape = (self.batch_tokens, len(self.directions))
        on = torch.rand(shape, generator=self.generator) < self.firing  # (N, n)
        magnitudes = torch.rand(shape, generator=self.generator)  # (N, n)
        x = (on * magnitudes) @ self.directions  # (N, d)
        return x, x

    def get_state(self) -> Tensor:
        return self.generator.get_state()

    def set_state(self, state: Tensor) -> None:
        self.generator.set_state(state)


class CountingSource:
    """Another source, telling the demo's progress bar of every batch it hands out."""

    def __init__(self, source: Any):
        self.source = source

    def next_batch(self) -> tuple[Tensor, Tensor]:
        step_taken()
        return self.source.next_batch()

    def get_state(self) -> Tensor:
        return self.source.get_state()

    def set_state(self, state: Tensor) -> None:
        self.source.set_state(state)


def train_on(source: Any, settings: DictionarySettings, width: int) -> SAE:
    """A dictionary trained on `source` by glassgpt's trainer, as it would be saved (SAELens's
    inference tensors). The trainer writes its files; here they are thrown away."""
    with tempfile.TemporaryDirectory(prefix="glassgpt-features-") as scratch:
        trainer = DictionaryTrainer(settings, CountingSource(source), width, width,
                                    Path(scratch) / "dictionary")
        trainer.run()
        return trainer.inference_sae()


def best_cosines(directions: Tensor, decoder: Tensor) -> Tensor:
    """|cosine| of every true direction (n, d) with every decoder row (F, d): (n, F)."""
    return (unit_rows(directions) @ unit_rows(decoder).T).abs()


def toy_superposition(s: ToySettings, seed: int) -> dict[str, Any]:
    directions = unit_rows(torch.randn(s.n_features, s.width,
                                       generator=torch.Generator().manual_seed(seed)))  # (n, d)
    settings = DictionarySettings(hook=TOY_HOOK, d_sae=s.d_sae, architecture="standard",
                                  tokens=s.tokens, batch_tokens=s.batch_tokens, lr=s.lr,
                                  l1_coefficient=s.l1_coefficient, normalize_activations="none",
                                  resample_every=0, eval_every=0, checkpoint_every=0, seed=seed)
    sae = train_on(SparseFeatureSource(directions, s.firing, s.batch_tokens, seed + 1),
                   settings, s.width)
    cosines = best_cosines(directions, sae.W_dec.detach())  # (n, F)
    random_rows = torch.randn(s.d_sae, s.width,
                              generator=torch.Generator().manual_seed(seed + RANDOM_SEED_OFFSET))
    chance = best_cosines(directions, random_rows).max(dim=1).values  # (n,)
    best = cosines.max(dim=1)  # (n,)
    # Rows: the true features from the best recovered down; columns: each one's best latent.
    order = best.values.argsort(descending=True)
    return {"max_cosine": best.values.tolist(), "random_max_cosine": chance.tolist(),
            "mean_max_cosine": float(best.values.mean()),
            "random_mean_max_cosine": float(chance.mean()),
            "recovered": int((best.values >= RECOVERED).sum()),
            "matched": cosines[order][:, best.indices[order]].tolist(),
            "expected_on": s.n_features * s.firing}


# --- a character model's latents ---------------------------------------------------------------

def position_classes(windows: Tensor, chars: list[str]) -> tuple[list[str], Tensor]:
    """The classes a position of `windows` (B, T) may belong to, and for each class which of
    the positions 1 .. T-1 of every window are in it: names (K,) and masks (K, N), N = B(T-1).
    Position 0 is left out: the character before it is not in the window."""
    current, before = windows[:, 1:].flatten(), windows[:, :-1].flatten()  # (N,), (N,)

    def having(test: Any) -> Tensor:
        return torch.tensor([test(c) for c in chars])

    letter, capital = having(str.isalpha), having(str.isupper)
    classes = {f"{c!r}": current == i for i, c in enumerate(chars)}
    classes |= {f"after {c!r}": before == i for i, c in enumerate(chars)}
    classes["a capital letter"] = capital[current]
    classes["a word's first letter"] = letter[current] & ~letter[before]
    classes["a line's first character"] = before == chars.index("\n")
    classes["punctuation"] = having(lambda c: c in PUNCTUATION)[current]
    return list(classes), torch.stack(list(classes.values()))


def class_shares(activations: Tensor, masks: Tensor) -> tuple[Tensor, Tensor]:
    """For each feature of `activations` (N, F, all >= 0), the class (K) holding the largest
    share of its activation mass: (share (F,), class index (F,))."""
    mass = masks.to(activations.dtype) @ activations  # (K, F)
    # a class's share is at most 1; rounding of the two sums can make it 1 + 1e-7
    shares = (mass / activations.sum(dim=0).clamp(min=1e-12)).clamp(max=1.0)  # (K, F)
    best = shares.max(dim=0)
    return best.values, best.indices


def read_residual(model: GPT, hook: str, windows: Tensor) -> Tensor:
    """The activations at `hook` for positions 1 .. T-1 of `windows` (B, T): (N, C)."""
    with torch.no_grad(), eval_mode(model):
        _, cache = run_with_cache(model, windows, [hook])
    return cache[hook][:, 1:].flatten(0, 1)  # (B, T - 1, C) -> (N, C)


def char_features(s: CharSettings, seed: int) -> dict[str, Any]:
    trained = train_char_lm(model_config(s.lm), s.lm, seed)
    model = trained.model.eval()
    train_ids, _, _ = shakespeare_ids()
    settings = DictionarySettings(hook=s.hook, d_sae=s.d_sae, architecture="topk", k=s.k,
                                  tokens=s.tokens, batch_tokens=s.batch_tokens,
                                  context=s.lm.block_size, lr=s.lr, dead_tokens=s.dead_tokens,
                                  normalize_activations="none", eval_every=0,
                                  checkpoint_every=0, seed=seed)
    source = WindowActivations(model, s.hook, s.hook, train_ids.numpy().astype(np.int64),
                               s.lm.block_size, s.batch_tokens, seed, "cpu")
    sae = train_on(source, settings, s.lm.n_embd)
    windows, _ = validation_windows(s.lm.block_size, s.windows)  # (B, T)
    x = read_residual(model, s.hook, windows)  # (N, C)
    with torch.no_grad():
        latents = sae.encode(x)  # (N, F)
        reconstruction = sae.decode(latents)
    names, masks = position_classes(windows, characters())
    alive = latents.sum(dim=0) > 0  # (F,)
    share, best = class_shares(latents[:, alive], masks)
    centred = x - x.mean(dim=0)
    coordinates = torch.cat([centred.relu(), (-centred).relu()], dim=1)  # (N, 2C)
    coordinate_share, _ = class_shares(coordinates, masks)
    residual = (x - reconstruction).pow(2).sum(-1).mean() / centred.pow(2).sum(-1).mean()
    return {"val_loss": trained.final_val, "alive": int(alive.sum()),
            "explained_variance": float(1 - residual), "l0": float((latents > 0).sum(-1).float()
                                                                    .mean()),
            "share": share.tolist(), "label": [names[i] for i in best.tolist()],
            "density": (latents[:, alive] > 0).float().mean(0).tolist(),
            "coordinate_share": coordinate_share.tolist(),
            "pure": int((share >= s.pure).sum()),
            "pure_coordinates": int((coordinate_share >= s.pure).sum()),
            "classes": sorted({names[i] for i, v in zip(best.tolist(), share.tolist(),
                                                      strict=True) if v >= s.pure}),
            "base_rate": dict(zip(names, masks.float().mean(dim=1).tolist(), strict=True))}


def characters() -> list[str]:
    """Tiny Shakespeare's characters in the order of their ids (as shakespeare_ids made them)."""
    raw, _ = tinyshakespeare()
    tokenizer = CharTokenizer.from_text(raw.decode("utf-8"))
    return [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]


def kind_of(label: str) -> str:
    """What sort of class a label names: one character, the character before, or a context."""
    if label.startswith("after "):
        return "the character before"
    return "one character" if label[0] in "'\"" else label


def kinds_found(n: dict[str, Any], pure: float) -> dict[str, dict[str, Any]]:
    """For each kind of class, the latents about one class of it (share >= `pure`) and the
    one of them that fires most often (a rare latent is pure too easily): {kind: {latents,
    label, share, density, base rate}}."""
    found: dict[str, dict[str, Any]] = {}
    for label, share, density in zip(n["label"], n["share"], n["density"], strict=True):
        if share < pure:
            continue
        entry = found.setdefault(kind_of(label), {"latents": 0, "density": -1.0})
        entry["latents"] += 1
        if density > entry["density"]:
            entry.update(label=label, share=share, density=density,
                         base_rate=n["base_rate"][label])
    return found


# --- the experiment ----------------------------------------------------------------------------

def run(out_dir: Path, seed: int = 0, quick: bool = False,
        snapshots: int | None = None) -> ExperimentResult:
    """`snapshots`: also train a toy model of superposition keeping that many snapshots and
    read its features over time (experiments/feature_timeline.py)."""
    s = QUICK if quick else FeatureSettings()
    if snapshots is not None and snapshots < 3:  # before any training
        raise ConfigError(f"--snapshots must be at least 3 (the first step, the last and one "
                          f"between), got {snapshots}")
    with single_thread():
        toy = toy_superposition(s.toy, seed)
        text = char_features(s.char, seed)
        timeline = None if snapshots is None else over_time(snapshots, quick, seed)
    text["kinds"] = kinds_found(text, s.char.pure)
    numbers = {"toy": toy, "char": text}
    pictures = [save_figure(features_figure(numbers, s), out_dir / "features.png")]
    result = ExperimentResult(
        name="features",
        summary=f"a dictionary on {s.toy.n_features} planted features in {s.toy.width} "
                f"dimensions, then on a Tiny Shakespeare model's {s.char.hook}; seed {seed}",
        tables=[toy_table(toy, s.toy), char_table(text, s.char)], pictures=pictures,
        numbers=numbers, checks=expected_outcomes(numbers, s))
    if timeline is not None:
        from glassgpt.experiments import feature_timeline as ft
        settings, numbers["timeline"] = timeline
        result.tables.append(ft.timeline_table(numbers["timeline"], settings))
        result.pictures.append(save_figure(ft.timeline_figure(numbers["timeline"]),
                                           out_dir / "features_over_time.png"))
        result.checks.extend(ft.timeline_checks(numbers["timeline"]))
    return result


def over_time(snapshots: int, quick: bool, seed: int) -> tuple[Any, dict[str, Any]]:
    """The toy model of superposition trained with `snapshots` snapshots, read over time."""
    from glassgpt.experiments import feature_timeline as ft  # its own module: features' size

    base = ft.QUICK_TIMELINE if quick else ft.TimelineToySettings()
    settings = replace(base, snapshots=snapshots)
    return settings, ft.feature_timeline(settings, seed)


def toy_table(toy: dict[str, Any], s: ToySettings) -> Table:
    table = Table(f"{s.n_features} true features in {s.width} dimensions, each on with "
                  f"probability {s.firing:g} (about {toy['expected_on']:.1f} at a time); a "
                  f"standard dictionary of {s.d_sae} latents, {s.tokens:,} activations: each "
                  f"true feature's best |cosine| with a decoder row",
                  ["dictionary", "mean max cosine", "lowest", f"features >= {RECOVERED}"],
                  formats={"mean max cosine": ".3f", "lowest": ".3f"})
    for name, key in (("trained", "max_cosine"), ("random (chance)", "random_max_cosine")):
        cosines = toy[key]
        table.add_row(name, sum(cosines) / len(cosines), min(cosines),
                      f"{sum(c >= RECOVERED for c in cosines)} / {len(cosines)}")
    return table


def char_table(text: dict[str, Any], s: CharSettings) -> Table:
    table = Table(f"a TopK dictionary (k = {s.k}, {s.d_sae} latents, {s.tokens:,} activations) "
                  f"on {s.hook} of a {s.lm.n_layer}-layer character model ({s.lm.steps} steps, "
                  f"val loss {text['val_loss']:.2f}); on {s.windows} held-out windows, the "
                  f"latents with >= {s.pure:.0%} of their activation mass on one class, by kind",
                  ["kind of class", "latents", "most frequent", "its share", "class base rate",
                   "latent fires on"],
                  formats={"its share": ".1%", "class base rate": ".1%",
                           "latent fires on": ".1%"})
    for kind, entry in sorted(text["kinds"].items(), key=lambda item: -item[1]["latents"]):
        table.add_row(kind, entry["latents"], entry["label"], entry["share"],
                      entry["base_rate"], entry["density"])
    return table


def expected_outcomes(numbers: dict[str, Any], s: FeatureSettings) -> list[Check]:
    toy, text = numbers["toy"], numbers["char"]
    n_coordinates = 2 * s.char.lm.n_embd
    pure_share = text["pure"] / max(text["alive"], 1)
    coordinate_share = text["pure_coordinates"] / n_coordinates
    found = ", ".join(f"{kind} {entry['latents']}" for kind, entry in text["kinds"].items())
    return [
        Check(f"the dictionary recovers the planted features: mean max cosine "
              f"{toy['mean_max_cosine']:.3f} >= {RECOVERED} ({toy['recovered']} of "
              f"{s.toy.n_features} at >= {RECOVERED})",
              toy["mean_max_cosine"] >= RECOVERED),
        Check(f"a random dictionary of the same size does not (chance: "
              f"{toy['random_mean_max_cosine']:.3f} < 0.7)",
              toy["random_mean_max_cosine"] < 0.7),
        Check(f"on the character model, {text['pure']} of {text['alive']} living latents "
              f"({pure_share:.0%}) put >= {s.char.pure:.0%} of their mass on one class, "
              f"at least twice the residual stream's coordinates ({text['pure_coordinates']} "
              f"of {n_coordinates}, {coordinate_share:.0%})",
              pure_share >= 0.3 and pure_share >= 2 * coordinate_share),
        Check(f"some latent is about each of: {', '.join(s.char.kinds)} (latents by kind: "
              f"{found})", all(kind in text["kinds"] for kind in s.char.kinds)),
    ]


def features_figure(numbers: dict[str, Any], s: FeatureSettings) -> Figure:
    toy, text = numbers["toy"], numbers["char"]
    fig = new_figure(13.0, 3.8)
    matrix_ax, cosine_ax, share_ax = fig.subplots(1, 3)
    image = matrix_ax.imshow(np.array(toy["matched"]), cmap="viridis", vmin=0.0, vmax=1.0)
    label_axes(matrix_ax, xlabel="the latent that matches it best",
               ylabel="true feature (best recovered first)",
               title="|cosine|, true features x latents")
    labelled_colorbar(fig, image, matrix_ax, "|cosine|", shrink=0.9)
    bins = np.linspace(0.0, 1.0, 41)
    cosine_ax.hist(toy["random_max_cosine"], bins=bins, color="C7", alpha=0.8,
                   label="random dictionary")
    cosine_ax.hist(toy["max_cosine"], bins=bins, color="C0", alpha=0.8,
                   label="trained dictionary")
    cosine_ax.axvline(RECOVERED, color="black", linestyle="--", linewidth=1)
    label_axes(cosine_ax, xlabel="best |cosine| of a true feature", ylabel="true features",
               title=f"{s.toy.n_features} features in {s.toy.width} dimensions")
    cosine_ax.legend(fontsize=LABEL_PT, loc="upper left")
    share_bins = np.linspace(0.0, 1.0, 21)
    share_ax.hist(text["coordinate_share"], bins=share_bins, color="C7", alpha=0.8,
                  density=True, label="residual coordinates")
    share_ax.hist(text["share"], bins=share_bins, color="C1", alpha=0.8, density=True,
                  label="dictionary latents")
    share_ax.axvline(s.char.pure, color="black", linestyle="--", linewidth=1)
    label_axes(share_ax, xlabel="share of activation mass on its best class",
               ylabel="density", title=f"Tiny Shakespeare, {s.char.hook}")
    share_ax.legend(fontsize=LABEL_PT, loc="upper left")
    return fig
