"""The JSON API of `glassgpt view` on a tiny trained run (Starlette's TestClient, no browser).

Every answer is checked against the library (`glassgpt.lens`, `glassgpt.generate`), and every
bad request gets a 4xx JSON with a one-line `error`, never a 500.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from glassgpt.checkpoint import load_model
from glassgpt.cli import build_parser, main
from glassgpt.config import SamplingConfig
from glassgpt.generate import encode_prompt, stream_text
from glassgpt.lens import attention_maps, next_token_top_k, parameter_counts
from glassgpt.metrics import read_metrics
from glassgpt.model import count_parameters
from glassgpt.view.inspector import MAX_NEW_TOKENS, MAX_PROMPT_CHARS, RunView
from glassgpt.view.requests import MAX_BODY_BYTES
from glassgpt.view.server import allowed_hosts_for, create_app, load_for_view

PROMPT = "to be or not"
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--max-iters", "6", "--eval-interval", "3", "--eval-iters", "2",
        "--log-interval", "1", "--device", "cpu"]


def train_tiny_run(root: Path) -> Path:
    """A char-level run trained a few steps on a short text, through the CLI."""
    text = root / "text.txt"
    text.write_text("".join(f"To be or not to be, line {i}: that is the question.\n"
                            for i in range(100)), encoding="utf-8")
    assert main(["prepare", "--text", str(text), "--out", str(root / "data")]) == 0
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"), *TINY]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("view"))


@pytest.fixture(scope="module")
def view(run_dir) -> RunView:
    return load_for_view(run_dir)


@pytest.fixture(scope="module")
def client(view):
    with TestClient(create_app(view), base_url="http://127.0.0.1") as test_client:
        yield test_client


def ids_of(view: RunView, prompt: str) -> torch.Tensor:
    return torch.tensor([view.tokenizer.encode(prompt)])  # (1, T)


# --- answers -------------------------------------------------------------------------------

def test_the_page_and_its_assets_are_served_from_the_package(client):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/static/app.js"' in page.text
    for asset, kind in [("app.js", "javascript"), ("style.css", "text/css")]:
        answer = client.get(f"/static/{asset}")
        assert answer.status_code == 200 and kind in answer.headers["content-type"]
        # Offline: nothing is loaded from another site (the SVG namespace is a name, not a URL
        # that is fetched).
        assert "//" not in answer.text.replace("http://www.w3.org/2000/svg", "").replace(
            "// ", "").replace("//\n", "")


def test_tokenize_shows_the_tokens_the_model_sees(client, view):
    answer = client.post("/api/tokenize", json={"prompt": PROMPT}).json()
    assert [t["id"] for t in answer["tokens"]] == view.tokenizer.encode(PROMPT)
    assert "".join(t["text"] for t in answer["tokens"]) == PROMPT
    assert answer["block_size"] == 16


def test_predictions_are_the_lens_of_every_layer_ending_in_the_models_top_k(client, view):
    answer = client.post("/api/predictions", json={"prompt": PROMPT, "k": 3}).json()
    T, L = len(PROMPT), view.model.config.n_layer
    assert answer["layers"] == ["embeddings", "layer 0", "layer 1"]
    assert len(answer["ids"]) == len(answer["probs"]) == L + 1
    assert all(len(row) == T and len(row[0]) == 3 for row in answer["ids"])
    top = next_token_top_k(view.model, ids_of(view, PROMPT), 3)  # (1, T, 3)
    assert answer["ids"][-1] == top.ids[0].tolist()
    probs = torch.tensor(answer["probs"][-1], dtype=torch.float64)
    torch.testing.assert_close(probs, top.probs[0].double(), rtol=0, atol=5e-5)
    assert set(answer["pieces"]) == {str(i) for i in torch.tensor(answer["ids"]).flatten()
                                     .tolist()}


def test_attention_of_one_head_or_of_every_head_is_the_models(client, view):
    maps = attention_maps(view.model, ids_of(view, PROMPT))[:, 0]  # (L, H, T, T)
    one = client.post("/api/attention", json={"prompt": PROMPT, "layer": 1, "head": 0}).json()
    every = client.post("/api/attention", json={"prompt": PROMPT, "layer": 1}).json()
    assert one["heads"] == [0] and every["heads"] == [0, 1]
    for head, rows in zip(every["heads"], every["weights"], strict=True):
        assert [len(row) for row in rows] == list(range(1, len(PROMPT) + 1))  # causal rows
        for i, row in enumerate(rows):
            weights = torch.tensor(row, dtype=torch.float64)
            torch.testing.assert_close(weights, maps[1, head, i, :i + 1].double(), rtol=0,
                                       atol=5e-5)
            assert abs(sum(row) - 1) < 1e-3
    assert one["weights"][0] == every["weights"][0]


def test_attends_shows_one_token_in_every_layer_and_head(client, view):
    answer = client.post("/api/attends", json={"prompt": PROMPT, "position": 4}).json()
    maps = attention_maps(view.model, ids_of(view, PROMPT))[:, 0]  # (L, H, T, T)
    weights = torch.tensor(answer["weights"], dtype=torch.float64)  # (L, H, 5)
    assert weights.shape == (2, 2, 5)
    torch.testing.assert_close(weights, maps[:, :, 4, :5].double(), rtol=0, atol=5e-5)


def test_sample_streams_the_same_text_as_glassgpt_sample(client, view):
    settings = {"max_new_tokens": 12, "temperature": 0.8, "top_k": 5, "seed": 3}
    with client.stream("POST", "/api/sample", json={"prompt": PROMPT, **settings}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) | {"line": n} for n, line in
                  enumerate(answer.iter_lines()) if line.startswith("data: ")]
    prompt, _ = encode_prompt(view.tokenizer, PROMPT, 16)
    expected = list(stream_text(view.model, view.tokenizer, prompt, SamplingConfig(**settings)))
    assert [e["text"] for e in events[:-1]] == expected
    assert events[-1]["pieces"] == len(expected) == 12


def test_the_model_card_has_config_parameters_and_the_training_curve(client, view, run_dir):
    card = client.get("/api/card").json()
    assert card["model"]["n_layer"] == 2 and card["tokenizer"]["kind"] == "char"
    assert card["parameters"]["total"] == count_parameters(view.model)
    assert card["parameters"]["parts"] == parameter_counts(view.model)
    evals = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert card["training"]["best_val_loss"] == min(r["val_loss"] for r in evals)
    assert [e[0] for e in card["training"]["eval"]] == [0, 3, 6]
    assert len(card["training"]["train"]) == 6 and card["training"]["iterations"] == 6
    assert card["training"]["settings"]["max_iters"] == 6
    assert card["example_prompt"] == "To be, or not to"  # the first example that fits, cut


# --- bad requests --------------------------------------------------------------------------

JSON = {"Content-Type": "application/json"}
BAD_REQUESTS = {
    "empty prompt": ("/api/tokenize", {"prompt": ""}, 400, "the prompt is empty"),
    "unknown characters": ("/api/predictions", {"prompt": "to bé?"}, 400,
                           "not in the tokenizer's vocabulary: '?', 'é'"),
    "prompt longer than the context": ("/api/attention", {"prompt": "t" * 17, "layer": 0}, 400,
                                       "17 tokens long; the model's context holds 16"),
    "huge prompt": ("/api/tokenize", {"prompt": "t" * (MAX_PROMPT_CHARS + 1)}, 400,
                    "the most this page takes"),
    "huge max_new_tokens": ("/api/sample", {"prompt": "to", "max_new_tokens": 10**12}, 400,
                            f"at most {MAX_NEW_TOKENS:,}"),
    "max_new_tokens past 64 bits": ("/api/sample", {"prompt": "to", "max_new_tokens": 2**70},
                                    400, "too large"),
    "negative temperature": ("/api/sample", {"prompt": "to", "temperature": -1}, 400,
                             "temperature must be >= 0"),
    "top_p above 1": ("/api/sample", {"prompt": "to", "top_p": 1.5}, 400, "top_p must be"),
    "negative seed": ("/api/sample", {"prompt": "to", "seed": -1}, 400, "seed must be >= 0"),
    "layer past the last": ("/api/attention", {"prompt": "to", "layer": 2}, 400,
                            "layer 2 does not exist: the model has layers 0..1"),
    "negative layer": ("/api/attention", {"prompt": "to", "layer": -1}, 400,
                       "layer -1 does not exist"),
    "head past the last": ("/api/attention", {"prompt": "to", "layer": 0, "head": 5}, 400,
                           "head 5 does not exist: the model has heads 0..1"),
    "position past the prompt": ("/api/attends", {"prompt": "to", "position": 2}, 400,
                                 "position 2 does not exist"),
    "k of zero": ("/api/predictions", {"prompt": "to", "k": 0}, 400, "k must be between 1"),
    "prompt of the wrong type": ("/api/tokenize", {"prompt": 7}, 400,
                                 "prompt must be a string, got 7"),
    "layer as a string": ("/api/attention", {"prompt": "to", "layer": "1"}, 400,
                          "layer must be an integer, got \"1\""),
    "layer as a float": ("/api/attention", {"prompt": "to", "layer": 1.0}, 400,
                         "layer must be an integer"),
    "head as a boolean": ("/api/attention", {"prompt": "to", "layer": 0, "head": True}, 400,
                          "head must be an integer or null, got true"),
    "temperature as a list": ("/api/sample", {"prompt": "to", "temperature": [1]}, 400,
                              "temperature must be a number"),
    "missing field": ("/api/attention", {"prompt": "to"}, 400, "the field 'layer' is missing"),
    "unknown field, say a file path": ("/api/tokenize", {"prompt": "to", "path": "/etc/passwd"},
                                       400, "unknown field 'path'"),
    "not an object": ("/api/tokenize", ["to"], 400, "must be a JSON object, got list"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_a_bad_request_gets_a_4xx_and_one_line(client, case):
    path, body, status, message = case
    answer = client.post(path, json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert message in error and "\n" not in error


RAW_REQUESTS = {
    "malformed JSON": (b'{"prompt": "to"', JSON, 400, "not valid JSON"),
    "JSON NaN": (b'{"prompt": "to", "temperature": NaN}', JSON, 400, "finite"),
    "not UTF-8": (b'{"prompt": "\xff"}', JSON, 400, "not UTF-8"),
    "not JSON at all": (b"prompt=to", {"Content-Type": "application/x-www-form-urlencoded"},
                        415, "Content-Type: application/json"),
    "too large": (b'{"prompt": "' + b"t" * MAX_BODY_BYTES + b'"}', JSON, 413,
                  "larger than"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, JSON, 400, "not valid JSON"),
}


@pytest.mark.parametrize("case", RAW_REQUESTS.values(), ids=RAW_REQUESTS.keys())
def test_a_body_that_is_not_a_json_object_gets_a_4xx(client, case):
    body, headers, status, message = case
    path = "/api/sample" if b"temperature" in body else "/api/tokenize"
    answer = client.post(path, content=body, headers=headers)
    assert answer.status_code == status, answer.text
    assert message in answer.json()["error"]


def test_wrong_paths_and_methods_get_json_errors(client):
    assert client.get("/api/nothing").json() == {"error": "nothing at /api/nothing"}
    answer = client.get("/api/sample")
    assert answer.status_code == 405
    assert answer.json() == {"error": "GET is not allowed on /api/sample"}
    assert client.get("/static/../inspector.py").status_code == 404


def test_only_the_documented_endpoints_exist_and_none_takes_a_file(client):
    paths = {route.path for route in client.app.routes}
    assert paths == {"/", "/api/card", "/api/tokenize", "/api/predictions", "/api/attention",
                     "/api/attends", "/api/sample", "/static"}


def test_a_page_of_another_site_is_refused_by_its_host_name(client):
    answer = client.get("/api/card", headers={"Host": "attacker.example:8000"})
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("this server answers requests for")
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert client.get("/api/card", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host, allowed", [("127.0.0.1", ("127.0.0.1", "localhost", "::1")),
                                           ("::1", ("127.0.0.1", "localhost", "::1")),
                                           ("myhost", ("127.0.0.1", "localhost", "::1",
                                                       "myhost")),
                                           ("0.0.0.0", ("*",)), ("::", ("*",))])
def test_the_host_names_answered_follow_the_address_listened_on(host, allowed):
    assert allowed_hosts_for(host) == allowed


# --- the command -----------------------------------------------------------------------------

def test_view_listens_on_this_machine_only_by_default(run_dir):
    args = build_parser().parse_args(["view", str(run_dir)])
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_view_of_a_missing_run_is_one_error_line(tmp_path, capsys):
    assert main(["view", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: run directory not found: " \
                                              f"{tmp_path / 'nothing'}"


def test_view_on_a_bad_or_busy_port_is_one_error_line(run_dir, capsys):
    assert main(["view", str(run_dir), "--port", "70000"]) == 2
    assert "--port must be between 0 and 65535" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["view", str(run_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1


def test_load_for_view_reads_the_run(run_dir):
    view = load_for_view(run_dir)
    model, tokenizer = load_model(run_dir)
    assert view.run_dir == run_dir and view.name == "run"
    assert tokenizer.encode(PROMPT) == view.tokenizer.encode(PROMPT)
    for mine, theirs in zip(view.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
