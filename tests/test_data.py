"""Corpora, prepared data directories and the batch sampler."""

from __future__ import annotations

import bz2
import hashlib
import json
import os
import socket
from importlib import resources

import numpy as np
import pytest
import torch

from glassgpt.data import (
    TINYSHAKESPEARE_SHA256,
    BatchSampler,
    Corpus,
    PreparedData,
    cache_dir,
    find_text_files,
    id_dtype,
    is_prepared_from,
    packaged_tinyshakespeare,
    prepare,
    prepared_tinyshakespeare,
    sequential_batches,
    sha256_of,
    tinyshakespeare,
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
    assert meta["dtype"] == "uint16" and meta["text_bytes"] == len(text.encode())
    assert meta["sha256"] == sha256_of(small_text) and meta["source"] == str(small_text)
    assert sorted(p.name for p in out.iterdir()) == [".glassgpt.lock", "meta.json",
                                                     "tokenizer.json", "train.bin", "val.bin"]
    assert is_prepared_from(out, small_text)


def test_prepare_with_bpe(tmp_path, small_text):
    meta = prepare(tmp_path / "data", small_text, tokenizer="bpe", vocab_size=300)
    prepared = PreparedData(tmp_path / "data")
    assert meta["tokenizer"] == "bpe" and prepared.vocab_size == 300
    ids = np.concatenate([prepared.splits["train"], prepared.splits["val"]]).tolist()
    assert prepared.tokenizer.decode(ids) == small_text.read_text(encoding="utf-8")


def test_ids_are_uint32_only_when_the_vocabulary_needs_it():
    assert id_dtype(65) == np.uint16 and id_dtype(65536) == np.uint16
    assert id_dtype(65537) == np.uint32


def test_text_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="not found"):
        Corpus.from_paths(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="no text file matches"):
        Corpus.from_paths(str(tmp_path / "*.md"))
    with pytest.raises(DataError, match="is a directory"):
        Corpus.from_paths(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(DataError, match=f"{empty} is empty"):
        list(Corpus.from_paths(empty).blocks(1024))
    latin1 = tmp_path / "latin1.txt"
    # "x" first: block ends (every 4096 bytes) fall inside a two-byte "é".
    latin1.write_bytes(b"x" + "é".encode() * 5000 + "café".encode("latin-1"))
    with pytest.raises(DataError, match=r"not UTF-8 text \(byte 10004: b'\\xe9'\)"):
        list(Corpus.from_paths(latin1).blocks(4096))  # the error is in the third block


def test_a_fifo_is_refused_rather_than_read_forever(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(DataError, match="not a regular file"):
        Corpus.from_paths(tmp_path / "fifo")


def test_patterns_expand_sorted_and_each_file_counts_once(tmp_path):
    for name in ("b.txt", "a.txt", "sub/c.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name, encoding="utf-8")
    files = find_text_files([str(tmp_path / "*.txt"), tmp_path / "a.txt",
                             str(tmp_path / "**" / "c.txt")])
    assert [f.name for f in files] == ["a.txt", "b.txt", "c.txt"]
    corpus = Corpus.from_paths([str(tmp_path / "*.txt"), str(tmp_path / "sub" / "*")])
    assert "".join(corpus.blocks(2)) == "a.txtb.txtsub/c.txt"
    assert corpus.sha256 == hashlib.sha256(b"a.txtb.txtsub/c.txt").hexdigest()


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


# --- Tiny Shakespeare -----------------------------------------------------------------------

@pytest.fixture()
def offline(monkeypatch, tmp_path):
    """No environment variable, an empty cache, and no network at all."""
    monkeypatch.delenv("GLASSGPT_TINYSHAKESPEARE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def no_network(*args, **kwargs):
        raise AssertionError("glassgpt tried to use the network")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)


def test_the_packaged_copy_is_compressed_and_checked():
    packed = resources.files("glassgpt").joinpath("corpora/tinyshakespeare.txt.bz2")
    assert len(packed.read_bytes()) < 400_000
    text = packaged_tinyshakespeare()
    assert len(text) == 1_115_394
    assert hashlib.sha256(text).hexdigest() == TINYSHAKESPEARE_SHA256


def test_a_damaged_packaged_copy_is_an_error(monkeypatch, tmp_path):
    fake = tmp_path / "glassgpt"
    (fake / "corpora").mkdir(parents=True)
    (fake / "corpora" / "tinyshakespeare.txt.bz2").write_bytes(bz2.compress(b"To be" * 10))
    monkeypatch.setattr(resources, "files", lambda package: fake)
    with pytest.raises(DataError, match="is not Tiny Shakespeare: sha256"):
        packaged_tinyshakespeare()


def test_offline_and_without_settings_the_package_provides_the_corpus(offline, tmp_path):
    data, source = tinyshakespeare()
    assert hashlib.sha256(data).hexdigest() == TINYSHAKESPEARE_SHA256
    assert source.endswith("tinyshakespeare.txt.bz2")
    meta = prepare(tmp_path / "data")  # no text: Tiny Shakespeare, character level
    assert meta["train_tokens"] == 1_003_854 and meta["sha256"] == TINYSHAKESPEARE_SHA256
    assert not (tmp_path / "cache").exists()  # reading it needs no cache at all
    path = tinyshakespeare_path()  # a plain file, for callers that want one
    assert path == tmp_path / "cache" / "glassgpt" / "tinyshakespeare.txt"
    assert sha256_of(path) == TINYSHAKESPEARE_SHA256


def test_the_environment_then_the_cache_win_over_the_package(offline, monkeypatch, tmp_path,
                                                            shakespeare_path):
    cached = tmp_path / "cache" / "glassgpt" / "tinyshakespeare.txt"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(shakespeare_path.read_bytes())
    assert tinyshakespeare()[1] == str(cached) and tinyshakespeare_path() == cached
    monkeypatch.setenv("GLASSGPT_TINYSHAKESPEARE", str(shakespeare_path))
    assert tinyshakespeare()[1] == str(shakespeare_path)
    assert tinyshakespeare_path() == shakespeare_path


def test_a_copy_with_the_wrong_contents(offline, monkeypatch, tmp_path, small_text):
    monkeypatch.setenv("GLASSGPT_TINYSHAKESPEARE", str(small_text))
    with pytest.raises(DataError, match="is not Tiny Shakespeare: 10,290 bytes"):
        tinyshakespeare()
    huge = tmp_path / "huge.txt"  # sparse: 64 GiB that cost no disk, never read
    with open(huge, "wb") as file:
        file.truncate(64 * 2**30)
    monkeypatch.setenv("GLASSGPT_TINYSHAKESPEARE", str(huge))
    with pytest.raises(DataError, match="68,719,476,736 bytes"):
        tinyshakespeare_path()
    same_size = tmp_path / "same_size.txt"
    same_size.write_bytes(b"x" * 1_115_394)
    monkeypatch.setenv("GLASSGPT_TINYSHAKESPEARE", str(same_size))
    with pytest.raises(DataError, match="sha256"):
        tinyshakespeare()


def test_a_cache_that_is_a_file_is_one_clear_error(offline, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    with pytest.raises(DataError, match="the cache directory is unusable"):
        cache_dir()
    with pytest.raises(DataError, match="cache directory is unusable"):
        prepared_tinyshakespeare()
    assert tinyshakespeare()[0]  # reading needs no cache


def test_the_default_data_directory_is_prepared_once_and_repaired(offline, tmp_path):
    data_dir = prepared_tinyshakespeare()
    assert data_dir == tmp_path / "cache" / "glassgpt" / "data" / "tinyshakespeare-char"
    stamp = (data_dir / "train.bin").stat().st_mtime_ns
    assert prepared_tinyshakespeare() == data_dir
    assert (data_dir / "train.bin").stat().st_mtime_ns == stamp  # not prepared again
    (data_dir / "val.bin").write_bytes(b"\x00")  # damaged: prepared again, not an error
    assert PreparedData(prepared_tinyshakespeare()).meta["val_tokens"] == 111_540


# --- batches --------------------------------------------------------------------------------

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


def test_batches_with_an_id_outside_the_vocabulary_are_refused_on_the_host():
    """The batch sampler checks each batch's ids before they go to the device, so the model
    never has to read them back."""
    import numpy as np

    from glassgpt.data import BatchSampler, sequential_batches
    from glassgpt.errors import DataError

    ids = np.array([0, 1, 2, 3, 9, 1, 2, 3] * 4, dtype=np.uint16)
    with pytest.raises(DataError, match="token id 9, outside the vocabulary \\[0, 5\\)"):
        for _ in range(20):
            BatchSampler(ids, 4, 4, seed=0, vocab_size=5).next_batch()
    with pytest.raises(DataError, match="token id 9"):
        list(sequential_batches(ids, 4, 2, 10, vocab_size=5))
    assert BatchSampler(ids, 4, 4, seed=0, vocab_size=10).next_batch()[0].shape == (4, 4)
