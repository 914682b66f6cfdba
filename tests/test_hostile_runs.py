"""Hostile run directories and Hugging Face directories (issue 11): nothing lost, nothing
followed, nothing unpickled.

The rows that one failing command and an unchanged disk prove live in test_bad_inputs.py; here
are those that need more: a writer that must succeed without writing through a planted link,
readers that must leave pending names alone, two writers at once, a read-only directory, and
Hugging Face imports proven never to reach `transformers`' loaders or a pickle. Each test
snapshots the run, the data and a directory outside both (helpers_dirs) and checks what changed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import cli_environment
from glassgpt.cli import main
from glassgpt.data import prepare
from glassgpt.errors import CheckpointError
from glassgpt.rundir.checkpoint import load_model
from glassgpt.storage import files
from glassgpt.tokenizers import BPETokenizer
from glassgpt.training.metrics import read_metrics
from helpers_cli import glassgpt, one_error_line
from helpers_dirs import assert_unchanged, changes, snapshot

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
        "--batch-size", "2", "--eval-iters", "1", "--log-interval", "1", "--device", "cpu"]
TEXT = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(100))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare(root / "data", root / "text.txt")
    return root / "data"


@pytest.fixture(scope="module")
def template(data, tmp_path_factory) -> Path:
    """A tiny run of 2 iterations, trained once (in-process: the CLI's own code)."""
    run = tmp_path_factory.mktemp("template") / "run"
    assert main(["train", "--data", str(data), "--out", str(run), "--max-iters", "2",
                 "--eval-interval", "2", *TINY]) == 0
    return run


@pytest.fixture()
def place(template, tmp_path) -> dict[str, Path]:
    """A copy of the run, and an `outside` directory holding a file a link may point to."""
    run = shutil.copytree(template, tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not glassgpt's")
    return {"run": run, "outside": outside}


# --- row 1: a planted pending link is removed as a link, never written through ---------------

def plant_pending_link(run: Path, outside: Path) -> None:
    (run / "checkpoint.journal").write_text("[]")
    (run / "model.safetensors.pending").symlink_to(outside / "secret.txt")


@pytest.mark.parametrize("how", [["--force", "--max-iters", "1"], ["--resume", "--max-iters", "3"]],
                         ids=["force", "resume"])
def test_a_planted_pending_link_is_never_written_through(how, place, data, capsys):
    run, outside = place["run"], place["outside"]
    plant_pending_link(run, outside)
    before = snapshot(outside, data)
    source = [] if "--resume" in how else ["--data", data, *TINY]
    code, err = glassgpt("train", "--out", run, *source, *how, capsys=capsys)
    assert code == 0, err
    assert_unchanged(before, snapshot(outside, data))
    assert files.entry_kind(run / "model.safetensors") == "file"
    assert not list(run.glob("*.pending")) and not (run / "checkpoint.journal").exists()
    load_model(run)


# --- row 10: readers touch nothing; a writer touches only its own pending names --------------

def test_readers_change_nothing_and_writers_drop_only_their_own_pending_files(place, data,
                                                                             capsys):
    run = place["run"]
    (run / "notes.pending").write_text("a user's notes")
    (run / "x.pending").mkdir()
    (run / "model.safetensors.pending").write_bytes(b"left by a crash before the journal")
    before = snapshot(run, data)
    for command in (["sample", run, "--max-new-tokens", "3", "--device", "cpu"],
                    ["eval", run, "--device", "cpu", "--max-batches", "1"],
                    ["convert", run, "--to-hf", place["outside"] / "hf"]):
        code, err = glassgpt(*command, capsys=capsys)
        assert code == 0, err
        assert_unchanged(before, snapshot(run, data))
    code, err = glassgpt("train", "--resume", "--out", run, "--max-iters", "3", capsys=capsys)
    assert code == 0, err
    assert (run / "notes.pending").read_text() == "a user's notes" and (run / "x.pending").is_dir()
    assert not (run / "model.safetensors.pending").exists()


# --- row 9, and row 4's "replace last, keep what is not the run's" -----------------------------

def test_a_dangling_metrics_link_is_replaced_under_force_never_followed(place, data, capsys):
    fresh, outside = place["run"], place["outside"]  # a run: --force replaces only runs
    (fresh / "metrics.jsonl").unlink()
    (fresh / "metrics.jsonl").symlink_to(outside / "metrics.jsonl")
    before = snapshot(outside)
    code, err = glassgpt("train", "--data", data, "--out", fresh, "--max-iters", "1", *TINY,
                         "--force", capsys=capsys)
    assert code == 0, err
    assert_unchanged(before, snapshot(outside))  # nothing written where the link pointed
    assert files.entry_kind(fresh / "metrics.jsonl") == "file"


def test_force_replaces_the_run_and_keeps_everything_else(place, data, capsys):
    run = place["run"]
    (run / "notes.txt").write_text("keep me")
    old_weights = (run / "model.safetensors").read_bytes()
    code, err = glassgpt("train", "--data", data, "--out", run, "--max-iters", "1", "--force",
                         *TINY, "--seed", "5", capsys=capsys)
    assert code == 0, err
    assert (run / "notes.txt").read_text() == "keep me"
    assert (run / "model.safetensors").read_bytes() != old_weights
    assert [r["iter"] for r in read_metrics(run) if "loss" in r] == [1]  # a new log


# --- metrics.jsonl lines a crash or a hand broke ---------------------------------------------

def test_malformed_metrics_lines_are_dropped_when_resuming(place, capsys):
    run = place["run"]
    with open(run / "metrics.jsonl", "a") as log:
        log.write('{"iter": 1, "loss": "x"}\n[1]\n{"iter": "2"}\n' + "[" * 100_000 + "\n")
        log.write('{"iter": 2, "loss": NaN}\n{"iter": 1, "loss": 3.1, "lr"')  # cut short
    code, err = glassgpt("train", "--resume", "--out", run, "--max-iters", "3", capsys=capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in records if "loss" in r] == [1, 2, 3]
    assert all(isinstance(r["loss"], float) for r in records if "loss" in r)


# --- read-only places ------------------------------------------------------------------------

READ_ONLY_COMMANDS = {
    "train --resume": lambda p, data: (p["run"], ["train", "--resume", "--out", p["run"],
                                                  "--max-iters", "3"]),
    "train --force": lambda p, data: (p["run"], ["train", "--data", data, "--out", p["run"],
                                                 "--force", *TINY]),
    "convert --to-hf": lambda p, data: (p["outside"], ["convert", p["run"], "--to-hf",
                                                       p["outside"] / "hf"]),
}


@pytest.mark.parametrize("command", READ_ONLY_COMMANDS)
def test_a_read_only_place_is_one_line_before_any_work(command, place, data, capsys,
                                                       monkeypatch):
    """`os.access` says what a read-only mount (or chmod, for a non-root user) would say."""
    read_only, argv = READ_ONLY_COMMANDS[command](place, data)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == read_only
                        else real_access(path, mode, **kw))
    before = snapshot(place["run"], place["outside"], data)
    code, err = glassgpt(*argv, capsys=capsys)
    assert code == 2 and "is not writable" in one_error_line(err)
    assert_unchanged(before, snapshot(place["run"], place["outside"], data))


def test_a_lock_that_cannot_be_taken_is_one_line(place, capsys, monkeypatch):
    """The file system turns read-only after the checks: the lock's open fails."""
    run = place["run"]
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).parent == run:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    before = snapshot(run)
    code, err = glassgpt("train", "--resume", "--out", run, "--max-iters", "3", capsys=capsys)
    monkeypatch.undo()
    assert code == 2 and "Read-only file system" in one_error_line(err)
    assert_unchanged(before, snapshot(run))


