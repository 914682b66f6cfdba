"""One atomic-path primitive (`storage.files.atomic_path`) for every file glassgpt writes whole:
a temporary name beside the target, renamed over it when the writer is done, removed when it
fails. `write_bytes_atomic` writes through it, and so does a writer that needs a path of its
own (gguf's); no module outside storage/ renames a file into place itself."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from glassgpt.storage import files

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "glassgpt"
# A temporary file renamed into place by hand: the pattern `atomic_path` replaces.
OWN_RENAME = re.compile(r"os\.replace\(|os\.rename\(|shutil\.move\(|NamedTemporaryFile|mkstemp"
                        r"|\.tmp[\"']")


def test_a_block_that_ends_well_replaces_the_file_and_leaves_nothing_else(tmp_path: Path):
    target = tmp_path / "m.gguf"
    target.write_bytes(b"old")
    with files.atomic_path(target) as temp:
        assert temp.parent == tmp_path and not temp.exists()
        temp.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # nobody sees the new file before it is whole
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_block_that_fails_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path):
    target = tmp_path / "m.gguf"
    target.write_bytes(b"old")
    with pytest.raises(OSError, match="No space left"), files.atomic_path(target) as temp:
        temp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_link_at_the_target_is_replaced_not_followed(tmp_path: Path):
    kept = tmp_path / "kept.txt"
    kept.write_text("the user's")
    target = tmp_path / "out.bin"
    target.symlink_to(kept)
    with files.atomic_path(target) as temp:
        temp.write_bytes(b"ours")
    assert not target.is_symlink() and target.read_bytes() == b"ours"
    assert kept.read_text() == "the user's"


def test_write_bytes_atomic_goes_through_the_one_primitive(tmp_path: Path, monkeypatch):
    used = []
    primitive = files.atomic_path

    def watched(path):
        used.append(Path(path))
        return primitive(path)

    monkeypatch.setattr(files, "atomic_path", watched)
    files.write_bytes_atomic(tmp_path / "config.json", b"{}")
    assert used == [tmp_path / "config.json"]
    assert (tmp_path / "config.json").read_bytes() == b"{}"


def test_no_module_outside_storage_renames_a_file_into_place_itself():
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.parts[-2] != "storage"
             for number, line in enumerate(path.read_text("utf-8").splitlines(), start=1)
             if OWN_RENAME.search(line)]
    assert found == [], "write through glassgpt.storage.files.atomic_path:\n" + "\n".join(found)
