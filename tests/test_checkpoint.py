"""Run directories: safetensors + JSON, validated on load, committed all or nothing."""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_gpt
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.model import GPT
from glassgpt.rundir import checkpoint
from glassgpt.rundir import directory as rundir
from glassgpt.rundir.checkpoint import (
    TrainState,
    load_model,
    load_train_state,
    save_checkpoint,
    save_model,
)
from glassgpt.rundir.trainstate import capture_rng_state, restore_rng_state
from glassgpt.storage import files, layout
from glassgpt.tokenizers import CharTokenizer
from helpers_dirs import assert_unchanged, snapshot

TOKENIZER = CharTokenizer.from_text("abcdefghij \n")


def tiny_model(**overrides) -> GPT:
    """The shared tiny GPT over this module's characters, context 8, width 8."""
    return tiny_gpt(**{"vocab_size": TOKENIZER.vocab_size, "block_size": 8, "n_embd": 8,
                       **overrides})


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_and_load_model(tmp_path):
    model = tiny_model()
    save_model(tmp_path / "run", model, TOKENIZER, extra={"source": "test"})
    loaded, tokenizer = load_model(tmp_path / "run")
    assert same_weights(model, loaded) and not loaded.training
    assert tokenizer.encode("abc") == TOKENIZER.encode("abc")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"] == model.config.to_dict() and config["extra"] == {"source": "test"}


def test_tied_weights_are_stored_once_and_tied_again(tmp_path):
    save_model(tmp_path, tiny_model(), TOKENIZER)
    names = load_file(tmp_path / "model.safetensors")
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    loaded, _ = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.tok_emb.weight


def test_untied_head_is_stored(tmp_path):
    model = tiny_model(tie_weights=False)
    save_model(tmp_path, model, TOKENIZER)
    assert "lm_head.weight" in load_file(tmp_path / "model.safetensors")
    assert same_weights(model, load_model(tmp_path)[0])


@pytest.mark.slow
def test_wrapped_models_save_without_prefixes(tmp_path):
    model = tiny_model()
    save_model(tmp_path, torch.compile(model), TOKENIZER)  # compiles lazily: no work here
    names = load_file(tmp_path / "model.safetensors")
    assert not any(n.startswith(("_orig_mod.", "module.")) for n in names)
    assert same_weights(model, load_model(tmp_path)[0])


def test_missing_run_and_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        load_model(tmp_path)
    save_model(tmp_path, tiny_model(), TOKENIZER)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_model(tmp_path)


def test_pickle_files_are_refused(tmp_path):
    model = tiny_model()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="never loads pickle"):
        load_model(tmp_path / "model.pt")
    save_model(tmp_path / "run", model, TOKENIZER)
    (tmp_path / "run" / "model.safetensors").write_bytes(pickle.dumps(model.state_dict()))
    with pytest.raises(CheckpointError, match="not a valid safetensors"):
        load_model(tmp_path / "run")


def test_truncated_weights(tmp_path):
    save_model(tmp_path, tiny_model(), TOKENIZER)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)


def test_shapes_must_match_the_config(tmp_path):
    save_model(tmp_path, tiny_model(), TOKENIZER)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model"]["n_embd"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda text: text[:-5], "not valid JSON"),
    (lambda text: text.replace('"extra"', '"surprise"'), "unknown keys"),
    (lambda text: text.replace('"n_layer": 2', '"n_layers": 2'), "unknown model config"),
])
def test_bad_config_json(tmp_path, edit, message):
    save_model(tmp_path, tiny_model(), TOKENIZER)
    path = tmp_path / "config.json"
    path.write_text(edit(path.read_text()))
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(tmp_path)
    assert str(path) in str(info.value)


def trained_state(model: GPT) -> TrainState:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, TOKENIZER.vocab_size, (2, 8))
    model(x, x)[1].backward()
    optimizer.step()
    sampler = torch.Generator().manual_seed(5)
    return TrainState(iteration=7, best_val_loss=1.5, optimizer=optimizer.state_dict(),
                      rng=[capture_rng_state(sampler.get_state())])


