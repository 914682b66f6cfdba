"""`glassgpt demo features` at its --quick size: glassgpt's dictionary trainer recovers planted
features (mean max cosine >= 0.9, a random dictionary at chance), and on a character model its
latents are about one class of positions far more often than the residual stream's coordinates.
Plus the measuring pieces on hand-made inputs: the toy source, the cosines, the classes."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import quick_experiment
from glassgpt.experiments import EXPERIMENTS, ExperimentResult
from glassgpt.experiments.features import (
    QUICK,
    RECOVERED,
    SparseFeatureSource,
    best_cosines,
    class_shares,
    expected_outcomes,
    kind_of,
    position_classes,
    unit_rows,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> ExperimentResult:
    return quick_experiment("features", tmp_path_factory.mktemp("features"))


def test_the_quick_demo_shows_what_it_claims(result: ExperimentResult) -> None:
    failed = [check.claim for check in result.checks if not check.holds]
    assert not failed, failed
    assert "features" in EXPERIMENTS and len(result.checks) == 4
    assert [p.name for p in result.pictures] == ["features.png"]
    assert result.pictures[0].read_bytes()[:8] == PNG_MAGIC
    json.dumps(result.to_dict())  # the --json file


def test_the_planted_features_are_recovered_and_chance_is_far_below(
        result: ExperimentResult) -> None:
    toy = result.numbers["toy"]
    cosines = toy["max_cosine"]
    assert len(cosines) == QUICK.toy.n_features
    assert toy["mean_max_cosine"] == pytest.approx(sum(cosines) / len(cosines), abs=1e-6)
    assert toy["mean_max_cosine"] >= RECOVERED
    assert toy["recovered"] == sum(c >= RECOVERED for c in cosines) >= 0.8 * len(cosines)
    assert toy["random_mean_max_cosine"] < toy["mean_max_cosine"] - 0.25
    # The picture's matrix: each true feature's best latent on the diagonal, best first.
    diagonal = [row[i] for i, row in enumerate(toy["matched"])]
    assert diagonal == pytest.approx(sorted(cosines, reverse=True), abs=1e-6)


def test_the_character_latents_are_measured_on_held_out_text(result: ExperimentResult) -> None:
    text = result.numbers["char"]
    assert len(text["share"]) == len(text["label"]) == text["alive"] <= QUICK.char.d_sae
    assert text["l0"] == pytest.approx(QUICK.char.k)  # TopK: k latents at every position
    assert text["explained_variance"] > 0.8
    assert text["pure"] == sum(s >= QUICK.char.pure for s in text["share"])
    assert text["pure"] >= 0.3 * text["alive"]
    assert text["pure_coordinates"] < text["pure"] / 4
    assert sum(entry["latents"] for entry in text["kinds"].values()) == text["pure"]
    assert set(QUICK.char.kinds) <= set(text["kinds"])
    for label in text["classes"]:
        assert 0 < text["base_rate"][label] < 1


def test_the_sparse_source_sums_its_directions_and_resumes() -> None:
    directions = torch.eye(4)  # each feature its own axis: x is the magnitudes themselves
    source = SparseFeatureSource(directions, firing=0.25, batch_tokens=20_000, seed=3)
    state = source.get_state()
    x, y = source.next_batch()
    assert torch.equal(x, y) and x.shape == (20_000, 4)
    assert ((x >= 0) & (x < 1)).all()
    assert (x > 0).float().mean().item() == pytest.approx(0.25, abs=0.01)
    source.set_state(state)
    assert torch.equal(source.next_batch()[0], x)


def test_best_cosines_ignore_scale_sign_and_order() -> None:
    directions = unit_rows(torch.randn(5, 8, generator=torch.Generator().manual_seed(0)))
    decoder = torch.cat([-3 * directions[[4, 2, 0, 1, 3]], torch.randn(2, 8)])  # (7, 8)
    best = best_cosines(directions, decoder).max(dim=1).values
    assert best == pytest.approx(torch.ones(5), abs=1e-6)


def test_position_classes_on_a_hand_made_text() -> None:
    chars = ["\n", " ", ".", "H", "a", "e", "h", "i"]
    text = "a hi.\nHe"
    windows = torch.tensor([[chars.index(c) for c in text]])  # (1, 8)
    names, masks = position_classes(windows, chars)
    rows = dict(zip(names, masks.tolist(), strict=True))
    # Positions 1 .. 7 of the window: " hi.\nHe"
    assert rows["'h'"] == [False, True, False, False, False, False, False]
    assert rows["after ' '"] == [False, True, False, False, False, False, False]
    assert rows["a word's first letter"] == [False, True, False, False, False, True, False]
    assert rows["a line's first character"] == [False, False, False, False, False, True, False]
    assert rows["a capital letter"] == [False, False, False, False, False, True, False]
    assert rows["punctuation"] == [False, False, False, True, False, False, False]
    assert kind_of("'h'") == "one character" and kind_of("after ' '") == "the character before"


def test_class_shares_pick_the_class_holding_most_mass() -> None:
    masks = torch.tensor([[True, True, False, False], [False, False, True, True]])  # (K=2, N=4)
    activations = torch.tensor([[1.0, 0.0], [3.0, 1.0], [0.0, 1.0], [0.0, 2.0]])  # (N, F=2)
    share, best = class_shares(activations, masks)
    assert share.tolist() == [1.0, 0.75] and best.tolist() == [0, 1]


def test_the_checks_fail_when_the_dictionary_learns_nothing() -> None:
    chance = {"mean_max_cosine": 0.64, "random_mean_max_cosine": 0.64, "recovered": 0}
    text = {"pure": 3, "alive": 50, "pure_coordinates": 2,
            "kinds": {"one character": {"latents": 3}}}
    checks = expected_outcomes({"toy": chance, "char": text}, QUICK)
    assert [check.holds for check in checks] == [False, True, False, False]
    assert "one character 3" in checks[3].claim
