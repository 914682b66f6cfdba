"""The file layer of run and data directories: no links followed, bounded reads, bounded JSON,
atomic writes, one writer per directory."""

from __future__ import annotations

import contextlib
import multiprocessing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glassgpt.errors import CheckpointError, GlassGPTError
from glassgpt.storage import files


def test_a_link_is_never_read_through(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    link = tmp_path / "run" / "config.json"
    link.parent.mkdir()
    link.symlink_to(secret)
    with pytest.raises(CheckpointError, match="symbolic link"):
        files.read_bytes(link, 100, CheckpointError)


def test_a_read_is_bounded_before_it_starts(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(2**40)  # a sparse terabyte: refused by its size, never read
    with pytest.raises(CheckpointError, match="more than the 1,024"):
        files.read_bytes(big, 1024, CheckpointError)


def test_a_directory_or_a_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="not a regular file|directory"):
        files.read_bytes(tmp_path, 10, CheckpointError)
    with pytest.raises(CheckpointError, match="is missing"):
        files.read_bytes(tmp_path / "nothing", 10, CheckpointError)


@pytest.mark.parametrize(("text", "match"), [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("[" * 40 + "]" * 40, "nested too deeply"),
    ('{"n_embd": ' + "9" * 30 + "}", "64 bits"),
    ('{"lr": NaN}', "NaN is not a number"),
    ('{"lr": 1e999}', "not finite"),
    ('{"a": ', "not valid JSON"),
    ("1" * 5000, "not valid JSON"),  # more digits than Python converts
])
def test_hostile_json_is_refused(text, match):
    with pytest.raises(CheckpointError, match=match):
        files.parse_json(text, "config.json", CheckpointError)


def test_real_json_passes_at_every_allowed_depth():
    nested = "[" * files.MAX_JSON_DEPTH + "]" * files.MAX_JSON_DEPTH
    assert files.parse_json(nested, "x", CheckpointError) is not None
    assert files.parse_json('{"a": [1, 2.5, -9223372036854775808]}', "x", CheckpointError) == \
        {"a": [1, 2.5, -2**63]}


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_json_or_one_glassgpt_error(text):
    with contextlib.suppress(GlassGPTError):  # anything else fails the test
        files.parse_json(text, "fuzz", CheckpointError)


def test_an_atomic_write_replaces_a_planted_link_and_leaves_its_target(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.safetensors").symlink_to(outside)
    files.write_bytes_atomic(run / "model.safetensors", b"weights")
    assert outside.read_text() == "keep me"
    assert not (run / "model.safetensors").is_symlink()
    assert (run / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in run.iterdir()) == ["model.safetensors"]  # no temp left


def test_appending_through_a_dangling_link_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(CheckpointError, match="symbolic link"):
        files.append_text(tmp_path / "metrics.jsonl", "{}\n", CheckpointError)
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_a_new_file_is_never_opened_through_a_link(tmp_path):
    target = tmp_path / "target"
    (tmp_path / "x.pending").symlink_to(target)
    with pytest.raises(FileExistsError):
        files.open_new_file(tmp_path / "x.pending")
    assert not target.exists()


@pytest.mark.parametrize(("make", "match"), [
    (lambda p: (p.write_text("x"), p)[1], "is a file"),
    (lambda p: (p.write_text("x"), p / "run")[1], "is a file, not a directory"),
    (lambda p: p / ("n" * 300), "at most 255"),
])
def test_places_that_cannot_hold_a_directory_are_named_before_any_work(tmp_path, make, match):
    with pytest.raises(CheckpointError, match=match):
        files.check_can_make_dir(make(tmp_path / "out"), CheckpointError)


def test_a_file_destination_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        files.check_can_write_file(tmp_path, CheckpointError)
    assert files.check_can_write_file(tmp_path / "bench.json", CheckpointError)


def _hold_lock(directory: str, ready, release) -> None:
    with files.locked_directory(directory, CheckpointError):
        ready.set()
        release.wait(30)


def test_a_second_writer_is_refused_while_the_first_holds_the_directory(tmp_path):
    context = multiprocessing.get_context("fork")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(CheckpointError, match=f"in use by another glassgpt process "
                                                  f"\\(pid {holder.pid}\\)"), \
                files.locked_directory(tmp_path, CheckpointError):
            pass
    finally:
        release.set()
        holder.join(30)
    with files.locked_directory(tmp_path, CheckpointError):  # free again once it is gone
        pass


def test_toml_is_bounded_too(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(CheckpointError, match="nested too deeply"):
        files.read_toml(path, CheckpointError)
    assert files.read_toml(_write(tmp_path / "ok.toml", "[model]\nn_layer = 2\n"),
                           CheckpointError) == {"model": {"n_layer": 2}}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
