"""One table of sampling defaults (glassgpt.config.SAMPLING_DEFAULTS), and every surface held
to its row: the library, `glassgpt sample` (its flags and its --help), and the view's server
and page. A default changed anywhere but the table fails here."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from importlib import resources

import pytest
from starlette.testclient import TestClient

from conftest import tiny_gpt
from glassgpt.cli import build_parser
from glassgpt.config import SAMPLING_DEFAULTS, SamplingConfig, sampling_defaults
from glassgpt.decoding import sampling
from glassgpt.decoding.generate import sample_next_token
from glassgpt.tokenizers import CharTokenizer
from glassgpt.view import requests as req
from glassgpt.view.inspector import RunView
from glassgpt.view.server import create_app

FILTER = ("temperature", "top_k", "top_p")
SAMPLED = ("max_new_tokens", *FILTER, "seed")  # what the table's rows may change


def test_every_row_changes_only_sampled_settings_and_says_why():
    for surface, row in SAMPLING_DEFAULTS.items():
        assert set(row.changes) <= set(SAMPLED), surface
        assert row.where and len(row.why.split()) >= 5, surface
        sampling_defaults(surface)  # each row is a valid SamplingConfig


def test_the_library_row_is_samplingconfig_itself():
    assert SAMPLING_DEFAULTS["library"].changes == {}
    assert sampling_defaults("library") == SamplingConfig()
    library = sampling_defaults("library")
    assert tuple(getattr(library, name) for name in FILTER) == \
        (sampling.DEFAULT_TEMPERATURE, sampling.DEFAULT_TOP_K, sampling.DEFAULT_TOP_P)
    for function in (sample_next_token, sampling.sampling_distribution):
        signature = inspect.signature(function).parameters
        assert {name: signature[name].default for name in FILTER} == \
            {name: getattr(library, name) for name in FILTER}, function.__name__


def test_glassgpt_sample_with_no_flags_starts_from_its_row():
    args = build_parser().parse_args(["sample", "some-run"])
    start = sampling_defaults("sample")
    assert {name: getattr(args, name) for name in SAMPLED} == \
        {name: getattr(start, name) for name in SAMPLED}


def test_sample_help_prints_the_table(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sample", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "glassgpt.config.SAMPLING_DEFAULTS" in text
    for surface, row in SAMPLING_DEFAULTS.items():
        start = sampling_defaults(surface)
        assert row.where in text and " ".join(row.why.split()) in text, surface
        assert f"temperature {start.temperature}, top-k " in text, surface


class Inputs(HTMLParser):
    """The attributes of every <input> of the page, by id."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, str | None]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "input":
            self.by_id[dict(attrs).get("id") or ""] = dict(attrs)


def test_the_page_writes_no_sampling_default_of_its_own():
    """The page's forms are filled from the server's card (`fillSamplingDefaults`)."""
    static = resources.files("glassgpt.view").joinpath("static")
    page = Inputs()
    page.feed(static.joinpath("index.html").read_text("utf-8"))
    boxes = ["dist-temperature", "dist-top-k", "max-new-tokens", "temperature", "sample-top-k",
             "top-p", "seed"]
    assert all("value" not in page.by_id[box] for box in boxes)
    script = static.joinpath("app.js").read_text("utf-8")
    assert all(f'"{box}"' in script or f"{box}:" in script for box in boxes)
    assert not re.search(r'numberOrNull\("[\w-]+"\) \?\? \d', script)  # no fallback number


@pytest.fixture(scope="module")
def served() -> tuple[TestClient, list[SamplingConfig]]:
    """A server on a tiny model whose sampling records the settings it was asked for."""
    asked: list[SamplingConfig] = []

    def record(prompt: str, settings: SamplingConfig) -> Iterator[str]:
        asked.append(settings)
        yield from ()  # a stream of no pieces (the server closes it)

    view = RunView(tiny_gpt(vocab_size=4).eval(), CharTokenizer(list("abcd")))
    view.sample = record
    with TestClient(create_app(view), base_url="http://127.0.0.1") as client:
        yield client, asked


def row_of(settings: SamplingConfig) -> dict[str, object]:
    return {name: getattr(settings, name) for name in SAMPLED}


def test_the_views_sample_request_starts_from_its_row(served):
    client, asked = served
    with client.stream("POST", "/api/sample", json={"prompt": "ab"}) as answer:
        assert answer.status_code == 200
        answer.read()
    assert row_of(asked[-1]) == row_of(sampling_defaults("view"))
    assert {name: field.default for name, field in req.SAMPLE.items() if name in SAMPLED} == \
        row_of(sampling_defaults("view"))


def test_the_card_gives_the_page_both_forms_starts(served):
    client, _ = served
    card = client.get("/api/card").json()["sampling"]
    assert card["sample"] == row_of(sampling_defaults("view"))
    library = sampling_defaults("library")
    assert card["predictions"] == {name: getattr(library, name) for name in FILTER}
    assert {f.name for f in dataclasses.fields(SamplingConfig)} >= set(card["sample"])
