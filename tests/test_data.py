"""Corpora, prepared data directories and the batch sampler."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch

from glassgpt import data
from glassgpt.data import (
    TINYSHAKESPEARE_SHA256,
    BatchSampler,
    PreparedData,
    id_dtype,
    prepare,
    read_text,
    sequential_batches,
    tinyshakespeare_path,
)
from glassgpt.errors import DataError
from glassgpt.tokenizers import load_tokenizer


def test_prepare_writes_ids_tokenizer_and_meta(tmp_path, small_text):
    out = tmp_path / "data"
    meta = prepare(out, small_text, val_fraction=0.1)
    text = small_text.read_text(encoding="utf-8")
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert len(train) + len(val) == len(text)
    assert len(train) == int(len(text) * 0.9)
    tok = load_tokenizer(out / "tokenizer.json")
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text
    saved = json.loads((out / "meta.json").read_text())
    assert saved == meta
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == len(set(text))
    assert meta["train_tokens"] == len(train) and meta["val_tokens"] == len(val)
    assert meta["dtype"] == "uint16"
    assert meta["sha256"] == data.sha256_of(small_text)


def test_prepare_with_bpe(tmp_path, small_text):
    meta = prepare(tmp_path / "data", small_text, tokenizer="bpe", vocab_size=300)
    prepared = PreparedData(tmp_path / "data")
    assert meta["tokenizer"] == "bpe" and prepared.vocab_size == 300
    ids = np.concatenate([prepared.splits["train"], prepared.splits["val"]]).tolist()
    assert prepared.tokenizer.decode(ids) == small_text.read_text(encoding="utf-8")


def test_ids_are_uint32_only_when_the_vocabulary_needs_it():
    assert id_dtype(65) == np.uint16 and id_dtype(65536) == np.uint16
    assert id_dtype(65537) == np.uint32


def test_read_text_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_text(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(DataError, match="empty") as info:
        read_text(empty)
    assert str(empty) in str(info.value)
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        read_text(binary)


def test_text_too_short_for_the_context(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefghij" * 3, encoding="utf-8")
    prepare(tmp_path / "data", tmp_path / "t.txt")
    prepared = PreparedData(tmp_path / "data")
    prepared.check_block_size(2)
    with pytest.raises(DataError, match="block_size=64"):
        prepared.check_block_size(64)


def test_not_a_data_directory(tmp_path):
    with pytest.raises(DataError, match="glassgpt prepare"):
        PreparedData(tmp_path)


def test_tinyshakespeare_from_the_environment(monkeypatch, shakespeare_path):
    monkeypatch.setenv("GLASSGPT_TINYSHAKESPEARE", str(shakespeare_path))
    assert tinyshakespeare_path() == shakespeare_path
    assert data.sha256_of(shakespeare_path) == TINYSHAKESPEARE_SHA256


def test_tinyshakespeare_with_the_wrong_contents(monkeypatch, small_text):
    monkeypatch.setenv("GLASSGPT_TINYSHAKESPEARE", str(small_text))
    with pytest.raises(DataError, match="sha256"):
        tinyshakespeare_path()


def test_offline_without_a_copy_says_how_to_provide_one(monkeypatch, tmp_path):
    monkeypatch.delenv("GLASSGPT_TINYSHAKESPEARE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match="GLASSGPT_TINYSHAKESPEARE=PATH"):
        tinyshakespeare_path()


def test_download_goes_to_the_cache_and_is_checked(monkeypatch, tmp_path, shakespeare_path):
    monkeypatch.delenv("GLASSGPT_TINYSHAKESPEARE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    served = shakespeare_path.read_bytes()

    class Response:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return served

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: Response())
    path = tinyshakespeare_path()
    assert path == tmp_path / "glassgpt" / "tinyshakespeare.txt"
    assert path.read_bytes() == served
    monkeypatch.setattr(urllib.request, "urlopen", None)  # the cached copy needs no network
    assert tinyshakespeare_path() == path


def test_batches_are_shifted_windows_of_the_ids():
    ids = np.arange(1000, dtype=np.uint16)
    x, y = BatchSampler(ids, block_size=8, batch_size=4, seed=0).next_batch()
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    assert torch.equal(y, x + 1)  # the target is the next token
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows


def test_batch_sampler_is_seeded_and_resumable():
    ids = np.random.default_rng(0).integers(0, 65, 5000).astype(np.uint16)
    first = BatchSampler(ids, 16, 4, seed=7)
    again = BatchSampler(ids, 16, 4, seed=7)
    other = BatchSampler(ids, 16, 4, seed=8)
    a, b = first.next_batch()[0], again.next_batch()[0]
    assert torch.equal(a, b) and not torch.equal(a, other.next_batch()[0])
    state = first.get_state()
    expected = first.next_batch()[0]
    resumed = BatchSampler(ids, 16, 4, seed=123)
    resumed.set_state(state)
    assert torch.equal(resumed.next_batch()[0], expected)


def test_sequential_batches_cover_non_overlapping_windows():
    ids = np.arange(101, dtype=np.uint16)
    batches = list(sequential_batches(ids, block_size=10, batch_size=3, max_batches=10))
    xs = torch.cat([x for x, _ in batches])
    assert xs.shape == (10, 10) and torch.equal(xs.flatten(), torch.arange(100))
    assert len(list(sequential_batches(ids, 10, 3, max_batches=2))) == 2
