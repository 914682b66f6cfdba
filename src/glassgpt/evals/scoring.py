"""Scoring a model on a task, as lm-eval scores a Hugging Face model (its HFLM, version 0.4).

    result = evaluate_task(model, tokenizer, load_task("builtin:arithmetic"))
    result.metrics            # {"acc": ..., "acc_norm": ..., "exact_match": ...}
    result.examples[0]        # the choice made and every choice's log-likelihood

The same model exported to Hugging Face and run through lm-eval on the same items gives the same
choices and scores (tests/test_evals.py checks it). What that takes, from lm-eval's reading:
  * Text is encoded as transformers' `tokenizer(text)` does: the leading special tokens (a
    begin-of-sequence) first, where a tokenizer has them.
  * A continuation is scored after its context as lm-eval's `_encode_pair` splits them: spaces
    that end the context move to the continuation, context + continuation is encoded whole and
    the continuation is what follows the context's own tokens (BPE merges a word with the space
    before it, so encoding the two apart would score other tokens).
  * A sequence longer than the context window keeps its last block_size + 1 tokens, and the
    model reads all but the last.
  * Greedy decoding stops at a stop string, the end-of-text token or max_tokens; the context
    keeps its last block_size - max_tokens tokens so the answer fits the window.
Shapes: T = tokens read, n = continuation tokens, V = vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from glassgpt.config import SamplingConfig
from glassgpt.errors import InputError, TokenizerError
from glassgpt.evals.tasks import GenerateUntil, Item, MultipleChoice, Task
from glassgpt.model import eval_mode
from glassgpt.tokenizers import END_OF_TEXT, Tokenizer


@dataclass(frozen=True)
class ChoiceResult:
    """A multiple-choice item scored: each choice's log-likelihood (sum over its tokens), the
    choice of the highest (acc's) and of the highest per character (acc_norm's)."""

    line: int
    gold: int
    loglikelihoods: tuple[float, ...]
    chosen: int
    chosen_norm: int

    @property
    def correct(self) -> bool:
        return self.chosen == self.gold

    @property
    def correct_norm(self) -> bool:
        return self.chosen_norm == self.gold

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "kind": "multiple_choice", "gold": self.gold,
                "chosen": self.chosen, "chosen_norm": self.chosen_norm,
                "loglikelihoods": list(self.loglikelihoods), "acc": float(self.correct),
                "acc_norm": float(self.correct_norm)}


@dataclass(frozen=True)
class GenerationResult:
    """A generate-until item scored: the text decoded (cut at the first stop string)."""

    line: int
    answer: str
    generated: str

    @property
    def exact_match(self) -> bool:
        return self.generated == self.answer

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "kind": "generate_until", "answer": self.answer,
                "generated": self.generated, "exact_match": float(self.exact_match)}


ExampleResult = ChoiceResult | GenerationResult


@dataclass(frozen=True)
class TaskResult:
    """Every item's result, in the file's order, and the metrics over them: acc and acc_norm
    over the multiple-choice items, exact_match over the generate-until ones (a metric is
    absent when no item has its kind)."""

    name: str
    examples: tuple[ExampleResult, ...]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def items(self) -> dict[str, int]:
        """How many items each metric is over: acc and acc_norm the multiple-choice ones,
        exact_match the generate-until ones."""
        choices = sum(isinstance(e, ChoiceResult) for e in self.examples)
        counts = {"acc": choices, "acc_norm": choices,
                  "exact_match": len(self.examples) - choices}
        return {name: counts.get(name, len(self.examples)) for name in self.metrics}

    def summary(self) -> str:
        """"arithmetic: acc 0.5000, acc_norm 0.6250 (16 multiple-choice items); exact_match
        0.2500 (16 generate-until items)": each metric with the items it is over."""
        shown = []
        if "acc" in self.metrics:
            shown.append(f"acc {self.metrics['acc']:.4f}, acc_norm "
                          f"{self.metrics['acc_norm']:.4f} "
                          f"({_items(self.items['acc'], 'multiple-choice')})")
        if "exact_match" in self.metrics:
            shown.append(f"exact_match {self.metrics['exact_match']:.4f} "
                          f"({_items(self.items['exact_match'], 'generate-until')})")
        return f"{self.name}: {'; '.join(shown)}"

    def to_json(self) -> dict[str, Any]:
        return {"task": self.name, "metrics": self.metrics, "items": self.items,
                "examples": [example.to_json() for example in self.examples]}


