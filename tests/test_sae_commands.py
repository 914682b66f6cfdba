"""`glassgpt sae`'s commands as library calls: `sae eval` is
glassgpt.interp.sae.evaluate.evaluate_on_run, and `sae train`'s flags are made from
DictionarySettings's fields (their types, defaults and help), written nowhere else."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest

from glassgpt.cli import build_parser, main
from glassgpt.cli.sae import SETTINGS
from glassgpt.errors import ConfigError
from glassgpt.interp.sae.evaluate import evaluate_on_run
from glassgpt.interp.sae.training.settings import ARCHITECTURES, DictionarySettings

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def dictionary(trained_run, tmp_path_factory) -> Path:
    """A dictionary `glassgpt sae train` trained on the session's run (two steps)."""
    out = tmp_path_factory.mktemp("dictionary") / "sae"
    assert main(["sae", "train", str(trained_run.run), "--hook", HOOK, "--out", str(out),
                 "--d-sae", "16", "--architecture", "topk", "--k", "2", "--tokens", "256",
                 "--batch-tokens", "128", "--eval-every", "0"]) == 0
    return out


def test_sae_eval_prints_the_record_evaluate_on_run_returns(trained_run, dictionary,
                                                            capsys) -> None:
    capsys.readouterr()
    assert main(["sae", "eval", str(dictionary), "--run", str(trained_run.run), "--tokens",
                 "64", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    metrics = evaluate_on_run(dictionary, trained_run.run, tokens=64)
    for name, value in metrics.summary().items():
        assert printed[name] == value or (math.isnan(value) and printed[name] != printed[name])
    counts, _ = metrics.density_histogram(bins=10)
    assert printed["log10_density_histogram"]["counts"] == counts.tolist()


def test_evaluate_on_run_names_its_arguments_as_python_does(trained_run, dictionary) -> None:
    with pytest.raises(ConfigError, match="^tokens must be positive, got 0"):
        evaluate_on_run(dictionary, trained_run.run, tokens=0)


def sae_train_actions() -> dict[str, argparse.Action]:
    sae = build_parser()._subparsers._group_actions[0].choices["sae"]
    train = sae._subparsers._group_actions[0].choices["train"]
    return {action.dest: action for action in train._actions}


def test_sae_train_flags_are_the_settings_fields() -> None:
    actions = sae_train_actions()
    fields = {field.name: field for field in dataclasses.fields(DictionarySettings)}
    for flag, name in SETTINGS.items():
        action, field = actions[flag], fields[name]
        assert action.help == field.metadata["help"], flag
        if name not in ("hook", "d_sae"):  # a new training is told both: no default
            assert action.default == field.default, flag
    assert actions["architecture"].choices == ARCHITECTURES
    assert {actions[flag].type for flag in ("d_sae", "tokens", "seed")} == {int}
    assert {actions[flag].type for flag in ("k", "l1", "lr")} == {float}
    assert actions["transcoder"].nargs == 0  # a switch
