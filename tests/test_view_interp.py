"""The view's panels that ask why: Patching, Attribution, the head scores' badges, q and k before
and after QK-norm and the rotation, and Inside the MLP (Starlette's TestClient, no browser).

Every number is checked against `glassgpt.interp` (run_with_cache, the patching functions,
logit_attribution, head_scores) on tiny random models of each architecture the model has, and
on a tiny Hugging Face Llama imported with `from_hf`.
"""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from glassgpt.config import GPTConfig
from glassgpt.errors import InputError
from glassgpt.interp import run_with_cache
from glassgpt.interp.methods import patching as patch
from glassgpt.interp.methods.attribution import logit_attribution
from glassgpt.interp.methods.scores import head_scores
from glassgpt.model import GPT
from glassgpt.tokenizers import CharTokenizer
from glassgpt.view import causal
from glassgpt.view.inspector import RunView
from glassgpt.view.server import create_app

TEXT = "abcdefgh "
PROMPT = "abc fed hag"  # 11 tokens
CORRUPTED = "abc fed hbg"  # one token changed: position 9
ARCHITECTURES = {
    "learned-gelu-layernorm": dict(),
    "rope-gqa-swiglu-rmsnorm-qknorm": dict(position="rope", norm="rmsnorm", activation="swiglu",
                                           n_kv_head=2, qk_norm=True, bias=False),
    "rope-only": dict(position="rope"),
}


def view_of(**switches) -> RunView:
    tokenizer = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=2,
                       **{"n_head": 4, "n_embd": 16, **switches})
    return RunView(GPT(config), tokenizer)


@pytest.fixture(scope="module", params=list(ARCHITECTURES), ids=list(ARCHITECTURES))
def view(request) -> RunView:
    return view_of(**ARCHITECTURES[request.param])


@pytest.fixture(scope="module")
def client(view):
    with TestClient(create_app(view), base_url="http://127.0.0.1") as test_client:
        yield test_client


def ids_of(view: RunView, prompt: str) -> torch.Tensor:
    return torch.tensor([view.tokenizer.encode(prompt)])  # (1, T)


def close(shown, expected: torch.Tensor) -> None:
    """Sent values (rounded to 4 places) equal to the library's float32 ones: a hook on a norm
    or a pattern takes the written-out path instead of the fused kernel, 1e-7 apart, which a
    normalised patching metric divides by a small logit difference."""
    torch.testing.assert_close(torch.tensor(shown, dtype=torch.float64), expected.double(),
                               rtol=1e-4, atol=1e-4)


def test_patching_maps_are_the_librarys_and_run_from_corrupted_to_clean(client, view):
    body = {"clean": PROMPT, "corrupted": CORRUPTED}
    answer = client.post("/api/patching", json=body).json()
    clean, corrupted = ids_of(view, PROMPT), ids_of(view, CORRUPTED)
    _, cache = run_with_cache(view.model, clean)
    # Logits as the patched runs make them: with no pattern hook (the fused attention path).
    clean_logits, _ = run_with_cache(view.model, clean, names=[])
    corrupted_logits, _ = run_with_cache(view.model, corrupted, names=[])
    good, bad = answer["answer"]["id"], answer["wrong"]["id"]
    assert good == int(clean_logits[0, -1].argmax()) and good != bad  # the defaults
    metric = patch.normalized_logit_diff(clean_logits, corrupted_logits, good, bad)
    run = (view.model, corrupted, cache, metric)
    close(answer["resid_pre"], patch.get_act_patch_resid_pre(*run))
    close(answer["attn_out"], patch.get_act_patch_attn_out(*run))
    close(answer["mlp_out"], patch.get_act_patch_mlp_out(*run))
    close(answer["heads"], patch.get_act_patch_attn_head_out_all_pos(*run))
    L, H, T = view.model.config.n_layer, view.model.config.n_head, len(PROMPT)
    assert torch.tensor(answer["resid_pre"]).shape == (L, T)
    assert torch.tensor(answer["heads"]).shape == (L, H)
    # Entering layer 0 the prompts differ only at position 9: putting it back restores the
    # clean run (1); any other position is the same in both runs (0).
    assert answer["resid_pre"][0] == [1.0 if t == 9 else 0.0 for t in range(T)]
    # The clean prompt patched with its own cache is the clean run, at every place: 1.
    itself = patch.get_act_patch_resid_pre(view.model, clean, cache, metric)
    torch.testing.assert_close(itself, torch.ones(L, T), rtol=0, atol=1e-4)
    assert answer["corrupted"]["tokens"][9]["text"] == "b"


