"""The Timeline panel: the run's snapshots, one model each, and what `glassgpt timeline` wrote.

`Snapshots` answers "which model does this request look at": the run's own weights (step
None, the view's `RunView`) or a snapshot kept while it trained (`glassgpt train --snapshots
N`), loaded on first use through the run's own opener (`--checkpoint step:N`) and kept among the
last few (`kept_views`: a bounded number of models, so a 0.6B run keeps one). Each kept step has
a `RunView` of its own, so its traces and head scores are its own.

`timeline_answer` is the panel's data: the snapshot steps and, when `glassgpt timeline RUN`
has written `RUN/timeline.json`, the loss and each head's scores at every snapshot, as the page
draws them (`page_timeline`); without the file, one line saying how to make it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from glassgpt.errors import GlassGPTError, InputError
from glassgpt.model import count_parameters
from glassgpt.rundir.checkpoint import load_model
from glassgpt.rundir.snapshots import list_snapshots
from glassgpt.storage.files import read_json_object
from glassgpt.storage.layout import SNAPSHOT_PREFIX, TIMELINE_FILE
from glassgpt.view.inspector import RunView
from glassgpt.view.traces import TraceCache

TIMELINE_BYTES = 64 * 2**20  # a timeline of 64 snapshots of a 0.6B model is under 1 MiB
SNAPSHOT_WEIGHT_BYTES = 2**30  # the snapshots' models kept at once hold at most this much...
MOST_SNAPSHOT_VIEWS = 4  # ... and are at most this many (one at least, whatever its size)
SNAPSHOT_TRACE_BYTES = 64 * 2**20  # each kept snapshot's traces (the run's own keep 256 MiB)
SHOWN_STEPS = 8  # a missing step's error names this many of the run's steps
# The head scores a timeline holds (glassgpt.interp.timeline writes them under these names).
SCORE_KINDS = ("previous_token", "duplicate_token", "induction")


def kept_views(model_bytes: int) -> int:
    """How many snapshot models to keep loaded: as many as fit SNAPSHOT_WEIGHT_BYTES, 1 to
    MOST_SNAPSHOT_VIEWS (the shakespeare-char shape, 43 MB in float32: 4; a 0.6B model: 1)."""
    return max(1, min(MOST_SNAPSHOT_VIEWS, SNAPSHOT_WEIGHT_BYTES // max(model_bytes, 1)))


def steps_text(steps: list[int]) -> str:
    """"1, 2, 4, ..., 1,200" for an error line: the first and last few of a long list."""
    shown = [f"{s:,}" for s in steps]
    if len(shown) > SHOWN_STEPS:
        half = SHOWN_STEPS // 2
        shown = [*shown[:half], "...", *shown[-half:]]
    return ", ".join(shown)


class Snapshots:
    """The run's own view and a view of each snapshot asked for, the last few kept loaded."""

    def __init__(self, view: RunView):
        self.view = view
        self.run_dir: Path | None = view.run_dir
        weights = sum(p.numel() * p.element_size() for p in view.model.parameters())
        self.most = kept_views(weights)
        self.views: OrderedDict[int, RunView] = OrderedDict()  # step -> its view, newest last
        self._steps: list[int] | None = None
        self._loading = threading.Lock()  # one load at a time, whoever asks

    def steps(self, again: bool = False) -> list[int]:
        """The run's snapshot steps, ascending (read once; `again`: read afresh, for a run
        still training)."""
        if self.run_dir is None:
            return []
        if self._steps is None or again:
            self._steps = sorted(list_snapshots(self.run_dir))
        return self._steps

    def view_at(self, step: int | None) -> RunView:
        """The view of the weights at `step` (None: the run's own, best or last). InputError
        for a step the run kept no snapshot of."""
        if step is None:
            return self.view
        with self._loading:
            if step in self.views:
                self.views.move_to_end(step)
                return self.views[step]
            self._check_step(step)
            view = self._load(step)
            self.views[step] = view
            while len(self.views) > self.most:
                self.views.popitem(last=False)  # the least recently asked for
            return view

    def _check_step(self, step: int) -> None:
        if step in self.steps() or step in self.steps(again=True):
            return
        steps = self.steps()
        if not steps:
            raise InputError(f"this run kept no snapshots, so there is no step {step:,} to "
                             f"show; train with --snapshots N to keep them")
        raise InputError(f"this run kept no snapshot at step {step:,}; its snapshots are at "
                         f"steps {steps_text(steps)}")

    def _load(self, step: int) -> RunView:
        assert self.run_dir is not None  # a step was found, so there is a run
        checkpoint = f"{SNAPSHOT_PREFIX}{step}"
        model, tokenizer = load_model(self.run_dir, self.view.device, checkpoint=checkpoint)
        view = RunView(model, tokenizer, self.run_dir, name=f"{self.view.name} at step {step}",
                       threads=self.view.threads, checkpoint=checkpoint)
        view.traces = TraceCache(SNAPSHOT_TRACE_BYTES)
        return view


