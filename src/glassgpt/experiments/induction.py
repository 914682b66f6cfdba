"""Induction heads: the phase change of a 2-layer attention-only model, and the 1-layer control.

Each training sequence of T tokens is a random prefix, then n random tokens, then those n again
(n drawn per sequence, so the repeat starts at no fixed offset). Inside the repeat the next token
is predictable: it is the token that followed the current one the first time round. Finding it
takes two steps, which is why one layer cannot: a previous-token head writes "the token before
me" into every position, and an induction head in the next layer matches the current token
against that, attending to the token after the earlier copy and copying it. The loss on the
repeated part falls abruptly when the induction heads form (Olsson et al. 2022, "In-context
learning and induction heads"), the heads' induction scores (glassgpt.interp.methods.scores)
rise in the same steps, and a 1-layer model, trained alike, shows neither. Both keep weight
snapshots at log-spaced steps as they train (glassgpt.rundir.snapshots), and each is read through
its snapshots by glassgpt.interp.timeline (the loss, every head's induction score, the ICL score
and the LLC, on one time axis: induction_timeline.png). Then a character model of
`cpu-small`'s shape trained on Tiny Shakespeare is scored the same way while it trains (after
2000 steps none of its heads is an induction head yet: measured, so claimed).
Notation: B = batch, T = positions, L = layers, H = heads, V = vocabulary.
"""

from __future__ import annotations

import math
import shutil
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.experiments.charlm import CharLMSettings, model_config, train_char_lm
from glassgpt.experiments.results import Check, ExperimentResult, Table, step_taken
from glassgpt.experiments.tasks import single_thread
from glassgpt.figures import LABEL_PT, label_axes, new_figure, save_figure
from glassgpt.interp.methods.scores import head_scores
from glassgpt.interp.timeline.llc import LLCSettings
from glassgpt.interp.timeline.settings import TimelineSettings
from glassgpt.interp.timeline.timeline import PHASE_CHANGE_MIN, run_timeline, write_timeline
from glassgpt.model import GPT, eval_mode
from glassgpt.rundir.checkpoint import save_model
from glassgpt.rundir.snapshots import SnapshotWriter
from glassgpt.storage.commit import staged_directory
from glassgpt.tokenizers import CharTokenizer

LAYERS = {2: "2 layers", 1: "1 layer (control)"}  # n_layer -> name, in the order trained
EVAL_SEED = 123_456  # the fixed batch the repeated-part loss is measured on
DATA_SEED_OFFSET = 10_000  # training batches come from seed + this, the weights from seed
SCORE_SEED = 7  # the repeated random tokens the induction scores are read on
CPU_SMALL = (4, 128, 64)  # the cpu-small preset's layers, width and context
RUN_NAME = "induction_run"  # the 2-layer model's run directory, under the pictures' folder
# The LLC at each snapshot: devinterp's estimator (glassgpt.interp.timeline.llc) on the
# evaluation's sequences, with fewer chains and draws than its defaults (a demo's minute).
DEMO_LLC = LLCSettings(num_chains=2, num_draws=40, batch_size=16, num_init_loss_batches=4)
DROP_FROM, DROP_TO = 0.1, 0.9  # the loss drop: from 10% of the way down to 90%
# The 64 random tokens written as characters, so that `view` and `sample` take typed prompts
# (any text of these, repeated, shows the induction heads at work; a space is one of them).
RUN_ALPHABET = string.ascii_lowercase + string.ascii_uppercase + string.digits + " ."


@dataclass(frozen=True)
class InductionSettings:
    vocab_size: int = 64  # random tokens
    half: int = 16  # T = 2 * half: the longest repeat
    shortest_repeat: int = 8  # n is drawn in [shortest_repeat, half] for every sequence
    n_embd: int = 64
    n_head: int = 4
    batch_size: int = 64
    steps: int = 1000
    lr: float = 3e-3
    qk_init_std: float = 0.125  # 1/sqrt(n_embd); see model_of
    eval_every: int = 25  # steps between readings of the loss and the scores
    eval_sequences: int = 64
    score_batch: int = 8
    tolerance: int = 50  # steps the loss drop and the score rise may lie apart
    shakespeare: CharLMSettings = CharLMSettings(n_layer=4, n_head=4, n_embd=128, block_size=64,
                                                 batch_size=12, steps=2000, eval_every=250,
                                                 eval_windows=32)
    shakespeare_score_every: int = 250
    snapshots: int = 24  # weight snapshots at log-spaced steps, read by the timeline
    llc: bool = True  # estimate the LLC at each snapshot (DEMO_LLC)