def test_patching_chooses_a_corrupted_prompt_of_the_same_length_when_given_none(client):
    answer = client.post("/api/patching", json={"clean": PROMPT}).json()
    shown = answer["corrupted"]["text"]
    assert shown != PROMPT and len(answer["corrupted"]["tokens"]) == len(PROMPT)
    differ = [a["id"] != b["id"] for a, b in zip(answer["clean"]["tokens"],
                                                  answer["corrupted"]["tokens"], strict=True)]
    assert differ.index(True) == len(PROMPT) - 2 and sum(differ) == 1
    chosen = client.post("/api/patching", json={"clean": PROMPT, "corrupted": shown,
                                                "answer": 1, "wrong": 2}).json()
    assert (chosen["answer"]["id"], chosen["wrong"]["id"]) == (1, 2)
    assert {t["id"] for t in chosen["candidates"]} >= {1, 2}


def test_attribution_adds_up_to_the_models_logit(client, view):
    answer = client.post("/api/attribution", json={"prompt": PROMPT, "position": 6}).json()
    logits, _ = run_with_cache(view.model, ids_of(view, PROMPT))
    token = int(logits[0, 6].argmax())
    assert answer["token"]["id"] == token  # the default: the model's top prediction there
    mine = logit_attribution(view.model, ids_of(view, PROMPT), token, pos=6)
    assert answer["labels"] == mine.labels
    close(answer["values"], mine.values.detach())
    assert answer["sum"] == pytest.approx(answer["logit"], abs=1e-4)
    assert answer["logit"] == pytest.approx(float(logits[0, 6, token]), abs=1e-4)
    L, H = view.model.config.n_layer, view.model.config.n_head
    assert [f"L{l}H{h}" for l in range(L) for h in range(H)] == \
        [label for label in answer["labels"] if "H" in label and "MLP" not in label]
    other = client.post("/api/attribution", json={"prompt": PROMPT, "position": 6,
                                                  "token": 3}).json()
    assert other["token"]["id"] == 3
    assert other["sum"] == pytest.approx(float(logits[0, 6, 3]), abs=1e-4)


def test_every_head_carries_its_scores_computed_once(client, view, monkeypatch):
    scores = client.post("/api/overview", json={"prompt": PROMPT}).json()["scores"]
    half = causal.score_half(view.block_size)
    mine = head_scores(view.model, half=half)
    close(scores["previous_token"], mine.previous_token)
    close(scores["induction"], mine.induction)
    assert scores["half"] == half == 8
    assert scores["text"] == "random"  # no run directory: no validation text of its own

    def never(*args, **kwargs):
        raise AssertionError("head scores computed twice")
    monkeypatch.setattr(causal, "head_scores", never)
    again = client.post("/api/overview", json={"prompt": "abc"}).json()["scores"]
    assert again == scores


def test_inside_one_head_shows_q_and_k_before_qk_norm_and_the_rotation(client, view):
    body = {"prompt": PROMPT, "layer": 1, "head": 3, "position": 7}
    steps = {s["name"]: s for s in client.post("/api/head", json=body).json()["steps"]}
    attn = view.model.blocks[1].attn
    names = list(steps)
    expected = ["residual", "normed"]
    for part, final in (("q", "q"), ("k", "keys")):
        if attn.rotary is not None or attn.q_norm is not None:
            expected.append(f"{part}_proj")
        if attn.q_norm is not None:
            expected.append(f"{part}_normed")
        expected.append(final)
    assert names[:len(expected)] == expected
    if "q_proj" not in steps:
        return
    _, cache = run_with_cache(view.model, ids_of(view, PROMPT))
    kv = attn.kv_head_of(3)
    close(steps["q_proj"]["values"], cache["blocks.1.attn.hook_q"][0, 7, 3])
    close(steps["k_proj"]["values"], cache["blocks.1.attn.hook_k"][0, :8, kv])
    assert "hook_q(" in steps["q_proj"]["source"]["text"]
    if attn.q_norm is not None:
        close(steps["q_normed"]["values"], cache["blocks.1.attn.q_norm.hook_normalized"][0, 7, 3])
        assert steps["q_normed"]["source"]["file"] == "norms.py"
    if attn.rotary is not None:
        close(steps["q"]["values"], cache["blocks.1.attn.hook_rot_q"][0, 7, 3])
        assert "hook_rot_q(" in steps["q"]["source"]["text"]
    if attn.rotary is not None and attn.q_norm is None:
        # the rotation turns each pair of q's values: q changes, its length does not
        before, after = torch.tensor(steps["q_proj"]["values"]), torch.tensor(steps["q"]["values"])
        assert not torch.allclose(before, after, atol=1e-3)
        assert float(before.norm()) == pytest.approx(float(after.norm()), abs=1e-3)
        keys_before = torch.tensor(steps["k_proj"]["values"])
        keys_after = torch.tensor(steps["keys"]["values"])
        close(keys_after[0].tolist(), keys_before[0])  # position 0 is turned by angle 0


