"""`train_run` and `finetune_run` hand their checked arguments on as one request object, the
fine-tune's extending the training's (glassgpt.training.lifecycle.TrainRequest)."""

from __future__ import annotations

import dataclasses
import inspect

from glassgpt.training import finetune, lifecycle
from glassgpt.training.finetune import FinetuneRequest
from glassgpt.training.lifecycle import TrainRequest


def test_a_fine_tunes_request_extends_trainings() -> None:
    assert issubclass(FinetuneRequest, TrainRequest)
    shared = {f.name for f in dataclasses.fields(TrainRequest)}
    own = {f.name for f in dataclasses.fields(FinetuneRequest)} - shared
    assert own == {"sft", "val_sft", "lora", "adapter", "recompute", "base_dtype", "seq_len"}
    # the run a fine-tune starts from is train_run's init_from, not a second name for it
    assert "init_from" in shared and "source" not in own


def test_each_run_starts_and_resumes_from_its_request_alone() -> None:
    for module, request in ((lifecycle, TrainRequest), (finetune, FinetuneRequest)):
        for step in (module._start, module._resume):
            parameters = inspect.signature(step).parameters
            assert list(parameters) == ["request"], step
            assert parameters["request"].annotation == request.__name__, step