# --- row 8: two writers, one run directory ---------------------------------------------------

def wait_for(condition, process: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.02)


def locked(run: Path) -> bool:
    try:
        files.check_unlocked(run, CheckpointError)
    except CheckpointError:
        return True
    return False


def test_a_second_writer_is_refused_with_one_line(place, data, shakespeare_path, capsys):
    run = place["run"]
    (run / "metrics.jsonl").unlink()  # so that it appears once the first writer trains
    env = cli_environment(shakespeare_path, place["outside"] / "cache")
    first = subprocess.Popen([sys.executable, "-m", "glassgpt", "train", "--data", str(data),
                              "--out", str(run), "--force", *TINY, "--max-iters", "100000",
                              "--eval-interval", "100000"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: locked(run) and (run / ".glassgpt.lock").read_text() == str(first.pid),
                 first)
        for second in (["train", "--data", data, "--out", run, "--force", *TINY],
                       ["train", "--resume", "--out", run]):
            code, err = glassgpt(*second, capsys=capsys)
            assert code == 2
            assert f"in use by another glassgpt process (pid {first.pid})" in one_error_line(err)
        wait_for(lambda: (run / "metrics.jsonl").exists(), first)  # the first one trains on
    finally:
        first.send_signal(signal.SIGINT)
        _, stderr = first.communicate(timeout=60)
    assert first.returncode == 130, stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["iter"] for r in records if "loss" in r]  # one writer: every step once, in order
    assert steps == list(range(1, len(steps) + 1))
    load_model(run)