# The quick size reads no LLC: 16 snapshots of SGLD cost 12 s of CPU a model, more than the
# rest of the timeline (1 s) and the quick test's budget; the full demo estimates it.
QUICK = InductionSettings(steps=400, eval_every=20, tolerance=40, snapshots=16, llc=False,
                          shakespeare=CharLMSettings(n_layer=2, n_head=4, n_embd=64,
                                                     block_size=32, steps=100, eval_every=50,
                                                     eval_windows=16),
                          shakespeare_score_every=50)


def repeat_batch(batch_size: int, half: int, shortest: int, vocab_size: int,
                 generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Sequences (B, T = 2 * half) and the targets that are predictable (B, T), a bool mask.

    Row b: T - 2n random tokens, n random tokens, the same n again, n in [shortest, half].
    Position t of the repeat holds the token of t - n; it can be predicted from t - 1 (the
    token after the earlier copy of token t - 1) for t in p + n + 1 .. T - 1, p = T - 2n.
    """
    T = 2 * half
    tokens = torch.randint(vocab_size, (batch_size, T), generator=generator)  # (B, T)
    n = torch.randint(shortest, half + 1, (batch_size, 1), generator=generator)  # (B, 1)
    t = torch.arange(T)[None, :]  # (1, T)
    repeat_start = T - n  # (B, 1): p + n
    source = torch.where(t >= repeat_start, t - n, t)  # (B, T): where each token is copied from
    return tokens.gather(1, source), t > repeat_start  # (B, T), (B, T)


def model_of(n_layer: int, s: InductionSettings, seed: int) -> GPT:
    """An attention-only model (`attn_only`: blocks without their MLP, so each layer's only
    way to move information is attention) with rotary positions, its query and key
    projections drawn at std `s.qk_init_std`.

    GPT-2's std of 0.02 makes every q . k nearly 0, so every pattern starts uniform and the
    plateau before the phase change is long and varies with the seed (400 to 800 steps for
    seeds 0, 1, 2 at the full size); at ~1/sqrt(C) it ended at 250 to 300 steps for each."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=s.vocab_size, block_size=2 * s.half, n_layer=n_layer,
                          n_head=s.n_head, n_embd=s.n_embd, dropout=0.0, position="rope",
                          attn_only=True))
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            qk_rows = attn.qkv.out_features - attn.n_kv_head * attn.head_dim  # q, k, then v
            attn.qkv.weight[:qk_rows].normal_(0.0, s.qk_init_std)
    return model


@torch.no_grad()
def repeated_loss(model: GPT, tokens: Tensor, predictable: Tensor) -> float:
    """Mean next-token loss over the predictable targets of the repeated part only."""
    with eval_mode(model):
        logits, _ = model(tokens[:, :-1])  # (B, T - 1, V)
    wanted = predictable[:, 1:]  # (B, T - 1): the target of input position t is token t + 1
    return F.cross_entropy(logits[wanted], tokens[:, 1:][wanted]).item()


def induction_scores(model: GPT, half: int, batch: int) -> Tensor:
    """Every head's induction score (L, H) on a repeated random sequence of 2 * half tokens."""
    return head_scores(model, half=half, batch=batch, seed=SCORE_SEED).induction


