"""The Features panel of `glassgpt view RUN --sae SAE` (Starlette's TestClient, no browser): the
top features at each position, a feature's page (top contexts from the run's text, density,
logit effects, writers) and clamping a feature while sampling, on the session's tiny trained run
with a small dictionary built here, every number checked against glassgpt.interp.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from glassgpt.cli import main
from glassgpt.config import SamplingConfig
from glassgpt.decoding.generate import generate
from glassgpt.errors import InputError
from glassgpt.interp.sae import SAE, SAEConfig, run_with_cache_and_saes, run_with_saes
from glassgpt.view import features
from glassgpt.view.server import create_app, load_for_view

POINT = "blocks.0.hook_resid_post"
PROMPT = "To be or not"
D_SAE = 32


def dictionary(path: Path, d_in: int = 16, hook: str = POINT, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    SAE(SAEConfig(d_in=d_in, d_sae=D_SAE, metadata={"hook_name": hook})).save(path)
    return path


@pytest.fixture(scope="module")
def view(trained_run):
    return load_for_view(trained_run.run)


@pytest.fixture(scope="module")
def dicts(view, tmp_path_factory):
    return features.load_dictionaries(view, [dictionary(tmp_path_factory.mktemp("d") / "resid")])


@pytest.fixture(scope="module")
def client(view, dicts):
    with TestClient(create_app(view, dictionaries=dicts), base_url="http://127.0.0.1") as c:
        yield c


def sae_of(dicts) -> SAE:
    return dicts.saes["resid"]


def spliced(view, dicts, ids):
    _, cache = run_with_cache_and_saes(view.model, ids, [sae_of(dicts)], use_error_term=True)
    return cache


def ids_of(view, text: str) -> torch.Tensor:
    return view.encode(text).idx


def test_the_dictionaries_are_listed(client):
    assert client.get("/api/dictionaries").json() == {"dictionaries": [
        {"name": "resid", "hook": POINT, "reads": POINT, "architecture": "standard",
         "d_sae": D_SAE}]}


def test_top_features_at_each_position_are_the_spliced_runs(client, view, dicts):
    answer = client.post("/api/features", json={"prompt": PROMPT, "k": 3}).json()
    acts = spliced(view, dicts, ids_of(view, PROMPT))[f"{POINT}.hook_sae_acts_post"][0]
    assert len(answer["positions"]) == acts.shape[0] == len(answer["tokens"])
    for row, listed in zip(acts, answer["positions"], strict=True):
        values, ids = torch.topk(row, 3)
        want = [(int(i), float(v)) for i, v in zip(ids, values, strict=True) if v > 0]
        assert [f["id"] for f in listed] == [i for i, _ in want]
        assert [f["value"] for f in listed] == pytest.approx([v for _, v in want], abs=1e-4)


def busiest_feature(view, dicts) -> int:
    acts = spliced(view, dicts, ids_of(view, PROMPT))[f"{POINT}.hook_sae_acts_post"][0]
    return int(acts.sum(0).argmax())


def test_a_features_page(client, view, dicts):
    f = busiest_feature(view, dicts)
    position = 5
    answer = client.post("/api/feature", json={"feature": f, "prompt": PROMPT,
                                               "position": position}).json()
    # Top contexts: from the run's validation text, strongest first, each token shaded.
    peaks = [c["max"] for c in answer["contexts"]]
    assert peaks and peaks == sorted(peaks, reverse=True) and peaks[0] > 0
    for context in answer["contexts"]:
        assert max(t["value"] for t in context["tokens"]) == pytest.approx(context["max"])
    first = answer["contexts"][0]["tokens"]
    acts = spliced(view, dicts, torch.tensor([[t["id"] for t in first]]))
    torch.testing.assert_close(torch.tensor([t["value"] for t in first]),
                               acts[f"{POINT}.hook_sae_acts_post"][0, :, f], atol=1e-4, rtol=0)
    scan = dicts.scan("resid")
    assert answer["density"]["value"] == int(scan.fired[f]) / scan.positions > 0
    # Logit effects: W_dec[f], centred and times the final LayerNorm's gain, through W_U.
    model, sae = view.model, sae_of(dicts)
    direction = sae.W_dec[f].double()
    effects = model.lm_head.weight.double() @ ((direction - direction.mean())
                                               * model.ln_f.weight.double())
    assert [t["id"] for t in answer["logits"]["up"]] == \
        effects.topk(features.LOGIT_TOKENS).indices.tolist()
    assert answer["logits"]["down"][0]["id"] == int(effects.argmin())
    # Writers: the parts add up to the feature's pre-activation there.
    writers = answer["writers"]
    cache = spliced(view, dicts, ids_of(view, PROMPT))
    pre = float(cache[f"{POINT}.hook_sae_acts_pre"][0, position, f])
    assert writers["pre"] == pytest.approx(pre, abs=1e-6)
    assert writers["sum"] == pytest.approx(pre, abs=1e-5)
    assert {"embed", "pos_embed", "L0H0", "L0H1", "L0 MLP"} <= set(writers["labels"])


def test_density_comes_from_the_sparsity_file_when_there_is_one(view, dicts):
    sae = sae_of(dicts)
    sae.log_sparsity = torch.full((D_SAE,), -2.0)
    try:
        answer = features.feature(view, dicts, "resid", 3)
    finally:
        sae.log_sparsity = None
    assert answer["density"] == {"value": pytest.approx(0.01), "source":
                                 "the dictionary's sparsity file"}


def greedy_with_saes(view, sae, ids, new: int, edit) -> torch.Tensor:
    """Greedy decoding by hand, no KV cache: run_with_saes with the error term and the edit."""
    block = view.model.config.block_size
    for _ in range(new):
        logits = run_with_saes(view.model, ids[:, -block:], [sae], use_error_term=True,
                               hooks=[(f"{POINT}.hook_sae_acts_post", edit)])
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_a_clamped_continuation_differs_and_equals_a_recompute(client, view, dicts):
    f, new = busiest_feature(view, dicts), 12
    body = {"prompt": PROMPT, "feature": f, "value": 40.0, "max_new_tokens": new,
            "temperature": 0.0}
    answer = client.post("/api/clamp", json=body).json()
    ids = ids_of(view, PROMPT)
    plain = generate(view.model, ids, max_new_tokens=new, temperature=0.0)[0, ids.shape[1]:]
    assert answer["untouched"]["ids"] == plain.tolist()
    assert answer["clamped"]["ids"] != answer["untouched"]["ids"]

    def edit(acts, name):
        acts = acts.clone()
        acts[..., f] = 40.0
        return acts
    by_hand = greedy_with_saes(view, sae_of(dicts), ids, new, edit)[0, ids.shape[1]:]
    assert answer["clamped"]["ids"] == by_hand.tolist()
    uncached = generate(view.model, ids, max_new_tokens=new, temperature=0.0, use_cache=False,
                        hooks=features.clamp_hooks(sae_of(dicts), f, 40.0, None))
    assert answer["clamped"]["ids"] == uncached[0, ids.shape[1]:].tolist()


def test_a_clamp_with_scale_one_changes_nothing_and_keeps_the_seed(client, view, dicts):
    body = {"prompt": PROMPT, "feature": 0, "scale": 1.0, "max_new_tokens": 10,
            "temperature": 1.0, "seed": 5}
    answer = client.post("/api/clamp", json=body).json()
    assert answer["seed"] == 5 and answer["clamped"]["ids"] == answer["untouched"]["ids"]


@pytest.mark.parametrize("route, body, says", [
    ("features", {"prompt": PROMPT, "sae": "nope"}, "no dictionary 'nope'"),
    ("features", {"prompt": PROMPT, "k": 0}, "k must be"),
    ("feature", {"feature": D_SAE}, f"feature {D_SAE}"),
    ("feature", {"feature": 0, "prompt": PROMPT}, "position"),
    ("feature", {"feature": 0, "prompt": PROMPT, "position": 99}, "position 99"),
    ("feature", {"feature": 0, "position": 2}, "give the prompt too"),  # was ignored
    ("clamp", {"prompt": PROMPT, "feature": 0}, "one of value"),
    ("clamp", {"prompt": PROMPT, "feature": 0, "value": 1, "scale": 2}, "one of value"),
    ("clamp", {"prompt": PROMPT, "feature": 0, "value": "big"}, "value must be a number"),
    ("clamp", {"prompt": PROMPT, "feature": 0, "value": 1, "max_new_tokens": 10**6},
     "max_new_tokens"),
    ("clamp", {"prompt": "", "feature": 0, "value": 1}, "empty"),
])
def test_bad_requests_are_refused_in_one_line(client, route, body, says):
    response = client.post(f"/api/{route}", json=body)
    assert response.status_code == 400
    assert says in response.json()["error"] and "\n" not in response.json()["error"]


def test_a_view_without_dictionaries_says_how_to_add_one(view):
    with TestClient(create_app(view), base_url="http://127.0.0.1") as c:
        assert c.get("/api/dictionaries").json() == {"dictionaries": []}
        response = c.post("/api/features", json={"prompt": PROMPT})
    assert response.status_code == 400 and "--sae" in response.json()["error"]


@pytest.mark.parametrize("width, hook, says", [
    (8, POINT, "width 8"),
    (16, "blocks.3.hook_resid_post", "blocks.3.hook_resid_post"),
])
def test_a_dictionary_for_another_width_or_hook_is_refused_by_name(view, tmp_path, width, hook,
                                                                   says):
    with pytest.raises(InputError, match=says):
        features.load_dictionaries(view, [dictionary(tmp_path / "bad", width, hook)])


def test_the_command_line_refuses_a_dictionary_that_does_not_fit(trained_run, tmp_path, capsys):
    bad = dictionary(tmp_path / "bad", 8)
    assert main(["view", str(trained_run.run), "--sae", str(bad), "--port", "0"]) != 0
    error = capsys.readouterr().err.strip()
    assert "--sae" in error and "width 8" in error and "\n" not in error


@pytest.mark.parametrize("raw, says", [
    ("1e308", "value=1e+308 is out of range"),
    ("-1e308", "value=-1e+308 is out of range"),
    ("Infinity", "value=inf is not a finite number"),
    ("NaN", "value=nan is not a finite number"),
])
def test_a_clamp_value_out_of_range_is_a_400_that_names_it(client, raw, says):
    """docs/view.md promises never a 500: 1e308 once overflowed the model to one, and NaN or
    Infinity came back blamed on "damaged weights"."""
    body = f'{{"prompt": "{PROMPT}", "feature": 0, "value": {raw}, "max_new_tokens": 2}}'
    response = client.post("/api/clamp", content=body,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error and "damaged" not in error and "\n" not in error


@pytest.mark.parametrize("raw", ["1e308", "Infinity", "NaN"])
def test_a_clamp_scale_out_of_range_is_a_400_that_names_it(client, raw):
    body = f'{{"prompt": "{PROMPT}", "feature": 0, "scale": {raw}, "max_new_tokens": 2}}'
    response = client.post("/api/clamp", content=body,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert "scale=" in response.json()["error"]


def test_a_clamp_that_overflows_the_model_names_the_clamp(view, tmp_path):
    """A value in range can still overflow a model through a long decoder row: the answer
    blames the clamp (a 400 through the server), not the model's weights."""
    sae = SAE.load(dictionary(tmp_path / "plain"))
    with torch.no_grad():
        sae.W_dec[3] *= 1e36
    path = tmp_path / "long"
    sae.save(path)
    dicts = features.load_dictionaries(view, [path])
    sampling = SamplingConfig(max_new_tokens=2, temperature=0.0)
    with pytest.raises(InputError, match=r"the clamp \(value=10000.0\) drives the model's "
                                         r"logits past its float range"):
        features.clamp(view, dicts, None, 3, PROMPT, sampling, value=1e4)
