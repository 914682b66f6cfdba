"""A run's weight snapshots: the model at log-spaced steps, kept while it trains
(`glassgpt train --snapshots N`), so that what it learned can be watched step by step
(glassgpt.interp.timeline).

    RUN/snapshots/step_00001200.safetensors   the weights at step 1200, under the same tensor
                                              names as the run's model.safetensors
    RUN/snapshots/index.json                  the steps, the rule, and what they cost

Which steps: N snapshots over a run of T steps are taken at

    step_i = max(i, floor((T + 1) ** (i / (N - 1))) - 1),   i = 0 .. N-1

so step 0 (the initialisation) and step T (the end) are always kept, the steps between are
spaced evenly in log(step + 1), and where that spacing is finer than one step (the first
steps) every step is kept: the first steps are dense. The root is taken exactly, on integers,
so the steps are the same on every machine. N = 1 keeps the last step only; N > T + 1 keeps
every step (T + 1 snapshots).

A snapshot holds the weights only (no optimizer state): it is a model to look at, not a
checkpoint to resume. Training is deterministic on a CPU (the same recipe, seed and thread
count give the same weights bit for bit), so the rest of a run from a snapshot's step is
reproduced by training the same recipe to that step and resuming it (`tests/test_snapshots.py`
does exactly that). Each file is written atomically (storage.files.atomic_path); the time spent
writing them and their bytes are in the index beside the training's own time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from safetensors.torch import save as save_safetensors_bytes
from torch import Tensor, nn

from glassgpt.adapters.lora import LoraLinear
from glassgpt.errors import CheckpointError
from glassgpt.machine.distributed import unwrap_model
from glassgpt.rundir.weights import model_tensors
from glassgpt.storage import files
from glassgpt.storage.layout import SNAPSHOT_INDEX, SNAPSHOTS_DIR, snapshot_file

SNAPSHOTS_FORMAT = "glassgpt-snapshots/1"
STEPS_RULE = ("step_i = max(i, floor((T + 1) ** (i / (N - 1))) - 1) for i = 0..N-1 (T: "
              "max_iters, N: snapshots): log-spaced in step + 1, every step where that is "
              "denser than one a step")
_SNAPSHOT_NAME = re.compile(r"step_(\d{8})\.safetensors")


def snapshot_steps(count: int, max_iters: int) -> list[int]:
    """The steps `count` snapshots of a run of `max_iters` steps are taken at (STEPS_RULE)."""
    if count <= 0:
        return []
    n = min(count, max_iters + 1)
    if n == 1:
        return [max_iters]
    return [max(i, _integer_root((max_iters + 1) ** i, n - 1) - 1) for i in range(n)]


def _integer_root(value: int, k: int) -> int:
    """floor(value ** (1 / k)), exactly: a float's guess, corrected on integers."""
    root = int(math.exp(math.log(value) / k)) if value > 1 else value
    while root ** k > value:
        root -= 1
    while (root + 1) ** k <= value:
        root += 1
    return root


# --- reading ----------------------------------------------------------------------------------

def snapshots_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SNAPSHOTS_DIR


def list_snapshots(run_dir: str | Path) -> list[int]:
    """The steps a run keeps snapshots of, in order ([] when it keeps none)."""
    directory = snapshots_dir(run_dir)
    if files.entry_kind(directory) != "directory":
        return []
    found = (_SNAPSHOT_NAME.fullmatch(name) for name in os.listdir(directory))
    return sorted(int(match.group(1)) for match in found if match)


def snapshot_path(run_dir: str | Path, step: int) -> Path:
    """Where the snapshot at `step` is; CheckpointError naming the steps kept if there is
    none."""
    path = snapshots_dir(run_dir) / snapshot_file(step)
    if files.entry_kind(path) == "missing":
        kept = list_snapshots(run_dir)
        listed = (f"it keeps {_steps_text(kept)}" if kept else
                  "it keeps none (train with --snapshots N)")
        raise CheckpointError(f"{run_dir} has no snapshot at step {step}; {listed}")
    return path


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(f"step:{s}" for s in steps[:12])
    return f"{len(steps)} snapshots ({shown}{', ...' if len(steps) > 12 else ''})"


def read_index(run_dir: str | Path) -> dict[str, Any]:
    """index.json of a run's snapshots (what they cost, the rule), or {} when there is none."""
    path = snapshots_dir(run_dir) / SNAPSHOT_INDEX
    if files.entry_kind(path) == "missing":
        return {}
    return files.read_json_object(path, CheckpointError)


