"""`glassgpt convert RUN --to-lens OUT --circuit-tracer`: an export circuit-tracer 0.5 loads as
documented (`ReplacementModel.from_config`, then `load_state_dict`), nothing renamed by hand.

circuit-tracer's replacement model wraps each MLP (as `mlp.old_mlp`) and the unembedding (as
`unembed.old_unembed`) when it is built, before any weight is loaded; the export's
circuit_tracer.safetensors holds the weights under those names. circuit-tracer itself is only
in its own venv, so tests/data/circuit_tracer/circuit_tracer_graph.py ran docs/
interpretability.md's recipe there, as written, on the fixture model's export, and kept what it
found in lens_recipe.json: the graph it made against circuit-tracer's reference graph, what
load_state_dict left out, and the names and shapes of its replacement model's state. Here the
recipe's glassgpt side runs, and its files are held to those names.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from glassgpt.cli import main
from glassgpt.formats.transformer_lens_files import (
    CIRCUIT_TRACER_NAME,
    WEIGHTS_NAME,
    replacement_model_state,
)

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tests" / "data" / "circuit_tracer"
RECIPE = json.loads((HERE / "lens_recipe.json").read_text())


def recipe_block() -> str:
    """docs/interpretability.md's recipe, as circuit_tracer_graph.py reads it."""
    page = (ROOT / "docs" / "interpretability.md").read_text("utf-8")
    after = page[page.index("<!-- section: into circuit-tracer -->"):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def test_the_documented_recipe_gave_circuit_tracers_graph() -> None:
    # the fixture is of the recipe the docs show now (remake it when the recipe changes)
    assert hashlib.sha256(recipe_block().encode()).hexdigest() == RECIPE["recipe_sha256"]
    assert RECIPE["unexpected_keys"] == []
    assert RECIPE["missing_keys"] and all(name.startswith("transcoders.")
                                          for name in RECIPE["missing_keys"])
    assert RECIPE["same_active_features"] and RECIPE["same_logit_tokens"]
    assert RECIPE["adjacency_max_abs_diff"] <= 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lens") / "repeats-lens"
    assert main(["convert", str(HERE / "run"), "--to-lens", str(out), "--circuit-tracer"]) == 0
    return out


def test_the_export_holds_circuit_tracers_names_and_shapes(exported) -> None:
    assert sorted(p.name for p in exported.iterdir()) == [CIRCUIT_TRACER_NAME, "config.json",
                                                          WEIGHTS_NAME]
    theirs = load_file(exported / CIRCUIT_TRACER_NAME)
    expected = RECIPE["replacement_model_state"]
    assert {name: list(t.shape) for name, t in theirs.items()} == expected
    plain = load_file(exported / WEIGHTS_NAME)
    assert set(plain) != set(expected)  # the plain checkpoint would not load into it
    renamed = replacement_model_state(plain)
    assert set(renamed) == set(theirs)
    assert all(renamed[name].equal(theirs[name]) for name in theirs)  # the same tensors
    assert "blocks.1.mlp.old_mlp.W_in" in theirs and "unembed.old_unembed.W_U" in theirs


def test_the_flag_goes_with_to_lens_and_force_replaces_the_three_files(exported, tmp_path,
                                                                       capsys) -> None:
    assert main(["convert", str(HERE / "run"), "--to-hf", str(tmp_path / "hf"),
                 "--circuit-tracer"]) == 2
    assert "--circuit-tracer applies to --to-lens only" in capsys.readouterr().err
    assert main(["convert", str(HERE / "run"), "--to-lens", str(exported), "--force"]) == 0
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", WEIGHTS_NAME]
    assert main(["convert", str(HERE / "run"), "--to-lens", str(exported), "--force",
                 "--circuit-tracer"]) == 0
    assert (exported / CIRCUIT_TRACER_NAME).is_file()
