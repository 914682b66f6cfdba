"""Offline task evaluations, scored as lm-eval scores them: multiple choice by log-likelihood
(acc, acc_norm) and greedy generation until a stop string (exact_match).

    task = load_task("builtin:arithmetic")        # or a JSONL file of one's own (evals.tasks)
    result = evaluate_task(model, tokenizer, task)
    result.metrics, result.examples

The task file format is glassgpt.evals.tasks'; the scoring, and how it matches lm-eval's, is
glassgpt.evals.scoring's. `glassgpt eval RUN --task FILE` is the command.
"""

from glassgpt.evals.scoring import (
    ChoiceResult,
    GenerationResult,
    TaskResult,
    evaluate_task,
)
from glassgpt.evals.tasks import (
    GENERATE_UNTIL,
    MULTIPLE_CHOICE,
    GenerateUntil,
    MultipleChoice,
    Task,
    builtin_tasks,
    load_task,
    parse_task,
)

__all__ = [
    "GENERATE_UNTIL",
    "MULTIPLE_CHOICE",
    "ChoiceResult",
    "GenerateUntil",
    "GenerationResult",
    "MultipleChoice",
    "Task",
    "TaskResult",
    "builtin_tasks",
    "evaluate_task",
    "load_task",
    "parse_task",
]
