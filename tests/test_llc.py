"""The LLC estimator against devinterp 2.0.1 (tests/data/devinterp/, remade by its
make_fixture.py in a venv of its own): the same model, data order and seed give the same batches,
the same loss at every SGLD step (devinterp's own tolerance for same-seed traces, atol 1e-3) and
the same LLC."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError, InputError
from glassgpt.interp.timeline.llc import LLCSettings, batch_order, estimate_llc
from glassgpt.model import GPT

FIXTURE = Path(__file__).parent / "data" / "devinterp"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())


def fixture_model() -> GPT:
    model = GPT(GPTConfig(**REFERENCE["config"]))
    model.load_state_dict(load_file(FIXTURE / "model.safetensors"), strict=False)
    return model


def sequences() -> torch.Tensor:
    return load_file(FIXTURE / "sequences.safetensors")["sequences"]


def glassgpt_settings(case: dict) -> LLCSettings:
    return LLCSettings(lr=case["lr"], nbeta=case["n_beta"], localization=case["localization"],
                       weight_decay=case["llc_weight_decay"], num_chains=case["num_chains"],
                       num_draws=case["num_draws"], num_burnin_steps=case["num_burnin_steps"],
                       num_steps_bw_draws=case["num_steps_bw_draws"],
                       num_init_loss_batches=case["num_init_loss_batches"],
                       batch_size=case["batch_size"], seed=case["init_seed"])


@pytest.mark.parametrize("name", sorted(REFERENCE["cases"]))
def test_llc_equals_devinterp_on_the_same_model_data_order_and_seed(name):
    expected = REFERENCE["cases"][name]
    settings = glassgpt_settings(expected["settings"])
    model = fixture_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1234)
    caller_rng = torch.get_rng_state()
    seen = []
    estimate = estimate_llc(model, sequences(), settings, progress=lambda d, t: seen.append((d, t)))
    # the batches devinterp fed every chain, step by step, are the order's batches, cycled
    order = batch_order(len(sequences()), settings.batch_size, settings.seed)
    for chain in expected["batches"]:
        assert chain == [order[s % len(order)].tolist() for s in range(settings.num_steps)]
    torch.testing.assert_close(torch.tensor(estimate.step_losses),
                               torch.tensor(expected["step_losses"]), atol=1e-3, rtol=0)
    torch.testing.assert_close(torch.tensor(estimate.draw_losses),
                               torch.tensor(expected["draw_losses"]), atol=1e-3, rtol=0)
    assert estimate.init_loss == pytest.approx(expected["init_loss"], abs=1e-5)
    nbeta = settings.nbeta
    # the llc is nbeta times a loss difference: its tolerance is nbeta times the traces'
    assert estimate.llc_per_chain == pytest.approx(expected["llc_per_chain"], abs=nbeta * 1e-3)
    assert estimate.llc_mean == pytest.approx(expected["llc_mean"], abs=nbeta * 1e-3)
    assert estimate.llc_std == pytest.approx(expected["llc_std"], abs=nbeta * 1e-3)
    # the chains differ (their noise does), the model and the caller's generator are untouched
    assert estimate.step_losses[0] != estimate.step_losses[1]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), caller_rng)
    total = settings.num_chains * settings.num_draws
    assert seen == [(d, total) for d in range(1, total + 1)]


def test_the_estimate_carries_its_settings_and_chains():
    estimate = estimate_llc(fixture_model(), sequences()[:16],
                            LLCSettings(num_chains=2, num_draws=3, batch_size=8,
                                        num_init_loss_batches=2, num_burnin_steps=1))
    line = estimate.describe()
    assert f"{estimate.llc_mean:.4g}" in line and "2 chains" in line and "lr 0.0001" in line
    assert f"nbeta {8 / math.log(8):.4g}" in line  # devinterp's default_nbeta, m / log m
    record = estimate.to_json()
    assert record["settings"]["nbeta"] == pytest.approx(8 / math.log(8))
    assert len(record["step_losses"]) == 2 and len(record["step_losses"][0]) == 4
    assert len(record["draw_losses"][0]) == 3
    assert json.loads(json.dumps(record))["llc_per_chain"] == estimate.llc_per_chain


def test_bad_settings_and_inputs_are_named():
    with pytest.raises(ConfigError, match="num_chains"):
        LLCSettings(num_chains=0)
    with pytest.raises(ConfigError, match="lr"):
        LLCSettings(lr=float("nan"))
    with pytest.raises(InputError, match="full batch"):
        estimate_llc(fixture_model(), sequences()[:4], LLCSettings(batch_size=8))
    with pytest.raises(InputError, match="integer"):
        estimate_llc(fixture_model(), sequences().float(), LLCSettings())
    with pytest.raises(InputError, match="length"):
        estimate_llc(fixture_model(), [sequences()[:, :5], sequences()[:, :6]], LLCSettings())
