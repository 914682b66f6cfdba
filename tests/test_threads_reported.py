"""One shape for threads: every entry point takes `threads` (a count, "auto" or None), chooses
the count itself and reports it in what it returns; the command line only passes it through."""

import os

import pytest
import torch

from conftest import tiny_gpt
from glassgpt.config import SamplingConfig
from glassgpt.decoding.generate import stream_text
from glassgpt.experiments import run_experiment
from glassgpt.experiments.attention_maps import draw_prompt_attention
from glassgpt.machine import devices
from glassgpt.rundir.checkpoint import save_model
from glassgpt.tokenizers import CharTokenizer
from glassgpt.view.server import load_for_view

TEXT = "to be or not to be"
CANDIDATES = {1, os.cpu_count() or 1}  # what `auto` chooses between (devices.ThreadTuner)


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    """Each test may change torch's thread count; put it back. `auto` keeps a user's
    OMP_NUM_THREADS (the suite sets one), so it is unset here for `auto` to choose."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def tiny():
    tokenizer = CharTokenizer.from_text(TEXT)
    model = tiny_gpt(vocab_size=tokenizer.vocab_size, n_layer=1, dropout=0.0).eval()
    return model, tokenizer


@pytest.mark.parametrize("threads", [1, "auto"])
def test_an_experiment_reports_its_thread_count(tmp_path, threads):
    result = run_experiment("shapes", tmp_path, quick=True, threads=threads)
    assert result.threads == torch.get_num_threads()
    assert result.threads in ({1} if threads == 1 else CANDIDATES)
    assert result.to_dict()["threads"] == result.threads


@pytest.mark.parametrize("threads", [1, "auto"])
def test_the_attention_picture_reports_its_thread_count(tmp_path, tiny, threads):
    model, tokenizer = tiny
    drawn = draw_prompt_attention(model, tokenizer, "to be", tmp_path / "maps.png",
                                  threads=threads)
    assert drawn.shape == (1, 2, 5) and all(path.exists() for path in drawn.paths)
    assert drawn.threads in ({1} if threads == 1 else CANDIDATES)


@pytest.mark.parametrize("threads", [1, "auto"])
def test_the_view_reports_its_thread_count(tmp_path, tiny, threads):
    model, tokenizer = tiny
    save_model(tmp_path / "run", model, tokenizer)
    view = load_for_view(tmp_path / "run", threads=threads)
    assert view.threads in ({1} if threads == 1 else CANDIDATES)


@pytest.mark.parametrize("threads", [1, "auto"])
def test_a_sample_reports_its_thread_count(tiny, threads):
    model, tokenizer = tiny
    prompt = torch.tensor([tokenizer.encode("to")])
    pieces = stream_text(model, tokenizer, prompt, SamplingConfig(max_new_tokens=12, seed=0),
                         threads=threads)
    text = "".join(pieces)
    assert len(text) == 12
    assert pieces.threads in ({1} if threads == 1 else CANDIDATES)


def test_sample_times_auto_once_for_all_its_samples(tmp_path, tiny, monkeypatch, capsys):
    from glassgpt.cli import main

    model, tokenizer = tiny
    save_model(tmp_path / "run", model, tokenizer)
    built = []
    real_tuner_for = devices.tuner_for

    def counting_tuner_for(setting, device, **kwargs):
        built.append(setting)
        return real_tuner_for(setting, device, **kwargs)

    monkeypatch.setattr("glassgpt.decoding.generate.tuner_for", counting_tuner_for)
    assert main(["sample", str(tmp_path / "run"), "--num-samples", "3", "--max-new-tokens",
                 "10", "--prompt", "to", "--threads", "auto"]) == 0
    assert built[0] == "auto" and all(isinstance(setting, int) for setting in built[1:])
    assert len(built) == 3 and capsys.readouterr().out.count("-" * 40) == 2
