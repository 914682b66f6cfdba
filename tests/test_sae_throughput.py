"""The dictionary trainer's throughput pieces (issue 53, goal 5) that are not the step itself
(tests/test_sae_sparse_step.py): an SAE's batch is read once, and `bench sae` lets its cached
contenders take turns. No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_gpt
from glassgpt.bench import sae as bench
from glassgpt.interp.sae.training import activations
from glassgpt.interp.sae.training.activations import WindowActivations


@pytest.mark.parametrize(("target", "reads"), [("blocks.0.hook_resid_post", 1),
                                               ("blocks.0.hook_mlp_out", 2)])
def test_a_batch_is_checked_once_when_the_target_is_the_input(monkeypatch, target: str,
                                                              reads: int) -> None:
    checked: list[str] = []
    monkeypatch.setattr(activations, "check_finite_activations",
                        lambda acts, hook: checked.append(hook))
    model = tiny_gpt()
    ids = np.arange(200) % model.config.vocab_size
    source = WindowActivations(model, "blocks.0.hook_resid_post", target, ids, 8, 32, 0, "cpu")
    x, y = source.next_batch()
    assert x.shape[0] == y.shape[0] == 32
    assert len(checked) == reads and checked[-1] == target


def test_the_cached_contenders_take_turns_and_report_their_median_round(monkeypatch) -> None:
    runs: list[str] = []
    rates = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 6.0, 4.0])}

    def fake_worker(command: list[str], contender: str, size: bench.SAEBenchSize):
        runs.append(contender)
        rate = next(rates[contender])
        return bench.SAEBenchRow(contender, size.tokens, 100, 100 / rate, rate,
                                 len(runs) * 10.0, 0.5)

    monkeypatch.setattr(bench, "_worker", fake_worker)
    rows = bench._taking_turns({"a": ["a"], "b": ["b"]}, bench.SAEBenchSize(rounds=3))
    assert runs == ["a", "b"] * 3
    assert [(r.contender, r.activations_per_s, r.peak_rss_mib) for r in rows] == [
        ("a", 2.0, 50.0), ("b", 5.0, 60.0)]