def test_inside_the_mlp_walks_the_models_own_numbers(client, view):
    body = {"prompt": PROMPT, "layer": 1, "position": 5}
    answer = client.post("/api/mlp", json=body).json()
    steps = {s["name"]: s for s in answer["steps"]}
    gated = view.model.config.activation == "swiglu"
    assert list(steps) == ["resid_mid", "normed", "pre", *(["pre_linear"] if gated else []),
                           "post", "mlp_out", "resid_post"]
    assert answer["gated"] is gated and answer["hidden"] == view.model.config.hidden_width
    _, cache = run_with_cache(view.model, ids_of(view, PROMPT))
    points = {"resid_mid": "blocks.1.hook_resid_mid", "normed": "blocks.1.ln2.hook_normalized",
              "pre": "blocks.1.mlp.hook_pre", "pre_linear": "blocks.1.mlp.hook_pre_linear",
              "post": "blocks.1.mlp.hook_post", "mlp_out": "blocks.1.hook_mlp_out",
              "resid_post": "blocks.1.hook_resid_post"}
    for name, step in steps.items():
        close(step["values"], cache[points[name]][0, 5])
        assert step["source"]["line"] > 0
    for name, called in (("pre", "hook_pre("), ("post", "hook_post("),
                         ("mlp_out", "hook_mlp_out(")):
        assert called in steps[name]["source"]["text"]
    residual = torch.tensor(steps["resid_mid"]["values"]) + torch.tensor(steps["mlp_out"]["values"])
    close(steps["resid_post"]["values"], residual)


def test_a_post_ln_model_says_attribution_needs_pre_ln():
    view = view_of(pre_ln=False)
    with TestClient(create_app(view), base_url="http://127.0.0.1") as client:
        answer = client.post("/api/attribution", json={"prompt": PROMPT, "position": 3})
        assert answer.status_code == 400
        assert "needs a Pre-LN model" in answer.json()["error"]
        mlp = client.post("/api/mlp", json={"prompt": PROMPT, "layer": 0, "position": 3}).json()
        assert "normed" not in [s["name"] for s in mlp["steps"]]  # Post-LN: u is normed already
        maps = client.post("/api/patching", json={"clean": PROMPT, "corrupted": CORRUPTED})
        assert maps.status_code == 200


def test_an_imported_hugging_face_llama_is_seen_through_the_same_way():
    transformers = pytest.importorskip("transformers")
    from glassgpt.formats.interop import from_hf

    config = transformers.LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=16,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.3)
    view = RunView(from_hf(hf_model.eval()), CharTokenizer.from_text(TEXT))
    maps = view.patching(PROMPT, CORRUPTED)
    assert maps["resid_pre"][0] == [1.0 if t == 9 else 0.0 for t in range(len(PROMPT))]
    found = view.attribution(PROMPT, 10)
    assert found["sum"] == pytest.approx(found["logit"], abs=1e-4)
    names = [s["name"] for s in view.head(PROMPT, 1, 3, 10)["steps"]]
    assert names[2:6] == ["q_proj", "q", "k_proj", "keys"]  # rotary, no QK-norm
    assert "pre_linear" in [s["name"] for s in view.mlp(PROMPT, 1, 10)["steps"]]
    assert view.overview(PROMPT)["scores"]["half"] == 8