# --- row 2 and row 7: Hugging Face directories -----------------------------------------------

@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_source(transformers, tmp_path_factory) -> Path:
    """A tiny random GPT-2 with a BPE tokenizer, as save_pretrained writes it."""
    tokenizer = BPETokenizer.train(TEXT, 300)
    config = transformers.GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=16, n_embd=16,
                                     n_layer=2, n_head=2, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "source"
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save(path / "tokenizer.json")
    return path


@pytest.fixture()
def no_pickle_no_transformers_loading(transformers, monkeypatch) -> list[str]:
    """Every loader that could unpickle, or that hands a directory to transformers, fails the
    test if called; the list names those that were."""
    called: list[str] = []

    def forbidden(name):
        def refuse(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"{name} must never be called by an import")
        return refuse

    for owner, name in [(transformers.GPT2LMHeadModel, "from_pretrained"),
                        (transformers.PreTrainedModel, "from_pretrained"),
                        (transformers.AutoConfig, "from_pretrained"),
                        (transformers.AutoTokenizer, "from_pretrained"),
                        (transformers.PreTrainedTokenizerFast, "from_pretrained"),
                        (torch, "load")]:
        monkeypatch.setattr(owner, name, forbidden(f"{getattr(owner, '__name__', owner)}.{name}"))
    return called


def hf_copy(hf_source: Path, tmp_path: Path) -> Path:
    return shutil.copytree(hf_source, tmp_path / "hf")


def only_a_pickle(hf: Path) -> None:
    torch.save(load_file(hf / "model.safetensors"), hf / "pytorch_model.bin")  # real pickle
    (hf / "model.safetensors").unlink()


def index_to(target: str, make: str | None = None):
    """An index whose weight map points at `target` (created as a copy of the weights when
    `make` names where)."""
    def damage(hf: Path) -> None:
        weights = hf / "model.safetensors"
        if make == "pickle":
            only_a_pickle(hf)
        elif make is not None:
            (hf / make).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(weights, hf / make)
        weights.unlink(missing_ok=True)
        names = ["transformer.wte.weight", "transformer.wpe.weight"]
        (hf / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, target)}))
    return damage


def weights_linked_outside(hf: Path) -> None:
    outside = hf.parent / "outside"
    outside.mkdir()
    shutil.move(hf / "model.safetensors", outside / "model.safetensors")
    (hf / "model.safetensors").symlink_to(outside / "model.safetensors")


def edit_hf_config(**values):
    def damage(hf: Path) -> None:
        config = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**config, **values}))
    return damage


def edit_hf_weights(change):
    def damage(hf: Path) -> None:
        tensors = load_file(hf / "model.safetensors")
        change(tensors)
        save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return damage


DEEP = "[" * 100_000 + "]" * 100_000
HF_ROWS = {
    "only pytorch_model.bin": (only_a_pickle, "holds only pickled weights (pytorch_model.bin)"),
    "an index naming pytorch_model.bin": (index_to("pytorch_model.bin", make="pickle"),
                                          "names 'pytorch_model.bin'; only .safetensors files"),
    "an index naming ../other/model.safetensors": (
        index_to("../other/model.safetensors", make="../other/model.safetensors"),
        "names '../other/model.safetensors'; only .safetensors files inside"),
    "an index naming an absolute path": (index_to("/etc/passwd"), "names '/etc/passwd'"),
    "weights that are a link out of the directory": (weights_linked_outside,
                                                     "is a symbolic link"),
    "a tensor missing": (edit_hf_weights(lambda t: t.pop("transformer.h.1.mlp.c_fc.bias")),
                         "missing from the weights: ['transformer.h.1.mlp.c_fc.bias']"),
    "n_layer 100000 over two layers": (edit_hf_config(n_layer=100_000),
                                       "missing from the weights: ['transformer.h.2.ln_1.weight'"),
    "a config with more layers than the weights": (edit_hf_config(n_layer=3),
                                                   "n_layer=3; the files hold"),
    "vocab_size 1e30": (edit_hf_config(vocab_size=1e30), "vocab_size must be an integer"),
    "n_embd '32'": (edit_hf_config(n_embd="32"), "n_embd must be an integer, got '32'"),
    "layer_norm_epsilon -1": (edit_hf_config(layer_norm_epsilon=-1), "norm_eps must be positive"),
    "tie_word_embeddings 'yes'": (edit_hf_config(tie_word_embeddings="yes"), "true or false"),
    "config.json nested 100,000 deep": (lambda hf: (hf / "config.json").write_text(DEEP),
                                        "nested too deeply"),
    "tokenizer.json nested 100,000 deep": (lambda hf: (hf / "tokenizer.json").write_text(DEEP),
                                           "nested too deeply"),
    "a NaN among the weights": (
        edit_hf_weights(lambda t: t["transformer.h.0.ln_1.weight"].fill_(float("nan"))),
        "transformer.h.0.ln_1.weight holds 16 NaN or infinite values"),
    "int64 weights": (edit_hf_weights(lambda t: t.update(
        {"transformer.ln_f.bias": t["transformer.ln_f.bias"].long()})), "has dtype I64"),
}