def _items(count: int, kind: str) -> str:
    return f"{count} {kind} item{'s' if count != 1 else ''}"


def evaluate_task(model: Any, tokenizer: Tokenizer, task: Task,
                  progress: Callable[[int, int], None] | None = None,
                  threads: int | str | None = None) -> TaskResult:
    """Score `model` (a glassgpt GPT) with its `tokenizer` on every item of `task`, without
    gradients and in eval mode; `progress(done, total)` is called after each item. `threads`
    (a count, "auto" or None: leave torch's) sets the CPU threads, "auto" by timing items."""
    from glassgpt.machine.devices import tuner_for

    examples = []
    tuner = tuner_for(threads, model.lm_head.weight.device)
    with torch.no_grad(), eval_mode(model):
        scored = _scored(model, tokenizer, task)
        for done, example in enumerate(scored if tuner is None else tuner.tuned(scored),
                                       start=1):
            examples.append(example)
            if progress is not None:
                progress(done, len(task.items))
    return TaskResult(task.name, tuple(examples), task_metrics(examples))


def _scored(model: Any, tokenizer: Tokenizer, task: Task) -> Iterator[ExampleResult]:
    """Each item's result in turn; an item the model or its tokenizer cannot take is named by
    its file and line."""
    for item in task.items:
        try:
            yield score_item(model, tokenizer, item)
        except (InputError, TokenizerError) as error:
            raise InputError(f"{task.source} line {item.line}: {error}") from None


def score_item(model: Any, tokenizer: Tokenizer, item: Item) -> ExampleResult:
    if isinstance(item, MultipleChoice):
        return score_choices(model, tokenizer, item)
    return score_generation(model, tokenizer, item)


def task_metrics(examples: list[ExampleResult]) -> dict[str, float]:
    choices = [e for e in examples if isinstance(e, ChoiceResult)]
    generations = [e for e in examples if isinstance(e, GenerationResult)]
    metrics = {}
    if choices:
        metrics["acc"] = sum(e.correct for e in choices) / len(choices)
        metrics["acc_norm"] = sum(e.correct_norm for e in choices) / len(choices)
    if generations:
        metrics["exact_match"] = sum(e.exact_match for e in generations) / len(generations)
    return metrics


# --- multiple choice -------------------------------------------------------------------------

def score_choices(model: Any, tokenizer: Tokenizer, item: MultipleChoice) -> ChoiceResult:
    loglikelihoods = tuple(
        loglikelihood(model, *request_tokens(tokenizer, item.context, item.delimiter + choice))
        for choice in item.choices)
    # lm-eval's acc_norm divides by the choice's length in characters, delimiter left out.
    per_character = [ll / len(choice) if choice else _over_zero(ll)
                     for ll, choice in zip(loglikelihoods, item.choices, strict=True)]
    return ChoiceResult(item.line, item.gold, loglikelihoods, _argmax(loglikelihoods),
                        _argmax(per_character))


def _over_zero(value: float) -> float:
    """value / 0.0 as numpy (lm-eval's arithmetic) makes it: -inf, inf or nan."""
    return float("nan") if value == 0 else value * float("inf")


def _argmax(values: tuple[float, ...] | list[float]) -> int:
    """numpy's argmax: the first of the largest, and a NaN wins at once."""
    best = 0
    for i, value in enumerate(values):
        if math.isnan(value):
            return i
        if value > values[best]:
            best = i
    return best


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """transformers' `tokenizer(text)["input_ids"]` for the run's tokenizer: its leading
    special tokens, then the text's, unless the text already starts with them written out."""
    leading = tokenizer.leading_special_ids()
    if leading and text.startswith(tokenizer.decode(leading)):
        leading = []
    return [*leading, *tokenizer.encode(text)]


