"""The JSON API of `glassgpt view` on a tiny trained run (Starlette's TestClient, no browser).

Every answer is checked against the library (`glassgpt.interp.methods.lens`,
`glassgpt.decoding.generate`), and every bad request gets a 4xx JSON with a one-line `error`,
never a 500.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import socket
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from glassgpt.bench import view as bench
from glassgpt.cli import build_parser, main
from glassgpt.config import GPTConfig, SamplingConfig
from glassgpt.data import PreparedData
from glassgpt.decoding.generate import encode_prompt, stream_text
from glassgpt.decoding.sampling import sampling_distribution
from glassgpt.interp.methods.heads import head_steps
from glassgpt.interp.methods.lens import (
    attention_maps,
    lens_top_k,
    next_token_top_k,
    read_out,
    trace,
)
from glassgpt.model import GPT, count_parameters
from glassgpt.rundir.checkpoint import load_model
from glassgpt.tokenizers import CharTokenizer, train_tokenizer
from glassgpt.training.metrics import read_metrics
from glassgpt.view.card import parameter_counts
from glassgpt.view.inspector import MAX_NEW_TOKENS, MAX_PROMPT_CHARS, RunView
from glassgpt.view.maps import pooled
from glassgpt.view.pieces import piece_text, readable_bytes
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
    assert '<script src="/static/causal.js"' in page.text
    for asset, kind in [("app.js", "javascript"), ("causal.js", "javascript"),
                        ("style.css", "text/css")]:
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


def test_inside_one_head_has_the_models_own_numbers(client, view):
    body = {"prompt": PROMPT, "layer": 1, "head": 1, "position": 6}
    answer = client.post("/api/head", json=body).json()
    steps = {step["name"]: step for step in answer["steps"]}
    assert list(steps) == ["residual", "normed", "q", "keys", "scores", "mask", "weights",
                           "values", "mixed", "w_o", "contribution"]
    idx = ids_of(view, PROMPT)
    mine = head_steps(view.model, idx, 1, 1, 6)  # the library, from the module's weights
    C, d = view.model.config.n_embd, mine.q.shape[0]
    assert steps["residual"]["shape"] == [C] and steps["q"]["shape"] == [d]
    assert steps["keys"]["shape"] == [7, d] and steps["w_o"]["shape"] == [d, C]
    for name in ("residual", "normed", "q", "mixed", "contribution"):
        torch.testing.assert_close(torch.tensor(steps[name]["values"]), getattr(mine, name),
                                   rtol=0, atol=5e-5)
    torch.testing.assert_close(torch.tensor(steps["keys"]["values"]), mine.keys[:7], rtol=0,
                               atol=5e-5)
    # The softmax row is the model's own attention map (its forward, not this computation).
    maps = attention_maps(view.model, idx)[:, 0]  # (L, H, T, T)
    torch.testing.assert_close(torch.tensor(steps["weights"]["values"]),
                               maps[1, 1, 6, :7].float(), rtol=0, atol=5e-5)
    assert steps["mask"]["values"] == [t <= 6 for t in range(len(PROMPT))]
    for step in answer["steps"]:
        assert step["source"]["file"] in ("attention.py", "block.py", "norms.py")
        assert step["source"]["line"] > 0
    # the line that calls each step's hook point (attention scores: masked, then the softmax)
    assert steps["scores"]["source"]["function"] == "masked_softmax"
    assert "hook_pattern(" in steps["weights"]["source"]["text"]
    assert answer["kv_head"] == 1 and answer["n_kv_head"] == 2


def test_scores_are_before_the_softmax_and_say_their_scale(client, view):
    body = {"prompt": PROMPT, "layer": 0, "head": 1, "kind": "scores"}
    answer = client.post("/api/attention", json=body).json()
    seen = trace(view.model, ids_of(view, PROMPT))
    scores = seen.scores[0][0, 1]  # (T, T)
    rows = answer["weights"][0]
    for i, row in enumerate(rows):
        torch.testing.assert_close(torch.tensor(row), scores[i, :i + 1], rtol=0, atol=5e-5)
    flat = [v for row in rows for v in row]
    assert answer["scale"] == {"min": min(flat), "max": max(flat)}
    assert answer["kind"] == "scores" and answer["kv_head_of"] == [1]
    weights = client.post("/api/attention", json={**body, "kind": "weights"}).json()
    assert weights["scale"] == {"min": 0.0, "max": 1.0}


def test_the_overview_holds_every_layer_and_head(client, view):
    answer = client.post("/api/overview", json={"prompt": PROMPT}).json()
    maps = attention_maps(view.model, ids_of(view, PROMPT))[:, 0]  # (L, H, T, T)
    assert answer["cells"] == len(PROMPT) and not answer["pooled"]
    for layer in range(2):
        for head in range(2):
            for i, row in enumerate(answer["weights"][layer][head]):
                torch.testing.assert_close(torch.tensor(row), maps[layer, head, i, :i + 1],
                                           rtol=0, atol=5e-5)
    # A long prompt's thumbnails average blocks of cells; each row still sums to 1.
    long_maps = torch.softmax(torch.randn(2, 100, 100), -1).tril()
    small = pooled(long_maps / long_maps.sum(-1, keepdim=True), 48)
    assert small.shape == (2, 48, 48)
    torch.testing.assert_close(small.sum(-1), torch.ones(2, 48))


def test_ablation_is_a_model_whose_head_rows_of_w_o_were_zeroed_by_hand(client, view):
    body = {"prompt": PROMPT, "k": 3, "heads": [[0, 1]]}
    answer = client.post("/api/ablate", json=body).json()
    assert answer["ablation"] == {"heads": [[0, 1]], "attention": [], "mlp": []}
    intact = client.post("/api/predictions", json={"prompt": PROMPT, "k": 3}).json()
    assert answer["intact"]["ids"] == intact["ids"]
    by_hand = copy.deepcopy(view.model)
    d = by_hand.config.n_embd // by_hand.config.n_head
    with torch.no_grad():
        by_hand.blocks[0].attn.proj.weight[:, d:2 * d] = 0.0  # head 1's inputs to W_O
    idx = ids_of(view, PROMPT)
    lens = lens_top_k(by_hand, trace(by_hand, idx).residuals, 3)  # (L + 1, 1, T, 3)
    assert answer["ablated"]["ids"] == lens.ids[:, 0].tolist()
    torch.testing.assert_close(torch.tensor(answer["ablated"]["probs"]), lens.probs[:, 0],
                               rtol=0, atol=5e-5)
    with torch.no_grad():
        _, loss = by_hand(idx[:, :-1], idx[:, 1:])
        _, intact_loss = view.model(idx[:, :-1], idx[:, 1:])
    assert answer["ablated"]["loss"] == pytest.approx(loss.item(), abs=1e-5)
    assert answer["intact"]["loss"] == pytest.approx(intact_loss.item(), abs=1e-5)
    assert answer["ablated"]["probs"] != answer["intact"]["probs"]
    # The view's model is left intact.
    assert client.post("/api/predictions", json={"prompt": PROMPT, "k": 3}).json() == intact
    both = client.post("/api/ablate", json={"prompt": PROMPT, "attention": [0, 1],
                                            "mlp": [0, 1]}).json()
    assert both["ablated"]["loss"] != both["intact"]["loss"]


def test_the_next_token_bars_follow_temperature_and_top_k(client, view):
    body = {"prompt": PROMPT, "k": 5, "temperature": 0.5, "top_k": 2}
    answer = client.post("/api/predictions", json=body).json()
    logits = read_out(view.model, trace(view.model, ids_of(view, PROMPT)).residuals[-1])[0]
    drawn = sampling_distribution(logits, 0.5, 2)  # (T, V)
    probs = torch.tensor(answer["sampling"]["probs"])  # (T, 5)
    torch.testing.assert_close(probs, drawn.topk(5).values, rtol=0, atol=5e-5)
    assert (probs[:, 2:] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(len(PROMPT)))
    greedy = client.post("/api/predictions", json={**body, "temperature": 0}).json()
    assert all(row[0] == 1.0 for row in greedy["sampling"]["probs"])
    assert [row[0] for row in greedy["sampling"]["ids"]] == [row[0] for row in greedy["ids"][-1]]
    plain = client.post("/api/predictions", json={"prompt": PROMPT, "k": 5}).json()
    torch.testing.assert_close(torch.tensor(plain["sampling"]["probs"]),
                               torch.tensor(plain["probs"][-1]), rtol=0, atol=1e-4)


def test_byte_level_pieces_are_readable_escapes_never_replacement_characters():
    assert readable_bytes("é".encode()) == "é"
    assert readable_bytes(b"\xe2\x82") == "<0xE2><0x82>"
    assert readable_bytes(b"a\xe2\x82\xacb\xff") == "a€b<0xFF>"
    text = "".join(f"naïve café € {i} ☃ 日本語\n" for i in range(40))
    tokenizer = train_tokenizer("bpe", text, 300)
    pieces = [piece_text(tokenizer, i) for i in range(tokenizer.vocab_size)]
    assert not any("\ufffd" in piece for piece in pieces)
    assert any(piece.startswith("<0xE") for piece in pieces)  # a lead byte on its own
    for i, piece in enumerate(pieces):  # whole pieces are shown as the text they are
        if "<0x" not in piece:
            assert piece == tokenizer.decode([i])


def test_a_modern_model_with_shared_kv_heads_is_seen_through_the_same_way():
    tokenizer = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=12, n_layer=2, n_head=4,
                       n_embd=16, position="rope", norm="rmsnorm", activation="swiglu",
                       n_kv_head=2, qk_norm=True, bias=False)
    view = RunView(GPT(config), tokenizer)
    prompt = "abc fed hag"
    inside = view.head(prompt, layer=1, head=3, position=10)
    assert (inside["kv_head"], inside["n_kv_head"]) == (1, 2)  # heads 2 and 3 share K/V head 1
    maps = attention_maps(view.model, ids_of(view, prompt))[:, 0]  # (L, H, T, T)
    weights = next(s for s in inside["steps"] if s["name"] == "weights")["values"]
    torch.testing.assert_close(torch.tensor(weights), maps[1, 3, 10], rtol=0, atol=5e-5)
    assert view.attention(prompt, 0)["kv_head_of"] == [0, 0, 1, 1]
    assert view.card()["parameters"]["parts"]["norm"] == (2 * 2 + 1) * 16
    ablated = view.ablate(prompt, heads=[[1, 2], [1, 3]])
    assert ablated["ablated"]["loss"] != ablated["intact"]["loss"]


def test_the_view_bench_imports_and_reads_its_text():
    assert bench.shakespeare_text().startswith("First Citizen")


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
    # The run's own validation text (its first line, cut at a word within the context).
    val_text = view.tokenizer.decode(PreparedData(run_dir.parent / "data").splits["val"]
                                     .tolist())
    assert card["example_prompt"] and card["example_prompt"] in val_text
    assert len(view.tokenizer.encode(card["example_prompt"])) <= 16
    assert RunView(view.model, view.tokenizer).example_prompt() == "To be, or not to"


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
    "attention of an unknown kind": ("/api/attention", {"prompt": "to", "layer": 0,
                                                        "kind": "logits"}, 400,
                                     "kind must be one of weights, scores"),
    "inside a head that does not exist": ("/api/head", {"prompt": "to", "layer": 0, "head": 2,
                                                        "position": 0}, 400,
                                          "head 2 does not exist"),
    "inside at a position past the prompt": ("/api/head", {"prompt": "to", "layer": 0,
                                                           "head": 0, "position": 2}, 400,
                                             "position 2 does not exist"),
    "ablate a layer that does not exist": ("/api/ablate", {"prompt": "to", "mlp": [2]}, 400,
                                           "layer 2 does not exist"),
    "ablate a head that is not a pair": ("/api/ablate", {"prompt": "to", "heads": [[0]]}, 400,
                                         "each of heads must be [layer, head]"),
    "ablate a layer given as text": ("/api/ablate", {"prompt": "to", "attention": ["0"]}, 400,
                                     "a layer must be an integer"),
    "ablate heads given as an object": ("/api/ablate", {"prompt": "to", "heads": {"0": 1}},
                                        400, "heads must be a list"),
    "negative temperature for the bars": ("/api/predictions", {"prompt": "to",
                                                               "temperature": -0.5}, 400,
                                          "temperature must be >= 0"),
    "top_k of zero for the bars": ("/api/predictions", {"prompt": "to", "top_k": 0}, 400,
                                   "top_k must be a positive integer"),
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
                     "/api/overview", "/api/attends", "/api/head", "/api/ablate", "/api/sample",
                     "/api/mlp", "/api/patching", "/api/progress", "/api/attribution",
                     "/api/timeline", "/api/dictionaries", "/api/features", "/api/feature",
                     "/api/clamp",
                     "/api/graph/available", "/api/graph", "/api/graph/edge",
                     "/api/compare/available", "/api/compare/tokens", "/api/compare/changes",
                     "/api/compare/attention", "/static"}


def test_a_page_of_another_site_is_refused_by_its_host_name(client):
    for host in ("attacker.example:8000", "127.0.0.1:evil", "[::1]evil.example",
                 "127.0.0.1:", "localhost:80:80", "[::1]:8o", ""):
        answer = client.get("/api/card", headers={"Host": host})
        assert answer.status_code == 400, host
        assert answer.json()["error"].startswith("this server answers requests for")
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
        assert client.get("/api/card", headers={"Host": host}).status_code == 200


def test_a_post_from_another_sites_page_is_refused_by_its_origin(client):
    body = {"prompt": PROMPT}
    for origin in ("http://attacker.example", "null", "http://127.0.0.1:9999",
                   "https://127.0.0.1", "http://127.0.0.1.evil.example"):
        answer = client.post("/api/tokenize", json=body, headers={"Origin": origin})
        assert answer.status_code == 403, origin
        assert "from its own page only" in answer.json()["error"]
    # The page's own requests name this server; tools that send no Origin are answered.
    assert client.post("/api/tokenize", json=body,
                       headers={"Origin": "http://127.0.0.1"}).status_code == 200
    assert client.post("/api/tokenize", json=body).status_code == 200
    assert client.get("/api/card", headers={"Origin": "http://attacker.example"}) \
        .status_code == 200  # a GET changes nothing, and the browser keeps its answer


def test_a_client_that_leaves_mid_request_logs_no_traceback(view, caplog):
    app = create_app(view)
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/api/tokenize",
             "raw_path": b"/api/tokenize", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, send))
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert sent[0]["status"] == 400


def test_every_failure_inside_a_stream_becomes_an_error_event(client, view, monkeypatch,
                                                              caplog):
    def broken(prompt, sampling):
        yield "a"
        raise RuntimeError("the engine fell over\nin two lines")

    with monkeypatch.context() as patched:
        patched.setattr(view, "sample", broken)
        with caplog.at_level(logging.DEBUG, logger="glassgpt.view"), \
                client.stream("POST", "/api/sample", json={"prompt": "to"}) as answer:
            lines = list(answer.iter_lines())
    events = [line[7:] for line in lines if line.startswith("event: ")]
    assert events == ["token", "error"]
    error = json.loads([line for line in lines if line.startswith("data: ")][-1][6:])["error"]
    assert "RuntimeError: the engine fell over in two lines" in error
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1 and "\n" not in logged[0].getMessage() and not logged[0].exc_info
    # A temperature below float32's range: a stream that ends, never an empty one.
    with client.stream("POST", "/api/sample", json={"prompt": "to", "temperature": 1e-300,
                                                    "max_new_tokens": 3}) as answer:
        names = [line[7:] for line in answer.iter_lines() if line.startswith("event: ")]
    assert names and names[-1] in ("done", "error")


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


def test_the_head_score_badges_are_measured_on_the_runs_own_text(client, view):
    """The badges scored random ids over the whole vocabulary: the docs' induction run read
    0.00-0.02 there while patching showed its induction heads at 1.00."""
    from glassgpt.interp.methods.scores import head_scores
    from glassgpt.view import causal

    scores = client.post("/api/overview", json={"prompt": PROMPT}).json()["scores"]
    assert scores["text"] == "validation"
    half = causal.score_half(view.block_size)
    windows = causal.text_windows(view.validation_ids(), half, scores["sequences"])
    assert windows.shape == (scores["sequences"], 2 * half) and scores["sequences"] > 1
    first = view.tokenizer.decode(windows[0, :half].tolist())
    assert first in view.tokenizer.decode([int(i) for i in view.validation_ids()])
    assert torch.equal(windows[:, :half], windows[:, half:])  # each window, then itself
    mine = head_scores(view.model, tokens=windows)
    torch.testing.assert_close(torch.tensor(scores["induction"]), mine.induction,
                               rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.tensor(scores["previous_token"]), mine.previous_token,
                               rtol=0, atol=1e-4)