@pytest.mark.parametrize("row", HF_ROWS)
def test_a_hostile_hf_directory_is_one_line_and_reaches_no_loader(
        row, hf_source, tmp_path, capsys, no_pickle_no_transformers_loading):
    damage, message = HF_ROWS[row]
    hf = hf_copy(hf_source, tmp_path)
    damage(hf)
    before = snapshot(tmp_path)
    start = time.perf_counter()
    code, err = glassgpt("convert", "--from-hf", hf, "--out", tmp_path / "run", capsys=capsys)
    assert code == 2 and message in one_error_line(err)
    assert time.perf_counter() - start < 5  # n_layer=100000 is named, never built
    assert_unchanged(before, snapshot(tmp_path))  # no run directory, nothing else
    assert no_pickle_no_transformers_loading == []


def test_sharded_safetensors_import_without_transformers_loading_anything(
        hf_source, tmp_path, capsys, no_pickle_no_transformers_loading):
    """The good case, through the same guard: two shards and their index."""
    hf = hf_copy(hf_source, tmp_path)
    tensors = load_file(hf / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, hf / shard)
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: shard for shard, part in shards.items() for n in part}}))
    code, err = glassgpt("convert", "--from-hf", hf, "--out", tmp_path / "run", capsys=capsys)
    assert code == 0, err
    assert no_pickle_no_transformers_loading == []
    model, _ = load_model(tmp_path / "run")
    assert torch.equal(model.tok_emb.weight, tensors["transformer.wte.weight"])


def test_gpt2s_vocab_and_merges_give_the_same_tokenizer_without_transformers(
        hf_source, tmp_path, capsys, no_pickle_no_transformers_loading):
    """A directory with vocab.json and merges.txt (GPT-2's own layout), no tokenizer.json."""
    hf = hf_copy(hf_source, tmp_path)
    original = BPETokenizer.from_json((hf / "tokenizer.json").read_text())
    original.tokenizer.model.save(str(hf))  # vocab.json, merges.txt
    (hf / "tokenizer.json").unlink()
    code, err = glassgpt("convert", "--from-hf", hf, "--out", tmp_path / "run", capsys=capsys)
    assert code == 0, err
    _, tokenizer = load_model(tmp_path / "run")
    text = "To be or not to be, that is the question.<|endoftext|>"
    assert tokenizer.encode(text) == original.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert no_pickle_no_transformers_loading == []


def test_a_hub_snapshot_is_read_through_its_cache_links_only(hf_source, tmp_path, capsys,
                                                              monkeypatch):
    """huggingface_hub's cache: snapshot files are links into the repository's blob store.
    Those are followed; a link out of the store is refused."""
    repo = tmp_path / "hf-home" / "hub" / "models--tiny--gpt2"
    snapshot_dir, blobs = repo / "snapshots" / "abc", repo / "blobs"
    blobs.mkdir(parents=True)
    snapshot_dir.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    for i, source in enumerate(sorted(hf_source.iterdir())):
        shutil.copy(source, blobs / f"blob{i}")
        (snapshot_dir / source.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    constants = pytest.importorskip("huggingface_hub.constants")  # read the environment once
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, err = glassgpt("convert", "--from-hf", "tiny/gpt2", "--out", tmp_path / "run",
                         capsys=capsys)
    assert code == 0, err
    (snapshot_dir / "tokenizer.json").unlink()
    (tmp_path / "elsewhere.json").write_text("{}")
    (snapshot_dir / "tokenizer.json").symlink_to(tmp_path / "elsewhere.json")
    code, err = glassgpt("convert", "--from-hf", "tiny/gpt2", "--out", tmp_path / "run2",
                         capsys=capsys)
    assert code == 2 and "links outside the Hugging Face cache" in one_error_line(err)


def test_nothing_changed_helper_names_what_changed(tmp_path):
    """The helper itself: a write through a link, a new file and a removed one all show."""
    (tmp_path / "a").write_text("1")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    before = snapshot(tmp_path)
    (tmp_path / "link").write_text("2")  # through the link
    (tmp_path / "new").write_text("")
    after = snapshot(tmp_path)
    assert set(changes(before, after)) == {str(tmp_path / "a"), str(tmp_path / "new")}