def snapshot_tensors(model: nn.Module, weights: dict[str, Tensor] | None = None
                     ) -> dict[str, Tensor]:
    """The weights a snapshot holds, as `model_tensors` writes a run's: a model tuned with
    LoRA adapters gives its base with the adapters merged (in float32, as `Run.load_model`
    merges them), since the snapshot is the model as it was at that step."""
    tensors = model_tensors(model, weights)
    for name, module in unwrap_model(model).named_modules():
        if isinstance(module, LoraLinear):
            merged = tensors[f"{name}.weight"].float().clone()
            for target, (first, end) in module.slices.items():
                merged[first:end] += module.delta(target).detach().cpu().float()
            tensors[f"{name}.weight"] = merged
    return tensors


# --- writing ----------------------------------------------------------------------------------

class SnapshotWriter:
    """Keeps a training run's snapshots: which steps are due, each file written atomically,
    and index.json rewritten after each (so a crash leaves an index that names what is there,
    whole). Only the run's writer uses it, under the run's lock."""

    def __init__(self, run_dir: str | Path, count: int, max_iters: int):
        self.dir = snapshots_dir(run_dir)
        self.count, self.max_iters = count, max_iters
        self.steps = snapshot_steps(count, max_iters)
        self._due = set(self.steps)
        self.taken: list[dict[str, Any]] = []
        self.train_seconds_before = 0.0  # by earlier calls of a resumed run
        self.started = time.perf_counter()

    def due(self, step: int) -> bool:
        return step in self._due

    def begin_new_run(self) -> None:
        """A new run (its first checkpoint committed): the snapshots of a run it replaced go."""
        for step in list_snapshots(self.dir.parent):
            files.remove_file(self.dir / snapshot_file(step))
        files.remove_file(self.dir / SNAPSHOT_INDEX)
        with contextlib.suppress(OSError):  # empty now, unless the user keeps files there
            self.dir.rmdir()
        self.started = time.perf_counter()

    def begin_resumed(self, iteration: int) -> None:
        """A resumed run: snapshots past its checkpoint (taken before a crash) go, as the
        metrics logged past it do; the index's record of the others is kept."""
        for step in list_snapshots(self.dir.parent):
            if step > iteration:
                files.remove_file(self.dir / snapshot_file(step))
        index = read_index(self.dir.parent)
        kept = set(list_snapshots(self.dir.parent))
        self.taken = [entry for entry in index.get("snapshots", [])
                      if isinstance(entry, dict) and entry.get("step") in kept]
        seconds = index.get("train_seconds", 0.0)
        self.train_seconds_before = float(seconds) if isinstance(seconds, int | float) else 0.0
        self.started = time.perf_counter()
        if self.count or self.taken:  # a run that keeps no snapshots gets no folder for them
            self._write_index()

    def save(self, model: nn.Module, step: int, weights: dict[str, Tensor] | None = None
             ) -> None:
        began = time.perf_counter()
        data = save_safetensors_bytes(snapshot_tensors(model, weights),
                                      metadata={"format": "pt", "step": str(step)})
        try:
            self.dir.mkdir(exist_ok=True)
            files.write_bytes_atomic(self.dir / snapshot_file(step), data)
        except OSError as error:
            raise CheckpointError(f"cannot write the snapshot at step {step} in {self.dir} "
                                  f"({error})") from None
        self.taken = [entry for entry in self.taken if entry.get("step") != step]
        self.taken.append({"step": step, "file": snapshot_file(step), "bytes": len(data),
                           "seconds": time.perf_counter() - began})
        self._write_index()

    def finish(self) -> None:
        """The index with the training's whole time, as the run returns."""
        if self.count and self.taken:
            self._write_index()

    def _write_index(self) -> None:
        taken = sorted(self.taken, key=lambda entry: entry["step"])
        train_seconds = self.train_seconds_before + time.perf_counter() - self.started
        save_seconds = sum(entry["seconds"] for entry in taken)
        index = {"format": SNAPSHOTS_FORMAT, "steps": [entry["step"] for entry in taken],
                 "asked": self.count, "max_iters": self.max_iters, "schedule": self.steps,
                 "rule": STEPS_RULE, "bytes": sum(entry["bytes"] for entry in taken),
                 "save_seconds": save_seconds, "train_seconds": train_seconds,
                 "cost_fraction": save_seconds / train_seconds if train_seconds > 0 else 0.0,
                 "snapshots": taken}
        try:
            self.dir.mkdir(exist_ok=True)
            files.write_text_atomic(self.dir / SNAPSHOT_INDEX, json.dumps(index, indent=1) + "\n")
        except OSError as error:
            raise CheckpointError(f"cannot write {self.dir / SNAPSHOT_INDEX} ({error})") from None
