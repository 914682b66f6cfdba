"""Data directories a user can trust: refused targets, whole commits, damaged files.

Every bad input ends in exactly one `error:` line, exit code 2, and not one byte changed on
disk; a data directory is replaced as a whole or not at all, whatever moment a crash picks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from glassgpt.cli import main
from glassgpt.config import GPTConfig
from glassgpt.data import PreparedData, pipeline, prepare
from glassgpt.errors import DataError
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import save_model
from glassgpt.storage import commit
from glassgpt.storage.layout import DATA
from glassgpt.tokenizers import BPETokenizer

TEXT = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(100))
OTHER_TEXT = "".join(f"All the world's a stage {i}, and all the men players.\n"
                     for i in range(150))


def tree(root: Path) -> dict[str, str]:
    """Every file under `root` (hidden ones too) -> sha256 of its bytes (of its size and time
    for a huge one)."""
    return {str(p.relative_to(root)): fingerprint(p) for p in sorted(root.rglob("*"))
            if p.is_file()}


def fingerprint(path: Path) -> str:
    stat = path.stat()
    if stat.st_size > 2**26:
        return f"{stat.st_size} bytes, modified {stat.st_mtime_ns}"
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def place(tmp_path) -> Path:
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "other.txt").write_text(OTHER_TEXT, encoding="utf-8")
    prepare(tmp_path / "data", tmp_path / "text.txt")
    return tmp_path


def fails_cleanly(argv: list, message: str, root: Path, capsys) -> None:
    """`glassgpt ARGV` exits 2 with one line naming `message`, and nothing under root
    changes."""
    before = tree(root)
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert tree(root) == before


def a_run(directory: Path, tokenizer) -> Path:
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=8, n_layer=1, n_head=2,
                       n_embd=8)
    save_model(directory, GPT(config), tokenizer)
    return directory


def test_prepare_never_writes_into_a_run(place, capsys):
    run = a_run(place / "run", PreparedData(place / "data").tokenizer)
    for force in ([], ["--force"]):
        fails_cleanly(["prepare", "--text", place / "other.txt", "--out", run, *force],
                      "is a run directory (it holds config.json)", place, capsys)


def test_an_existing_data_directory_needs_force(place, capsys):
    fails_cleanly(["prepare", "--text", place / "other.txt", "--out", place / "data"],
                  "already holds prepared data; pass --force", place, capsys)
    assert main(["prepare", "--text", str(place / "other.txt"), "--out", str(place / "data"),
                 "--force"]) == 0
    data = PreparedData(place / "data")
    ids = np.concatenate([data.splits["train"], data.splits["val"]]).tolist()
    assert data.tokenizer.decode(ids) == OTHER_TEXT
    assert not [p for p in (place / "data").iterdir() if p.name.endswith(".pending")]


class Crash(BaseException):
    """A crash (kill -9, power loss) at a chosen moment: nothing after it runs."""


@pytest.mark.parametrize("renames_before_crash", [None, 0, 1, 2, 3])
def test_a_crash_leaves_the_old_data_or_the_new_never_a_mix(place, monkeypatch,
                                                            renames_before_crash):
    """Crash a re-prepare before its commit point (None: while writing the journal) or after
    it, with 0..3 of the 4 files renamed: the next reader sees the old data whole, or the new
    data whole, never old metadata beside new ids; reading changes nothing, and the next writer
    finishes the commit."""
    old = tree(place / "data")
    reference = place / "reference"
    prepare(reference, place / "other.txt")
    renames = []
    real_replace = os.replace

    def crash_at_journal(*args, **kwargs):
        raise Crash

    def crash_after_renames(src, dst):
        if Path(dst).name == "prepare.journal":  # written atomically: the commit point
            return real_replace(src, dst)
        if len(renames) == renames_before_crash:
            raise Crash
        renames.append(dst)
        real_replace(src, dst)

    if renames_before_crash is None:
        monkeypatch.setattr(commit.files, "write_text_atomic", crash_at_journal)
    else:
        monkeypatch.setattr(commit.os, "replace", crash_after_renames)
    with pytest.raises(Crash):
        prepare(place / "data", place / "other.txt", force=True)
    monkeypatch.undo()
    crashed = tree(place / "data")
    data = PreparedData(place / "data")  # through the journal: reads, never writes
    ids = np.concatenate([data.splits["train"], data.splits["val"]]).tolist()
    assert tree(place / "data") == crashed
    if renames_before_crash is None:
        assert data.tokenizer.decode(ids) == TEXT
        assert tree(place / "data") == old
    else:
        assert data.tokenizer.decode(ids) == OTHER_TEXT
        commit.recover(place / "data", DATA, DataError)  # what the next writer does first
        assert {k: v for k, v in tree(place / "data").items() if k != ".glassgpt.lock"} == \
            {k: v for k, v in tree(reference).items() if k != ".glassgpt.lock"}


def test_a_hostile_journal_cannot_rename_outside_the_directory(place):
    (place / "victim.pending").write_text("x")
    (place / "data" / "prepare.journal").write_text(json.dumps(["../victim"]))
    with pytest.raises(DataError, match="may only name the data files"):
        PreparedData(place / "data")
    assert (place / "victim.pending").exists() and not (place / "victim").exists()


def test_a_failed_prepare_leaves_nothing_behind(place, capsys):
    """An error found in the middle of the text (a character the given tokenizer lacks)."""
    (place / "new.txt").write_text(TEXT + "Zebra\n", encoding="utf-8")
    fails_cleanly(["prepare", "--text", place / "new.txt", "--tokenizer-file",
                   place / "data" / "tokenizer.json", "--out", place / "fresh" / "data"],
                  "'Z'", place, capsys)
    assert not (place / "fresh").exists()
    fails_cleanly(["prepare", "--text", place / "new.txt", "--tokenizer-file",
                   place / "data" / "tokenizer.json", "--out", place / "data", "--force"],
                  "'Z'", place, capsys)


def damaged(place: Path, name: str, change) -> Path:
    copy = shutil.copytree(place / "data", place / f"damaged-{name}")
    change(copy)
    return copy


def edit_meta(**values):
    def change(data: Path) -> None:
        meta = json.loads((data / "meta.json").read_text())
        (data / "meta.json").write_text(json.dumps({**meta, **values}))
    return change


def write(name: str, content: bytes):
    return lambda data: (data / name).write_bytes(content)


DAMAGES = {
    "100k-deep meta.json": (write("meta.json", b"[" * 100_000 + b"]" * 100_000),
                            "nested too deeply"),
    "100k-deep tokenizer.json": (write("tokenizer.json", b"[" * 100_000 + b"]" * 100_000),
                                 "nested too deeply"),
    "empty train.bin": (write("train.bin", b""), "train.bin holds 0 bytes"),
    "odd-length val.bin": (lambda d: (d / "val.bin").write_bytes((d / "val.bin").read_bytes()
                                                                 + b"\x00"), "val.bin holds"),
    "dtype that does not fit the size": (edit_meta(dtype="uint32"), "uint32 tokens"),
    "vocab_size smaller than the tokenizer's": (edit_meta(vocab_size=10),
                                                "vocab_size=10, but its tokenizer.json has"),
    "vocab_size larger than the tokenizer's": (edit_meta(vocab_size=10**6),
                                               "vocab_size=1000000, but"),
    "token count of the wrong type": (edit_meta(train_tokens="many"), "train_tokens must be"),
    "train.bin as a link": (lambda d: (d / "train.bin").unlink() or
                            (d / "train.bin").symlink_to(d / "val.bin"), "symbolic link"),
    "char tokenizer with a lone surrogate": (write("tokenizer.json",
                                                   b'{"kind": "char", "chars": ["\\ud800"]}'),
                                             "lone surrogates"),
}


@pytest.mark.parametrize("name", DAMAGES)
def test_damaged_data_directories_are_one_clear_error(place, name, capsys):
    change, message = DAMAGES[name]
    data = damaged(place, name.replace(" ", "_"), change)
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        PreparedData(data)
    fails_cleanly(["train", "--data", data, "--out", place / "run", "--max-iters", "1"],
                  message, place, capsys)


def test_bad_prepare_settings_cost_nothing(place, capsys):
    common = ["prepare", "--text", place / "text.txt", "--out", place / "new"]
    fails_cleanly([*common, "--tokenizer", "bpe", "--vocab-size", "1000000000"],
                  "at most 1,048,576", place, capsys)
    fails_cleanly([*common, "--workers", "0"], "workers must be between 1 and", place, capsys)
    fails_cleanly([*common, "--buffer-mb", "nan"], "--buffer-mb must be a positive", place,
                  capsys)
    fails_cleanly([*common, "--buffer-mb", "0.001"], "at least 65,536 bytes", place, capsys)
    deep = place / "deep.json"
    deep.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    fails_cleanly([*common, "--tokenizer-file", deep], "nested too deeply", place, capsys)
    deep.unlink()
    fails_cleanly([*common, "--tokenizer-file", place / "a", place / "b", place / "c"],
                  "give one tokenizer file", place, capsys)


def test_a_non_utf8_prompt_on_a_bpe_run_is_one_error(place, capsys):
    run = a_run(place / "run", BPETokenizer.train(TEXT, 300))
    fails_cleanly(["sample", run, "--prompt", "caf\udce9", "--max-new-tokens", "2"],
                  "lone surrogate", place, capsys)


def test_a_cache_that_is_a_file_is_one_error_for_the_default_training(place, monkeypatch,
                                                                     capsys):
    monkeypatch.delenv("GLASSGPT_TINYSHAKESPEARE", raising=False)
    (place / "cache").write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(place / "cache"))
    monkeypatch.chdir(place)
    torch.manual_seed(0)
    fails_cleanly(["train", "--max-iters", "1", "--out", place / "run"],
                  "the cache directory is unusable", place, capsys)


def test_a_sparse_64_gib_text_is_refused_at_its_first_block(place, capsys):
    """NUL bytes are valid UTF-8 but never text (a sparse file, UTF-16): refused at once."""
    sparse = place / "sparse.txt"
    with open(sparse, "wb") as file:
        file.truncate(64 * 2**30)
    fails_cleanly(["prepare", "--text", sparse, "--out", place / "new"],
                  "sparse.txt holds a NUL byte (byte 0)", place, capsys)
    (place / "utf16.txt").write_bytes("To be".encode("utf-16-le"))
    fails_cleanly(["prepare", "--text", place / "utf16.txt", "--out", place / "new"],
                  "(byte 1): binary data or UTF-16", place, capsys)


def test_a_full_disk_is_one_error_and_keeps_the_old_data(place, monkeypatch, capsys):
    def disk_full(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline.IdWriter, "flush", disk_full)
    fails_cleanly(["prepare", "--text", place / "other.txt", "--out", place / "data",
                   "--force"], "No space left on device; nothing was changed", place, capsys)