BAD_REQUESTS = {
    "prompts of different lengths": ("/api/patching", {"clean": PROMPT, "corrupted": "abc"},
                                     "the clean prompt is 11 tokens long and the corrupted one 3"),
    "an answer that is no token": ("/api/patching", {"clean": PROMPT, "corrupted": CORRUPTED,
                                                     "answer": 999}, "answer 999 is no token"),
    "the same answer twice": ("/api/patching", {"clean": PROMPT, "corrupted": CORRUPTED,
                                                "answer": 1, "wrong": 1},
                              "the answer and the wrong token are both 1"),
    "an answer given as text": ("/api/patching", {"clean": PROMPT, "answer": "a"},
                                "answer must be an integer or null"),
    "a clean prompt that is empty": ("/api/patching", {"clean": ""}, "the prompt is empty"),
    "attribution past the prompt": ("/api/attribution", {"prompt": "ab", "position": 2},
                                    "position 2 does not exist"),
    "attribution of no token": ("/api/attribution", {"prompt": "ab", "position": 0,
                                                     "token": -1}, "token -1 is no token"),
    "the MLP of a layer that does not exist": ("/api/mlp", {"prompt": "ab", "layer": 2,
                                                            "position": 0},
                                               "layer 2 does not exist"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_a_bad_request_gets_a_400_and_one_line(case):
    path, body, message = case
    with TestClient(create_app(view_of()), base_url="http://127.0.0.1") as client:
        answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert message in error and "\n" not in error


def test_patching_more_than_the_page_runs_is_refused_before_running(monkeypatch):
    monkeypatch.setattr(causal, "MAX_PATCH_RUNS", 10)
    with pytest.raises(InputError, match="takes 74 forward passes; this page runs at most 10"):
        view_of(n_head=4).patching(PROMPT, CORRUPTED)


# --- issue 38, item 11: patching says how far it is and when its answer is hard to read, ----------
# attribution against a second token, largest first

def test_patching_reports_each_forward_pass_and_the_page_can_read_how_far_it_is(client, view):
    """Patching a 3-token prompt on a 0.6B model ran 454 s behind 'patching…', nothing more."""
    heard = []
    maps = view.patching(PROMPT, CORRUPTED, progress=lambda done, total: heard.append((done,
                                                                                       total)))
    L, H, T = view.model.config.n_layer, view.model.config.n_head, len(PROMPT)
    total = 3 * L * T + L * H
    assert maps["passes"] == total
    assert heard == [(done, total) for done in range(total + 1)]  # the total before any pass
    client.post("/api/patching", json={"clean": PROMPT, "corrupted": CORRUPTED})
    after = client.get("/api/progress").json()
    assert (after["task"], after["done"], after["total"], after["running"]) == \
        ("patching", total, total, False)
    assert after["seconds_left"] == 0 and after["seconds"] > 0


def test_progress_estimates_the_seconds_left_from_the_passes_done():
    from glassgpt.view.progress import Progress

    now = [100.0]
    progress = Progress(clock=lambda: now[0])
    report = progress.reporter("patching")
    report(0, 10)
    assert progress.answer() | {"seconds": None} == {
        "task": "patching", "done": 0, "total": 10, "running": True, "seconds": None,
        "seconds_left": None}
    now[0] = 104.0
    report(4, 10)  # 1 s a pass: 6 passes left
    now[0] = 105.0
    answer = progress.answer()
    assert (answer["seconds"], answer["seconds_left"], answer["running"]) == (5.0, 6.0, True)


def logit_diffs(view: RunView, prompt: str) -> torch.Tensor:
    """(V, V): logit(a) - logit(w) at the last position, for every pair of tokens (a, w)."""
    logits, _ = run_with_cache(view.model, ids_of(view, prompt), names=[])
    last = logits[0, -1, :view.tokenizer.vocab_size]
    return last[:, None] - last[None, :]


def test_patching_warns_when_the_corrupted_prompt_does_not_flip_the_answer():
    """A corrupted prompt that favoured the answer more than the clean one (a negative
    normaliser) gave maps whose signs were turned over, without a word."""
    view = view_of()
    other = PROMPT[:-1] + "d"  # the last token changed: far other logits, even untrained
    clean, corrupted = logit_diffs(view, PROMPT), logit_diffs(view, other)
    pairs = {"flips": (clean > 0) & (corrupted < 0),
             "does not flip": (clean > 0) & (corrupted > 0) & (clean > corrupted),
             "negative normaliser": (clean > 0) & (corrupted > clean)}
    warned = {}
    for name, where in pairs.items():
        answer, wrong = (int(i) for i in where.nonzero()[0])
        found = view.patching(PROMPT, other, answer=answer, wrong=wrong)
        warned[name] = found["warnings"]
    assert warned["flips"] == []
    assert len(warned["does not flip"]) == 1
    assert warned["does not flip"][0].startswith("the corrupted prompt does not flip the answer")
    assert len(warned["negative normaliser"]) == 1
    assert "the normaliser clean - corrupted is negative" in warned["negative normaliser"][0]


def test_attribution_against_a_token_adds_up_to_the_logit_difference_largest_first(client,
                                                                                     view):
    """The page had no 'against' token, and showed its parts (477 on a 0.6B model) in the
    model's order."""
    answer = client.post("/api/attribution", json={"prompt": PROMPT, "position": 6, "token": 3,
                                                   "against": 5}).json()
    mine = logit_attribution(view.model, ids_of(view, PROMPT), 3, pos=6, against=5)
    close(answer["values"], mine.values.detach())
    logits, _ = run_with_cache(view.model, ids_of(view, PROMPT))
    assert answer["sum"] == pytest.approx(float(logits[0, 6, 3] - logits[0, 6, 5]), abs=1e-4)
    assert answer["logit"] == pytest.approx(answer["sum"], abs=1e-4)
    assert (answer["token"]["id"], answer["against"]["id"]) == (3, 5)
    assert [t["id"] for t in answer["candidates"]][:2] == [3, 5]
    sizes = [abs(answer["values"][i]) for i in answer["order"]]
    assert sorted(answer["order"]) == list(range(len(answer["labels"])))
    assert sizes == sorted(sizes, reverse=True) and answer["shown"] == causal.ATTRIBUTION_SHOWN
    alone = client.post("/api/attribution", json={"prompt": PROMPT, "position": 6,
                                                  "token": 3}).json()
    assert alone["against"] is None
    same = client.post("/api/attribution", json={"prompt": PROMPT, "position": 6, "token": 3,
                                                  "against": 3})
    assert same.status_code == 400 and "both 3" in same.json()["error"]


def test_an_attention_only_model_is_seen_through_without_its_missing_mlps():
    """The induction demo's models are attention-only (`attn_only`: no MLP, no ln2): the card
    failed (a 500: the page never loaded), and inside one head, the MLP and patching asked for
    hook points such a block does not have."""
    view = view_of(attn_only=True, position="rope")
    with TestClient(create_app(view), base_url="http://127.0.0.1") as client:
        card = client.get("/api/card").json()
        parts = card["parameters"]["parts"]
        assert parts["ffn"] == 0 and "other" not in parts
        inside = client.post("/api/head", json={"prompt": PROMPT, "layer": 1, "head": 2,
                                                "position": 6}).json()
        _, cache = run_with_cache(view.model, ids_of(view, PROMPT))
        row = next(s for s in inside["steps"] if s["name"] == "weights")
        close(row["values"], cache["blocks.1.attn.hook_pattern"][0, 2, 6, :7])
        mlp = client.post("/api/mlp", json={"prompt": PROMPT, "layer": 1, "position": 6}).json()
        assert mlp["steps"] == [] and "attention-only" in mlp["note"]
        answer = client.post("/api/patching", json={"clean": PROMPT, "corrupted": CORRUPTED})
        maps = answer.json()
        assert "mlp_out" not in maps and maps["passes"] == 2 * 2 * 11 + 2 * 4
        clean, corrupted = ids_of(view, PROMPT), ids_of(view, CORRUPTED)
        clean_logits, _ = run_with_cache(view.model, clean, names=[])
        corrupted_logits, _ = run_with_cache(view.model, corrupted, names=[])
        metric = patch.normalized_logit_diff(clean_logits, corrupted_logits,
                                             maps["answer"]["id"], maps["wrong"]["id"])
        run = (view.model, corrupted, run_with_cache(view.model, clean)[1], metric)
        close(maps["attn_out"], patch.get_act_patch_attn_out(*run))