def train_repeats(n_layer: int, s: InductionSettings, seed: int,
                  snapshots: SnapshotWriter | None = None) -> tuple[dict[str, Any], GPT]:
    """Train one attention-only model; every `eval_every` steps read its repeated-part loss
    and each head's induction score, and keep the weights at the `snapshots`' steps. Returns
    the readings and the trained model."""
    model = model_of(n_layer, s, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    data = torch.Generator().manual_seed(seed + DATA_SEED_OFFSET)
    eval_tokens, predictable = repeat_batch(s.eval_sequences, s.half, s.shortest_repeat,
                                            s.vocab_size, torch.Generator().manual_seed(EVAL_SEED))
    steps, losses, scores = [], [], []
    for step in range(s.steps + 1):
        if snapshots is not None and snapshots.due(step):
            snapshots.save(model, step)
        if step % s.eval_every == 0 or step == s.steps:
            steps.append(step)
            losses.append(repeated_loss(model, eval_tokens, predictable))
            scores.append(induction_scores(model, s.half, s.score_batch).tolist())
        if step == s.steps:
            break
        tokens, _ = repeat_batch(s.batch_size, s.half, s.shortest_repeat, s.vocab_size, data)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step_taken()
    best = [max(max(layer) for layer in at_step) for at_step in scores]
    return {"steps": steps, "repeated_loss": losses, "scores": scores, "best_score": best,
            "final_loss": losses[-1], "final_best_score": best[-1],
            "loss_drop_step": crossing_step(steps, losses),
            "score_rise_step": crossing_step(steps, best)}, model


def trained_run(n_layer: int, s: InductionSettings, seed: int, run_dir: Path
                ) -> dict[str, Any]:
    """Train one model into `run_dir` (new, or an empty directory) as a run that `glassgpt
    sample`, `view`, `timeline` and `convert --to-hf` open: its snapshots kept as it trains,
    its final weights, and its timeline read through the snapshots (timeline.json). It appears
    whole or not at all. Returns the readings, the timeline's summary under "timeline"."""
    with staged_directory(run_dir) as staging:
        writer = SnapshotWriter(staging, s.snapshots, s.steps)
        numbers, model = train_repeats(n_layer, s, seed, writer)
        writer.finish()
        save_run(staging, model, seed)
        numbers["timeline"] = snapshot_timeline(staging, run_dir, s)
    return numbers


def save_run(directory: Path, model: GPT, seed: int) -> None:
    """`model` as a run in `directory`, its random tokens named by RUN_ALPHABET's characters."""
    tokenizer = CharTokenizer.from_text(RUN_ALPHABET)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ConfigError(f"the run's {tokenizer.vocab_size} characters cannot name "
                          f"{model.config.vocab_size} random tokens")
    save_model(directory, model, tokenizer, extra={"experiment": "induction", "seed": seed})


def snapshot_timeline(staging: Path, run_dir: Path, s: InductionSettings) -> dict[str, Any]:
    """The run read through its snapshots (glassgpt.interp.timeline) on the evaluation's
    sequences, its ICL score at the last token (always inside the repeat) minus Olsson's early
    one; timeline.json written into the run. Returns the curves the picture and the checks
    read, and the loss drop's steps (DROP_FROM to DROP_TO of the way down)."""
    tokens, _ = repeat_batch(s.eval_sequences, s.half, s.shortest_repeat, s.vocab_size,
                             torch.Generator().manual_seed(EVAL_SEED))  # (N, T): T - 1 predicted
    settings = TimelineSettings(seed=SCORE_SEED, score_batch=s.score_batch, icl_late=1.0,
                                llc=s.llc, llc_settings=DEMO_LLC)
    timeline = run_timeline(staging, settings, data={"repeats": tokens})
    timeline.run_dir = str(run_dir)  # where it will be, once the staging directory is moved
    write_timeline(timeline, directory=staging)
    steps, loss = timeline.steps, timeline.series("repeats_loss")
    llc = timeline.series("llc") if s.llc else []
    return {"steps": steps, "loss": loss, "icl_score": timeline.series("icl_score"),
            "best_induction": timeline.best_induction(), "phase_change": timeline.phase_change(),
            "icl": timeline.icl["definition"], "loss_drop": loss_drop(steps, loss),
            "llc_mean": [e["llc_mean"] for e in llc], "llc_std": [e["llc_std"] for e in llc]}


def loss_drop(steps: list[int], loss: list[float]) -> list[int] | None:
    """[first step DROP_FROM of the way from the first loss to the lowest, first step
    DROP_TO of the way]: the steps where the loss drops (None when it fell less than 0.1)."""
    start, low = loss[0], min(loss)
    if start - low < 0.1:
        return None
    return [next(step for step, value in zip(steps, loss, strict=True)
                 if start - value >= share * (start - low)) for share in (DROP_FROM, DROP_TO)]


def crossing_step(steps: list[int], values: list[float]) -> int | None:
    """The first step where `values` has gone half the way from its first value to its last
    (None for a curve that moved less than 0.1: nothing happened)."""
    start, end = values[0], values[-1]
    if abs(end - start) < 0.1:
        return None
    middle = (start + end) / 2
    for step, value in zip(steps, values, strict=True):
        if (value - middle) * (end - start) >= 0:
            return step
    return steps[-1]


def train_shakespeare(s: InductionSettings, seed: int) -> dict[str, Any]:
    """A character model of `s.shakespeare`'s shape on Tiny Shakespeare, its heads' induction
    scores read every `shakespeare_score_every` steps."""
    lm = s.shakespeare
    half = lm.block_size // 2
    steps, scores = [], []

    def read_scores(step: int, model: GPT) -> None:
        if step % s.shakespeare_score_every == 0 or step == lm.steps:
            steps.append(step)
            scores.append(induction_scores(model, half, s.score_batch).tolist())

    trained = train_char_lm(model_config(lm), lm, seed, after_step=read_scores)
    final = torch.tensor(scores[-1])  # (L, H)
    layer, head = divmod(int(final.argmax()), final.shape[1])
    return {"steps": steps, "scores": scores, "val_loss": trained.final_val,
            "best_layer": layer, "best_head": head, "best_score": float(final.max()),
            "best_in_layer_0": float(final[0].max()), "n_layer": lm.n_layer}


def run(out_dir: Path, seed: int = 0, quick: bool = False) -> ExperimentResult:
    s = QUICK if quick else InductionSettings()
    numbers: dict[str, Any] = {}
    with single_thread():
        for n_layer, name in LAYERS.items():
            # the control's run is read and dropped: only the 2-layer run is kept
            run_dir = out_dir / (RUN_NAME if n_layer == 2 else f".{RUN_NAME}_control")
            numbers[name] = trained_run(n_layer, s, seed, run_dir)
            if n_layer == 2:
                numbers["run"] = str(run_dir)
            else:
                shutil.rmtree(run_dir)
        numbers["shakespeare"] = train_shakespeare(s, seed)
    numbers["chance_loss"] = math.log(s.vocab_size)
    numbers["tolerance"] = s.tolerance
    pictures = [save_figure(induction_figure(numbers), out_dir / "induction.png"),
                save_figure(induction_timeline_figure(numbers), out_dir / "induction_timeline.png")]
    return ExperimentResult(
        name="induction",
        summary=f"attention-only models on repeated random tokens ({s.steps} steps), then a "
                f"{s.shakespeare.n_layer}-layer Tiny Shakespeare model; seed {seed}",
        tables=[repeats_table(numbers, s), shakespeare_table(numbers["shakespeare"], s)],
        pictures=pictures, numbers=numbers, checks=expected_outcomes(numbers))


def repeats_table(numbers: dict[str, Any], s: InductionSettings) -> Table:
    table = Table(f"attention-only, width {s.n_embd}, {s.n_head} heads, rotary positions, "
                  f"{s.steps} AdamW steps (lr {s.lr:g}) on {s.vocab_size} random tokens whose "
                  f"last n in [{s.shortest_repeat}, {s.half}] repeat the n before; loss on the "
                  f"predictable repeated tokens (chance ln {s.vocab_size} = "
                  f"{numbers['chance_loss']:.2f})",
                  ["model", "loss at start", "loss at end", "best induction score",
                   "loss drops at step", "score rises at step"],
                  formats={"loss at start": ".2f", "loss at end": ".2f",
                           "best induction score": ".2f"})
    for name in LAYERS.values():
        n = numbers[name]
        table.add_row(name, n["repeated_loss"][0], n["final_loss"], n["final_best_score"],
                      n["loss_drop_step"], n["score_rise_step"])
    return table


def shakespeare_table(n: dict[str, Any], s: InductionSettings) -> Table:
    lm = s.shakespeare
    shape = " (cpu-small's shape)" if (lm.n_layer, lm.n_embd, lm.block_size) == CPU_SMALL else ""
    table = Table(f"{lm.n_layer} layers, {lm.n_head} heads, width {lm.n_embd}{shape}, "
                  f"{lm.steps} AdamW steps on Tiny Shakespeare (val loss "
                  f"{n['val_loss']:.3f}): each head's induction score at the end",
                  ["layer", *[f"head {h}" for h in range(lm.n_head)]],
                  formats={f"head {h}": ".2f" for h in range(lm.n_head)})
    for layer, row in enumerate(n["scores"][-1]):
        table.add_row(layer, *row)
    return table


def expected_outcomes(numbers: dict[str, Any]) -> list[Check]:
    two, one = numbers[LAYERS[2]], numbers[LAYERS[1]]
    drop, rise, tolerance = two["loss_drop_step"], two["score_rise_step"], numbers["tolerance"]
    together = drop is not None and rise is not None and abs(drop - rise) <= tolerance
    checks = [
        Check(f"2 layers learn the repeated part and 1 layer cannot (loss {two['final_loss']:.2f} "
              f"< half of {one['final_loss']:.2f})", two["final_loss"] < one["final_loss"] / 2),
        Check(f"the 2-layer model grows an induction head (best score {two['final_best_score']:.2f}"
              f" > 0.5) and the 1-layer model none ({one['final_best_score']:.2f} < 0.3)",
              two["final_best_score"] > 0.5 and one["final_best_score"] < 0.3),
        Check(f"the loss drops and the induction score rises together (steps {drop} and {rise}, "
              f"within {tolerance})", together),
    ]
    return checks + timeline_outcomes(two["timeline"], one["timeline"]) + \
        shakespeare_outcomes(numbers["shakespeare"])


def timeline_outcomes(two: dict[str, Any], one: dict[str, Any]) -> list[Check]:
    """Read through the snapshots: the 2-layer model's best induction score is half way up
    inside the steps where its loss drops; the control's never moves by PHASE_CHANGE_MIN, and
    stays below the 0.3 the final-weights check holds it to."""
    drop, phase = two["loss_drop"], two["phase_change"]
    inside = drop is not None and phase is not None and drop[0] <= phase <= drop[1]
    rise = max(one["best_induction"]) - one["best_induction"][0]
    return [
        Check(f"through the snapshots, the 2-layer model's induction score rises (half way up at "
              f"step {phase}) within the steps where its loss drops ({drop})", inside),
        Check(f"the 1-layer control's induction score never rises (by {rise:.2f} at most, < "
              f"{PHASE_CHANGE_MIN}: no phase change; at most {max(one['best_induction']):.2f} "
              f"< 0.3)", one["phase_change"] is None and max(one["best_induction"]) < 0.3),
    ]


def induction_timeline_figure(numbers: dict[str, Any]) -> Figure:
    """Each model read through its snapshots, on one (log-spaced) time axis: the loss and the
    best head's induction score, the phase change and the loss drop marked; below, the LLC
    (or, without it, the ICL score). The two models share each row's scale, so the control's
    small drop (it learns that a token seen before is likelier) reads as small."""
    fig = new_figure(11.0, 6.4)
    grid = fig.subplots(2, 2, sharex="col", sharey="row")  # one scale for both models
    for column, name in enumerate(LAYERS.values()):
        tl = numbers[name]["timeline"]
        top, bottom = grid[0][column], grid[1][column]
        top.plot(tl["steps"], tl["loss"], color="C0", marker="o", markersize=3)
        label_axes(top, ylabel="loss (nats)", title=f"{name}: loss and induction score")
        score = top.twinx()
        score.plot(tl["steps"], tl["best_induction"], color="C1", marker="s", markersize=3)
        score.set_ylim(0.0, 1.0)
        score.set_ylabel("best head's induction score", color="C1", fontsize=LABEL_PT)
        if tl["loss_drop"] is not None:
            top.axvspan(*tl["loss_drop"], color="C0", alpha=0.12, label="the loss drops")
        if tl["phase_change"] is not None:
            top.axvline(tl["phase_change"], color="C1", linestyle="--", linewidth=1,
                        label=f"phase change (step {tl['phase_change']})")
        if tl["loss_drop"] is not None or tl["phase_change"] is not None:
            top.legend(fontsize=LABEL_PT, loc="center left")
        if tl["llc_mean"]:
            bottom.errorbar(tl["steps"], tl["llc_mean"], yerr=tl["llc_std"], color="C4",
                            marker="o", markersize=3, capsize=2)
            label_axes(bottom, xlabel="training step (snapshots, log-spaced)",
                       ylabel="LLC estimate", title="local learning coefficient (SGLD)")
        else:
            bottom.plot(tl["steps"], tl["icl_score"], color="C3", marker="o", markersize=3)
            label_axes(bottom, xlabel="training step (snapshots, log-spaced)",
                       ylabel="ICL score (nats)", title="in-context learning score")
        for ax in (top, bottom):
            ax.set_xscale("symlog", linthresh=10)
    return fig


def shakespeare_outcomes(text: dict[str, Any]) -> list[Check]:
    """What the character model shows, measured rather than assumed: at this size and length of
    training (2000 steps, val ~1.73) none of its heads is an induction head yet."""
    return [Check(f"on Tiny Shakespeare no head of the {text['n_layer']}-layer character model "
                  f"is an induction head yet: every score stays at chance (best "
                  f"{text['best_score']:.2f}, layer {text['best_layer']} head "
                  f"{text['best_head']}, < 0.1)", text["best_score"] < 0.1)]


def induction_figure(numbers: dict[str, Any]) -> Figure:
    fig = new_figure(13.0, 3.6)
    loss_ax, score_ax, text_ax = fig.subplots(1, 3)
    for i, name in enumerate(LAYERS.values()):
        n = numbers[name]
        loss_ax.plot(n["steps"], n["repeated_loss"], color=f"C{i}", label=name)
        per_head = torch.tensor(n["scores"])  # (steps, L, H)
        for layer in range(per_head.shape[1]):
            for head in range(per_head.shape[2]):
                score_ax.plot(n["steps"], per_head[:, layer, head].tolist(), color=f"C{i}",
                              linewidth=1.0, linestyle="-" if layer else ":",
                              label=f"{name}: layer {layer} heads" if head == 0 else None)
    loss_ax.axhline(numbers["chance_loss"], color="gray", linestyle="--", linewidth=1,
                    label="chance")
    label_axes(loss_ax, xlabel="training step", ylabel="loss on the repeated part",
               title="the phase change")
    loss_ax.legend(fontsize=LABEL_PT)
    score_ax.set_ylim(0.0, 1.0)  # both score panels on the scale a score lives on
    label_axes(score_ax, xlabel="training step", ylabel="induction score",
               title="every head's induction score")
    score_ax.legend(fontsize=LABEL_PT, loc="center right")  # above the control, below layer 1
    text = numbers["shakespeare"]
    per_head = torch.tensor(text["scores"])  # (steps, L, H)
    for layer in range(per_head.shape[1]):
        text_ax.plot(text["steps"], per_head[:, layer].max(dim=1).values.tolist(), marker="o",
                     markersize=3, label=f"layer {layer}")
    text_ax.set_ylim(0.0, 1.0)
    label_axes(text_ax, xlabel="training step", ylabel="best induction score in the layer",
               title="Tiny Shakespeare characters")
    text_ax.legend(fontsize=LABEL_PT)
    return fig