# --- the panel's data ------------------------------------------------------------------------

def timeline_answer(snapshots: Snapshots) -> dict[str, Any]:
    """GET /api/timeline: `steps` (the snapshots), `checkpoint` (the run's own weights, shown
    at the slider's end), `timeline` (RUN/timeline.json as the page draws it, or None),
    `timeline_note` (why there is none, and how to make it)."""
    steps = snapshots.steps(again=True)
    timeline, note = read_timeline(snapshots.run_dir)
    return {"steps": steps, "checkpoint": snapshots.view.checkpoint,
            "parameters": count_parameters(snapshots.view.model), "kept": snapshots.most,
            "timeline": timeline, "timeline_note": note}


def read_timeline(run_dir: Path | None) -> tuple[dict[str, Any] | None, str | None]:
    """RUN/timeline.json as the page draws it, or None and one line saying why."""
    make = "run `glassgpt timeline RUN` to compute each head's scores at every snapshot"
    if run_dir is None or not (run_dir / TIMELINE_FILE).is_file():
        return None, f"no {TIMELINE_FILE} yet: {make}"
    try:
        data = read_json_object(run_dir / TIMELINE_FILE, InputError, TIMELINE_BYTES)
        return page_timeline(data), None
    except (GlassGPTError, KeyError, TypeError, ValueError, IndexError) as error:
        why = " ".join(str(error).split())[:160]
        return None, f"{TIMELINE_FILE} cannot be read ({why}); {make}"


def page_timeline(data: dict[str, Any]) -> dict[str, Any]:
    """The numbers of `glassgpt timeline`'s file (glassgpt.interp.timeline) the panel draws,
    a list a quantity, one value a snapshot: the loss of each split read (`losses`), the ICL
    score and the LLC (None where it was not measured), and `heads`: each head score and the
    probe's logit attribution by head as [kind][snapshot][layer][head]; with the phase
    change's step and what the ICL score and the phase change are."""
    points = data["snapshots"]
    steps = [int(p["step"]) for p in points]
    # The loss of each split it read ("train", "val"; the induction demo's "repeats").
    splits = [str(split) for split in data.get("splits", ("train", "val"))]
    losses = {split: [_number(p.get(f"{split}_loss")) for p in points] for split in splits}
    llc = [p.get("llc") or {} for p in points]
    kinds = [kind for kind in SCORE_KINDS if all(kind in p["scores"] for p in points)]
    heads = {kind: [_matrix(p["scores"][kind]) for p in points] for kind in kinds}
    if all("heads" in p.get("attribution", {}) for p in points):
        heads["attribution"] = [_matrix(p["attribution"]["heads"]) for p in points]
    phase = data.get("phase_change") or {}
    return {"steps": steps, "losses": losses,
            "icl_score": [_number(p.get("icl_score")) for p in points],
            "llc": [_number(e.get("llc_mean")) for e in llc],
            "llc_std": [_number(e.get("llc_std")) for e in llc], "heads": heads,
            "phase_change": None if phase.get("step") is None else int(phase["step"]),
            "phase_definition": phase.get("definition"),
            "icl_definition": (data.get("icl") or {}).get("definition")}


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _matrix(rows: Any) -> list[list[float]]:
    return [[float(v) for v in row] for row in rows]