def test_train_state_round_trip(tmp_path):
    model = tiny_model()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = trained_state(model)
    save_checkpoint(tmp_path, model, TOKENIZER, {"lr": 1e-3}, "data", state)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    loaded = load_train_state(tmp_path)
    assert loaded.iteration == 7 and loaded.best_val_loss == 1.5
    sampler_state = restore_rng_state(loaded.rng[0])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert torch.equal(sampler_state, state.rng[0]["sampler"])
    saved, restored = state.optimizer, loaded.optimizer
    assert saved["param_groups"] == restored["param_groups"]
    for param_id, values in saved["state"].items():
        for name, value in values.items():
            assert torch.equal(restored["state"][param_id][name], value)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(restored)  # torch accepts it


def test_a_run_without_train_state_cannot_be_resumed(tmp_path):
    save_model(tmp_path, tiny_model(), TOKENIZER)
    with pytest.raises(CheckpointError, match="--init-from"):
        load_train_state(tmp_path)


def test_a_crash_before_the_commit_point_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    old, new = tiny_model(), tiny_model()
    save_model(tmp_path, old, TOKENIZER)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(files, "write_text_atomic", crash)  # the journal write fails
    with pytest.raises(checkpoint.CheckpointError, match="disk full"):
        save_model(tmp_path, new, TOKENIZER)
    monkeypatch.undo()
    assert same_weights(load_model(tmp_path)[0], old)
    assert not list(tmp_path.glob("*.pending"))


def test_a_crash_after_the_commit_point_finishes_the_new_checkpoint(tmp_path, monkeypatch):
    old, new = tiny_model(), tiny_model()
    save_model(tmp_path, old, TOKENIZER)
    real_replace, calls = os.replace, []

    def crash_after_one_rename(src, dst):
        if str(src).endswith(".pending"):  # the journal's own atomic write passes
            if calls:
                raise OSError("power cut")
            calls.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_after_one_rename)
    with pytest.raises(CheckpointError, match="the next `train --resume` finishes"):
        save_model(tmp_path, new, TOKENIZER)
    monkeypatch.undo()
    assert (tmp_path / layout.RUN_JOURNAL).exists()  # half renamed, journal present
    listing = sorted(p.name for p in tmp_path.iterdir())
    assert same_weights(load_model(tmp_path)[0], new)  # a reader sees the new checkpoint...
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # ...and changes nothing
    rundir.recover_interrupted_commit(tmp_path)  # a writer finishes the commit
    assert not (tmp_path / layout.RUN_JOURNAL).exists()
    assert not list(tmp_path.glob("*.pending"))
    assert same_weights(load_model(tmp_path)[0], new)


@pytest.mark.parametrize(("device", "message"), [
    ("banana", "unknown device 'banana'"),
    ("meta", "cannot train or sample here"),
    ("cuda:99", "CUDA is not available here|this machine has"),
])
def test_a_device_that_cannot_hold_the_model_is_a_config_error(tmp_path, device, message):
    save_model(tmp_path, tiny_model(), TOKENIZER)
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path, device=device)


def test_loading_never_changes_a_run_directory(tmp_path):
    """Stale pending files, a user's *.pending notes and a pending directory stay as they are."""
    save_model(tmp_path, tiny_model(), TOKENIZER)
    (tmp_path / "model.safetensors.pending").write_bytes(b"left by a crash")
    (tmp_path / "notes.pending").write_text("mine")
    (tmp_path / "x.pending").mkdir()
    before = snapshot(tmp_path)
    load_model(tmp_path)
    assert_unchanged(before, snapshot(tmp_path))


def test_a_best_val_loss_never_measured_round_trips(tmp_path):
    """inf (no evaluation yet, e.g. a Ctrl-C before the first) is saved as null: JSON has no
    Infinity, and the bounded reader refuses one."""
    model = tiny_model()
    state = trained_state(model)
    state.best_val_loss = float("inf")
    save_checkpoint(tmp_path, model, TOKENIZER, {}, None, state)
    assert json.loads((tmp_path / "train_state.json").read_text())["best_val_loss"] is None
    assert load_train_state(tmp_path).best_val_loss == float("inf")
