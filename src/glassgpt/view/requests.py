"""The API's requests: a JSON object per POST, each field checked for its type.

A request the API cannot take raises `RequestError` with an HTTP status (4xx) and a one-line
message; the values' ranges that depend on the model (layers, heads, positions) are checked by
`RunView`, which raises `glassgpt.errors` exceptions that the server also answers with 400.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import Any

from glassgpt.config import sampling_defaults
from glassgpt.decoding.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from glassgpt.errors import GlassGPTError
from glassgpt.view.features import CLAMP_NEW_TOKENS, TOP_PER_POSITION

MAX_BODY_BYTES = 256 * 2**10  # a prompt of MAX_PROMPT_CHARS characters fits with room to spare
REQUIRED = object()


class RequestError(GlassGPTError):
    """A request the API refuses: `status` is its HTTP status (4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Field:
    """One field of a request body: its JSON types and its default (REQUIRED: none)."""

    kinds: tuple[type, ...]
    default: Any = REQUIRED
    nullable: bool = False

    def describe(self) -> str:
        names = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
                 list: "a list"}
        text = " or ".join(names[k] for k in self.kinds)
        return text + " or null" if self.nullable else text


PROMPT = Field((str,))
TOKENIZE = {"prompt": PROMPT}
NUMBER = (float, int)
# The sampling filter's settings and their defaults: glassgpt.decoding.sampling's (one table).
FILTER = {"temperature": Field(NUMBER, DEFAULT_TEMPERATURE),
          "top_k": Field((int,), DEFAULT_TOP_K, True), "top_p": Field(NUMBER, DEFAULT_TOP_P, True)}
PREDICTIONS = {"prompt": PROMPT, "k": Field((int,), 5), **FILTER}
ATTENTION = {"prompt": PROMPT, "layer": Field((int,)), "head": Field((int,), None, True),
             "kind": Field((str,), "weights")}
OVERVIEW = {"prompt": PROMPT}
ATTENDS = {"prompt": PROMPT, "position": Field((int,))}
HEAD = {"prompt": PROMPT, "layer": Field((int,)), "head": Field((int,)),
        "position": Field((int,))}
ABLATE = {"prompt": PROMPT, "k": Field((int,), 5), "heads": Field((list,), ()),
          "attention": Field((list,), ()), "mlp": Field((list,), ())}
PATCHING = {"clean": PROMPT, "corrupted": Field((str,), None, True),
            "answer": Field((int,), None, True), "wrong": Field((int,), None, True)}
ATTRIBUTION = {"prompt": PROMPT, "position": Field((int,)), "token": Field((int,), None, True),
               "against": Field((int,), None, True)}
MLP = {"prompt": PROMPT, "layer": Field((int,)), "position": Field((int,))}
# The Sampling panel's defaults: its row of glassgpt.config.SAMPLING_DEFAULTS (the page's too).
PANEL = sampling_defaults("view")
SAMPLE = {"prompt": PROMPT, "max_new_tokens": Field((int,), PANEL.max_new_tokens),
          "temperature": Field(NUMBER, PANEL.temperature),
          "top_k": Field((int,), PANEL.top_k, True), "top_p": Field(NUMBER, PANEL.top_p, True),
          "seed": Field((int,), PANEL.seed, True)}

# The Features panel: a dictionary by name (null: the first the view was started with).
DICTIONARY = Field((str,), None, True)
FEATURES = {"prompt": PROMPT, "sae": DICTIONARY, "k": Field((int,), TOP_PER_POSITION)}
FEATURE = {"sae": DICTIONARY, "feature": Field((int,)), "prompt": Field((str,), None, True),
           "position": Field((int,), None, True)}
CLAMP = {**SAMPLE, "sae": DICTIONARY, "feature": Field((int,)),
         "value": Field(NUMBER, None, True), "scale": Field(NUMBER, None, True),
         "max_new_tokens": Field((int,), CLAMP_NEW_TOKENS)}


# The Timeline panel's step: the snapshot a request looks at (null: the run's own weights).
STEP = Field((int,), None, True)


def at_step(fields: dict[str, Field]) -> dict[str, Field]:
    """A request's fields with `step`, for the panels the Timeline's slider moves."""
    return {**fields, "step": STEP}


def one_line(error: BaseException | str) -> str:
    """An error message on one line, whatever the exception put in it."""
    return " ".join(str(error).split()) or type(error).__name__


async def read_body(chunks: AsyncIterable[bytes], limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused (413) as soon as it passes `limit` bytes."""
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise RequestError(f"the request body is larger than {limit:,} bytes", 413)
    return bytes(body)


def parse_json_object(body: bytes, content_type: str | None) -> dict[str, Any]:
    """A request body as a JSON object.

    Only `application/json` is taken: a web page of another site can send a form or plain text
    to this server without asking, but not JSON, so this keeps other sites out.
    """
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        raise RequestError("send the request as JSON with 'Content-Type: application/json'",
                           415)
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("the request body is not UTF-8 text") from None
    except (ValueError, RecursionError) as error:  # ValueError includes JSONDecodeError
        raise RequestError(f"the request body is not valid JSON ({one_line(error)})") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got "
                           f"{type(data).__name__}")
    return data


def take_fields(data: dict[str, Any], fields: dict[str, Field]) -> dict[str, Any]:
    """The values of `fields` from a request object: types checked, defaults filled in,
    unknown names refused (a misspelt setting should not be silently ignored)."""
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r:.40}; this request takes "
                           f"{', '.join(fields)}")
    values = {}
    for name, field in fields.items():
        if name not in data:
            if field.default is REQUIRED:
                raise RequestError(f"the field {name!r} is missing")
            values[name] = field.default
            continue
        values[name] = _checked(name, data[name], field)
    return values


def _checked(name: str, value: Any, field: Field) -> Any:
    if value is None and field.nullable:
        return None
    # JSON true/false are Python bools, and bool is an int: never take one for a number.
    if isinstance(value, bool) or not isinstance(value, field.kinds):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:39] + "…"
        raise RequestError(f"{name} must be {field.describe()}, got {shown}")
    return value