def request_tokens(tokenizer: Tokenizer, context: str, continuation: str
                   ) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) split as lm-eval splits them."""
    if context == "":  # the end-of-text token stands in for a context, as lm-eval's prefix
        return _without_context(tokenizer, continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:  # " Paris" is one BPE token, "Paris" after a context ending in " " is not
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    context_ids = encode(tokenizer, context)
    continuation_ids = whole[len(context_ids):]
    if not context_ids or not continuation_ids:
        raise InputError(f"the context {context!r:.40} or the choice "
                         f"{continuation!r:.40} encodes to no tokens; nothing to score")
    return context_ids, continuation_ids


def _without_context(tokenizer: Tokenizer, continuation: str) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(continuation)
    end = _end_of_text_id(tokenizer)
    prefix = tokenizer.leading_special_ids()[:1] or ([] if end is None else [end])
    if not prefix or not ids:
        raise InputError("the context is empty and the tokenizer has no "
                         "begin- or end-of-text token to read instead; give a context")
    if ids[0] == prefix[0]:
        return ids[:1], ids[1:]
    return prefix, ids


def loglikelihood(model: Any, context_ids: list[int], continuation_ids: list[int]) -> float:
    """The sum of log p(token | everything before it) over the continuation's tokens."""
    block_size = model.config.block_size
    n = len(continuation_ids)
    if n > block_size:
        raise InputError(f"a choice of {n} tokens does not fit the model's context of "
                         f"{block_size} tokens")
    # The model predicts token t+1 at position t, so the last token is never read.
    read = (context_ids + continuation_ids)[-(block_size + 1):][:-1]
    device = model.lm_head.weight.device
    logits, _ = model(torch.tensor([read], device=device))  # (1, T, V)
    logprobs = F.log_softmax(logits[0, -n:].float(), dim=-1)  # (n, V)
    targets = torch.tensor(continuation_ids, device=device)  # (n,)
    return float(logprobs.gather(1, targets[:, None]).sum())


# --- generate until --------------------------------------------------------------------------

def score_generation(model: Any, tokenizer: Tokenizer, item: GenerateUntil
                     ) -> GenerationResult:
    return GenerationResult(item.line, item.answer,
                            generate_until(model, tokenizer, item.context, item.until,
                                           item.max_tokens))


def generate_until(model: Any, tokenizer: Tokenizer, context: str, until: tuple[str, ...],
                   max_tokens: int) -> str:
    """Greedy continuation of `context`, cut before the first stop string (each of `until` in
    turn, as lm-eval cuts), ended early at the end-of-text token."""
    from glassgpt.decoding.generate import generate_stream

    block_size = model.config.block_size
    if max_tokens >= block_size:
        raise InputError(f"max_tokens {max_tokens} leaves no room for the "
                         f"context in the model's {block_size}-token window; give fewer")
    ids = encode(tokenizer, context)[-(block_size - max_tokens):]
    if not ids:
        raise InputError("the context encodes to no tokens; give one")
    end = _end_of_text_id(tokenizer)
    idx = torch.tensor([ids], device=model.lm_head.weight.device)  # (1, T)
    sampling = SamplingConfig(max_new_tokens=max_tokens, temperature=0.0, stop_token=end)
    new: list[int] = []
    for token in generate_stream(model, idx, sampling):
        if int(token) == end:
            break
        new.append(int(token))
        if any(stop and stop in tokenizer.decode(new) for stop in until):
            break  # what follows is cut off anyway
    return cut_at_stops(tokenizer.decode(new), until)


def _end_of_text_id(tokenizer: Tokenizer) -> int | None:
    """The id of the end-of-text token, where the tokenizer has one (a character tokenizer
    has none; GPT-2's and glassgpt's BPE have <|endoftext|>)."""
    if getattr(tokenizer, "kind", None) == "char":
        return None
    try:
        ids = tokenizer.encode(END_OF_TEXT)
    except TokenizerError:
        return None
    return ids[0] if len(ids) == 1 else None


def cut_at_stops(text: str, until: tuple[str, ...]) -> str:
    for stop in until:
        if stop:  # an empty stop string would cut everything
            text = text.split(stop)[0]
    return text
