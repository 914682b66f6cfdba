"""Task files: JSON Lines of questions a model is scored on, read and checked line by line.

One JSON object a line (blank lines skipped). The first line may be a header naming the task and
the kind of its items: `{"task": {"name": "arithmetic", "kind": "multiple_choice"}}`; an item's
own "kind" overrides the header's, so one file may hold both kinds. Two kinds:

  multiple_choice   {"context": "2 + 2 =", "choices": ["4", "5"], "gold": 0}
      optional "delimiter" (default " "): the text between the context and each choice,
      lm-eval's target_delimiter. Scored by the log-likelihood of delimiter + choice after the
      context: acc takes the choice of the highest sum, acc_norm of the highest sum divided by
      the choice's length in characters (lm-eval's acc_norm; the delimiter is not counted).
  generate_until    {"context": "Q: 2 + 2?\\nA:", "answer": " 4", "until": ["\\n"]}
      optional "until" (default ["\\n\\n"], lm-eval's) and "max_tokens" (default 256, lm-eval's
      max_gen_toks). Greedy decoding from the context until a stop string, the tokenizer's
      end-of-text token or max_tokens; the text before the first stop string must equal
      "answer" exactly (lm-eval's exact_match: no stripping, case kept), so write the space a
      model puts before its answer into "answer".

Any line that cannot be used is an InputError naming the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from glassgpt.errors import InputError
from glassgpt.storage import files

MULTIPLE_CHOICE = "multiple_choice"
GENERATE_UNTIL = "generate_until"
KINDS = (MULTIPLE_CHOICE, GENERATE_UNTIL)
BUILTIN_PREFIX = "builtin:"
# lm-eval's defaults: target_delimiter, a generate_until task's `until` (its fewshot_delimiter)
# and max_gen_toks.
DEFAULT_DELIMITER = " "
DEFAULT_UNTIL = ("\n\n",)
DEFAULT_MAX_TOKENS = 256
MAX_TASK_BYTES = 256 * 2**20
ITEM_KEYS = {
    MULTIPLE_CHOICE: {"kind", "context", "choices", "gold", "delimiter"},
    GENERATE_UNTIL: {"kind", "context", "answer", "until", "max_tokens"},
}


@dataclass(frozen=True)
class MultipleChoice:
    """A question answered by picking the likeliest of `choices`; `line` is where it was read."""

    context: str
    choices: tuple[str, ...]
    gold: int
    delimiter: str = DEFAULT_DELIMITER
    line: int = 0


@dataclass(frozen=True)
class GenerateUntil:
    """A question answered by greedy decoding, cut at the first of `until`."""

    context: str
    answer: str
    until: tuple[str, ...] = DEFAULT_UNTIL
    max_tokens: int = DEFAULT_MAX_TOKENS
    line: int = 0


Item = MultipleChoice | GenerateUntil


@dataclass(frozen=True)
class Task:
    name: str
    items: tuple[Item, ...]
    source: str


def builtin_tasks() -> list[str]:
    """The names of the tasks shipped with glassgpt (`builtin:NAME`)."""
    data = resources.files("glassgpt.evals").joinpath("data")
    return sorted(entry.name.removesuffix(".jsonl") for entry in data.iterdir()
                  if entry.name.endswith(".jsonl"))


def load_task(spec: str | Path) -> Task:
    """The task of a JSONL file, or a shipped one when `spec` is "builtin:NAME"."""
    if isinstance(spec, str) and spec.startswith(BUILTIN_PREFIX):
        name = spec.removeprefix(BUILTIN_PREFIX)
        shipped = builtin_tasks()
        if name not in shipped:
            raise InputError(f"no built-in task {name!r}; there are: {', '.join(shipped)}")
        text = resources.files("glassgpt.evals").joinpath(f"data/{name}.jsonl") \
            .read_text(encoding="utf-8")
        return parse_task(text, spec, default_name=name)
    path = Path(spec).expanduser()
    text = files.read_text(path, MAX_TASK_BYTES, InputError)
    return parse_task(text, str(path), default_name=path.stem)


def parse_task(text: str, source: str, default_name: str = "task") -> Task:
    """The items of a task file's text; `source` names it in errors."""
    name, default_kind, items = default_name, None, []
    lines = files.parse_json_lines(text, lambda n: f"{source} line {n}", InputError)
    for number, value in lines:  # "FILE line N is not valid JSON: ..."
        where = f"{source} line {number}"
        data = _json_object(value, where)
        if "task" in data and not items:  # the header, first of all
            name, default_kind = _header(data, where, name)
            continue
        items.append(parse_item(data, default_kind, where, number))
    if not items:
        raise InputError(f"{source} holds no items (one JSON object a line, each with a "
                         f"\"context\")")
    return Task(name, tuple(items), source)


