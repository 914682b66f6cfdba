"""A run's timeline: what its weights show at each snapshot (`glassgpt train --snapshots N`),
on one time axis. `run_timeline(run_dir, settings)` opens every snapshot as the checkpoint
`step:N` and reads, per step:

- the loss on the train and val splits: the mean next-token loss over the same `sequences`
  windows of each split at every step (windows of the run's data directory, drawn once with
  `seed`; or the windows a caller passes, `data=`);
- the in-context learning score of Olsson et al. (2022): the loss at a late token index minus
  the loss at an early one, averaged over the windows. They took the 500th and the 50th token
  of a 1,024-token context; here the indices are those fractions of the run's context T,
  `round(T * 500 / 1024)` and `round(T * 50 / 1024)` (at least 1, at most T; token index
  k is the loss of predicting token k from the k before it), or other fractions asked for
  (`icl_late`, `icl_early`). The JSON says which indices were used, and why;
- every head's previous-token, duplicate-token and induction score
  (glassgpt.interp.methods.scores, under the named `definition`), on the same repeated random
  tokens at every step;
- the direct logit attribution of a probe prompt's answer by head
  (glassgpt.interp.methods.attribution): by default a random half of `probe_half` tokens
  written twice, less its last token, whose answer is that token (what an induction head
  predicts); or `probe`, a text whose last token is the answer;
- with `llc`, the local learning coefficient by SGLD (glassgpt.interp.timeline.llc), on the
  first `llc_settings.batch_size * num_init_loss_batches` windows of the last split, with its
  settings and chains.

The phase change is the first snapshot where the best head's induction score (the largest over
the heads) has gone half the way from its value at the first snapshot to its largest value
(`halfway_step`); none when it never moved by PHASE_CHANGE_MIN.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from glassgpt.data import PreparedData
from glassgpt.errors import CheckpointError, InputError
from glassgpt.figures import save_figure
from glassgpt.interp.methods.attribution import logit_attribution
from glassgpt.interp.methods.scores import DEFINITIONS, head_scores
from glassgpt.interp.timeline.figure import timeline_figure
from glassgpt.interp.timeline.llc import LLCSettings, estimate_llc
from glassgpt.interp.timeline.settings import OLSSON_CONTEXT, TimelineSettings
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import Run
from glassgpt.rundir.snapshots import list_snapshots
from glassgpt.storage import files
from glassgpt.storage.layout import SNAPSHOT_PREFIX, TIMELINE_FILE, TIMELINE_PLOT_FILE

TIMELINE_FORMAT = "glassgpt-timeline/1"
# An induction score that moves less than this: no phase change. A 1-layer model, which cannot
# build an induction head, moved its best by up to 0.09 in the induction demo (chance: ~0.05).
PHASE_CHANGE_MIN = 0.2
SCORE_KINDS = ("previous_token", "duplicate_token", "induction")
Progress = Callable[[int, int], Any]  # (snapshots done, snapshots in all)


@dataclass
class Timeline:
    """What `run_timeline` read: one record a snapshot, in step order."""

    run_dir: str
    steps: list[int]
    records: list[dict[str, Any]]
    icl: dict[str, Any]  # the indices used and why
    probe: dict[str, Any]  # the prompt's tokens and its answer
    settings: TimelineSettings
    splits: list[str]

    def series(self, name: str) -> list[Any]:
        return [record.get(name) for record in self.records]

    def best_induction(self) -> list[float]:
        """The largest induction score over every head, at each step."""
        return [max(max(row) for row in record["scores"]["induction"])
                for record in self.records]

    def phase_change(self) -> int | None:
        return halfway_step(self.steps, self.best_induction())

    def to_json(self) -> dict[str, Any]:
        return {"format": TIMELINE_FORMAT, "run_dir": self.run_dir, "steps": self.steps,
                "splits": self.splits, "icl": self.icl, "probe": self.probe,
                "phase_change": {"step": self.phase_change(), "definition": PHASE_DEFINITION},
                "settings": settings_json(self.settings), "snapshots": self.records}


PHASE_DEFINITION = ("the first snapshot where the best head's induction score has gone half "
                    "the way from its value at the first snapshot to its largest; none when it "
                    f"moved less than {PHASE_CHANGE_MIN}")


def settings_json(settings: TimelineSettings) -> dict[str, Any]:
    values = dataclasses.asdict(settings)
    if settings.llc:  # the LLC's own settings are in each estimate, nbeta resolved
        values["llc_settings"] = dataclasses.asdict(settings.llc_settings or LLCSettings())
    return values


def halfway_step(steps: list[int], values: list[float]) -> int | None:
    """The first step whose value has gone half the way from the first value to the largest
    (None when the largest is less than PHASE_CHANGE_MIN above the first)."""
    if not values or max(values) - values[0] < PHASE_CHANGE_MIN:
        return None
    middle = (values[0] + max(values)) / 2
    return next(step for step, value in zip(steps, values, strict=True) if value >= middle)


# --- the whole run ----------------------------------------------------------------------------

def run_timeline(run_dir: str | Path, settings: TimelineSettings | None = None,
                 data: dict[str, Tensor] | str | Path | None = None, device: str = "cpu",
                 progress: Progress | None = None) -> Timeline:
    """Every snapshot of the run read as the module's docstring says. `data`: split name ->
    token windows (N, T + 1), T at most the context, or a prepared data directory to draw
    `settings.sequences` windows of each split from (default: the run's own data directory).
    `progress(done, total)` after each snapshot."""
    settings = settings or TimelineSettings()
    if settings.definition not in DEFINITIONS:
        raise InputError(f"definition must be one of {', '.join(DEFINITIONS)}, got "
                         f"{settings.definition!r:.40}")
    run = Run(run_dir)
    steps = list_snapshots(run.dir)
    if not steps:
        raise CheckpointError(f"{run.dir} keeps no snapshots; train it with --snapshots N")
    windows = data if isinstance(data, dict) else data_windows(run, settings, data)
    context = check_windows(windows, run.model_config.block_size)
    icl = icl_indices(context, settings)
    probe_ids, answer = probe_prompt(run, settings)
    records = []
    for done, step in enumerate(steps, start=1):
        model, _ = run.load_model(device, checkpoint=f"{SNAPSHOT_PREFIX}{step}")
        records.append(read_snapshot(model, step, windows, icl, (probe_ids, answer), settings))
        if progress is not None:
            progress(done, len(steps))
    probe = {"tokens": probe_ids[0].tolist(), "answer": answer,
             "text": settings.probe, "default": settings.probe is None}
    return Timeline(str(run.dir), steps, records, icl, probe, settings, list(windows))


def read_snapshot(model: GPT, step: int, windows: dict[str, Tensor], icl: dict[str, Any],
                  probe: tuple[Tensor, int], settings: TimelineSettings) -> dict[str, Any]:
    record: dict[str, Any] = {"step": step}
    last_losses = None
    for split, split_windows in windows.items():
        last_losses = position_losses(model, split_windows)  # (T,)
        record[f"{split}_loss"] = float(last_losses.mean())
    assert last_losses is not None
    late, early = last_losses[icl["late_index"] - 1], last_losses[icl["early_index"] - 1]
    record["icl_score"] = float(late - early)
    scores = head_scores(model, half=settings.score_half, batch=settings.score_batch,
                         seed=settings.seed, definition=settings.definition)
    record["scores"] = {kind: getattr(scores, kind).tolist() for kind in SCORE_KINDS}
    record["attribution"] = probe_attribution(model, *probe)
    if settings.llc:
        sequences = list(windows.values())[-1]
        llc_settings = settings.llc_settings or LLCSettings()
        record["llc"] = estimate_llc(model, sequences, llc_settings).to_json()
    return record


def probe_attribution(model: GPT, probe_ids: Tensor, answer: int) -> dict[str, Any]:
    """Each head's direct push on the probe's answer (L, H), the MLPs' (L,) and the logit;
    a model that is no sum of parts (Post-LN) says why it has none."""
    try:
        found = logit_attribution(model, probe_ids.to(model.lm_head.weight.device), answer)
    except InputError as error:
        return {"unavailable": str(error)}
    return {"heads": found.heads.tolist(), "mlps": found.mlps.tolist(), "logit": found.logit}


@torch.no_grad()
def position_losses(model: GPT, windows: Tensor, batch: int = 32) -> Tensor:
    """windows (N, T + 1) -> (T,): the mean loss of predicting token k + 1 at each k."""
    device = model.lm_head.weight.device
    total = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    for start in range(0, len(windows), batch):
        chunk = windows[start:start + batch].to(device)
        logits, _ = model(chunk[:, :-1])  # (b, T, V)
        losses = F.cross_entropy(logits.float().transpose(1, 2), chunk[:, 1:],
                                 reduction="none")  # (b, T)
        total += losses.double().sum(0).cpu()
    return total / len(windows)


def icl_indices(context: int, settings: TimelineSettings) -> dict[str, Any]:
    """The token indices of the ICL score in a context of `context` tokens, and what they
    adapt (index k: the loss of predicting token k from the k before it, 1 <= k <= T)."""
    def index(fraction: float) -> int:
        return min(context, max(1, round(fraction * context)))
    late, early = index(settings.icl_late), index(settings.icl_early)
    if late <= early:
        raise InputError(f"a context of {context} tokens leaves no room between the ICL "
                         f"score's early and late token (indices {early} and {late})")
    return {"late_index": late, "early_index": early, "context": context,
            "definition": f"loss at token index {late} minus loss at token index {early} "
                          f"(token k predicted from the k before it), averaged over the "
                          f"windows: Olsson et al. 2022's 500th minus 50th token of "
                          f"{OLSSON_CONTEXT}, as fractions {settings.icl_late:.4g} and "
                          f"{settings.icl_early:.4g} of this context of {context}"}


# --- the inputs -------------------------------------------------------------------------------

def data_windows(run: Run, settings: TimelineSettings, data_dir: str | Path | None = None
                 ) -> dict[str, Tensor]:
    """`settings.sequences` windows (N, T + 1) of each split of `data_dir` (default: the
    run's data directory), drawn once with `settings.seed`, T the run's context."""
    data_dir = data_dir if data_dir is not None else run.data_dir
    if data_dir is None:
        raise InputError(f"{run.dir} records no data directory: pass the data (--data)")
    data = PreparedData(data_dir)
    return sample_windows(data.splits, run.model_config.block_size, settings)


def sample_windows(splits: dict[str, np.ndarray], context: int,
                   settings: TimelineSettings) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(settings.seed)
    windows = {}
    for split, ids in splits.items():
        length = min(context + 1, len(ids))
        if length < 3:
            raise InputError(f"the {split} split holds {len(ids)} tokens, too few for a window")
        starts = torch.randint(len(ids) - length + 1, (settings.sequences,),
                               generator=generator).tolist()
        windows[split] = torch.stack([torch.from_numpy(np.asarray(ids[s:s + length],
                                                                  dtype=np.int64))
                                      for s in starts])  # (N, T + 1)
    return windows


def check_windows(windows: dict[str, Tensor], block_size: int) -> int:
    """The windows' T, after checking they are (N, T + 1) ids with 2 <= T <= block_size."""
    if not windows:
        raise InputError("data must name at least one split of token windows")
    shapes = {tuple(w.shape) if isinstance(w, Tensor) and not w.is_floating_point()
              and not w.is_complex() else None for w in windows.values()}
    shape = next(iter(shapes))
    if len(shapes) != 1 or shape is None or len(shape) != 2 or not 3 <= shape[1] <= block_size + 1:
        raise InputError(f"data windows must be integer tensors (N, T + 1) alike, 2 <= T <= "
                         f"block_size = {block_size}, got shapes {sorted(map(str, shapes))}")
    return shape[1] - 1


def probe_prompt(run: Run, settings: TimelineSettings) -> tuple[Tensor, int]:
    """The probe's ids (1, P) and its answer: `settings.probe` less its last token, or a
    random half of `probe_half` tokens written twice, less its last."""
    config = run.model_config
    if settings.probe is not None:
        ids = run.tokenizer().encode(settings.probe)
        if not 2 <= len(ids) <= config.block_size + 1:
            raise InputError(f"the probe must be 2 to {config.block_size + 1} tokens long "
                             f"(its last is the answer), got {len(ids)}")
        return torch.tensor([ids[:-1]]), int(ids[-1])
    half = min(settings.probe_half, (config.block_size + 1) // 2)
    generator = torch.Generator().manual_seed(settings.seed)
    first = torch.randint(config.vocab_size, (half,), generator=generator)
    repeated = torch.cat([first, first])  # (2 * half,)
    return repeated[None, :-1], int(repeated[-1])


# --- the file ---------------------------------------------------------------------------------

def write_timeline(timeline: Timeline, plot: bool = False, directory: Path | None = None
                   ) -> list[Path]:
    """timeline.json, and with `plot` timeline.png, each written atomically into `directory`
    (default: the run's)."""
    directory = Path(timeline.run_dir) if directory is None else Path(directory)
    content = finite_or_null(timeline.to_json())
    path = directory / TIMELINE_FILE
    files.write_text_atomic(path, json.dumps(content, allow_nan=False) + "\n")
    written = [path]
    if plot:
        title = (f"{Path(timeline.run_dir).name}: the run through its {len(timeline.steps)} "
                 f"snapshots")
        written.append(save_figure(timeline_figure(content, title),
                                   directory / TIMELINE_PLOT_FILE))
    return written


def check_replaceable(directory: Path, plot: bool) -> None:
    """Raise unless the timeline's files may be written into `directory`: a timeline.json
    there is replaced only when it is one glassgpt wrote (its format, read back), and
    timeline.png only beside such a file (the two are written together)."""
    path = directory / TIMELINE_FILE
    ours = False
    if path.exists():
        try:
            ours = files.read_json_object(path, InputError).get("format") == TIMELINE_FORMAT
        except InputError:
            ours = False
        if not ours:
            raise InputError(f"{path} is not a timeline glassgpt wrote; it is not replaced "
                             f"(move it away first)")
    picture = directory / TIMELINE_PLOT_FILE
    if plot and picture.exists() and not ours:
        raise InputError(f"{picture} is there without the timeline.json glassgpt writes beside "
                         f"it; it is not replaced (move it away first)")


def finite_or_null(value: Any) -> Any:
    """`value` with every NaN or infinity (a diverged SGLD chain's) as None, so that the file
    is JSON any reader parses."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def timeline_of_run(run_dir: str | Path, settings: TimelineSettings | None = None,
                    data: str | Path | None = None, plot: bool = False, device: str = "cpu",
                    progress: Progress | None = None) -> tuple[Timeline, list[Path]]:
    """What `glassgpt timeline RUN` does: `run_timeline`, then `write_timeline`."""
    check_replaceable(Path(run_dir), plot)  # before the work, not after it
    timeline = run_timeline(run_dir, settings, data, device, progress)
    return timeline, write_timeline(timeline, plot)