def _json_object(data: object, where: str) -> dict:
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


def _header(data: dict, where: str, name: str) -> tuple[str, str | None]:
    header = data["task"]
    if len(data) != 1 or not isinstance(header, dict):
        raise InputError(f"{where}: a header line is {{\"task\": {{\"name\": ..., \"kind\": "
                         f"...}}}} and nothing else")
    unknown = sorted(set(header) - {"name", "kind", "license", "description"})
    if unknown:
        raise InputError(f"{where}: unknown header keys {unknown} (name, kind, license, "
                         f"description)")
    kind = header.get("kind")
    if kind is not None:
        _check_kind(kind, where)
    return _text(header.get("name", name), "name", where), kind


def _check_kind(kind: object, where: str) -> None:
    if kind not in KINDS:
        raise InputError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r:.60}")


def parse_item(data: dict, default_kind: str | None, where: str, line: int = 0) -> Item:
    """One item of a task file, checked; `where` names its line in errors."""
    kind = data.get("kind", default_kind)
    if kind is None:
        raise InputError(f"{where}: no kind: give \"kind\" ({' or '.join(KINDS)}) on the line "
                         f"or in a header line {{\"task\": {{\"kind\": ...}}}} first")
    _check_kind(kind, where)
    unknown = sorted(set(data) - ITEM_KEYS[kind])
    if unknown:
        raise InputError(f"{where}: unknown keys {unknown} for a {kind} item (it takes "
                         f"{', '.join(sorted(ITEM_KEYS[kind]))})")
    context = _text(data.get("context"), "context", where)
    if kind == MULTIPLE_CHOICE:
        return _multiple_choice(data, context, where, line)
    return _generate_until(data, context, where, line)


def _multiple_choice(data: dict, context: str, where: str, line: int) -> MultipleChoice:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise InputError(f"{where}: \"choices\" must be a non-empty list of strings, got "
                         f"{json.dumps(choices)[:60]}")
    for choice in choices:
        _text(choice, "each choice", where)
    gold = data.get("gold")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise InputError(f"{where}: \"gold\" must be the index of the right choice, 0 to "
                         f"{len(choices) - 1}, got {json.dumps(gold)[:40]}")
    delimiter = _text(data.get("delimiter", DEFAULT_DELIMITER), "delimiter", where)
    return MultipleChoice(context, tuple(choices), gold, delimiter, line)


def _generate_until(data: dict, context: str, where: str, line: int) -> GenerateUntil:
    answer = _text(data.get("answer"), "answer", where)
    until = data.get("until", list(DEFAULT_UNTIL))
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, list) or not all(isinstance(stop, str) for stop in until):
        raise InputError(f"{where}: \"until\" must be a list of strings, got "
                         f"{json.dumps(until)[:60]}")
    if "" in until:  # every text holds it at its start: the answer would always be cut to ""
        raise InputError(f"{where}: \"until\" holds an empty string, which stops before the "
                         f"first token; drop it")
    max_tokens = data.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise InputError(f"{where}: \"max_tokens\" must be a positive integer, got "
                         f"{json.dumps(max_tokens)[:40]}")
    return GenerateUntil(context, answer, tuple(until), max_tokens, line)


def _text(value: object, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: {name} must be a string, got {json.dumps(value)[:60]}")
    return value
