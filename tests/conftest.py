"""Fixtures shared by every test module. Tests are offline, seeded and fast."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib
import pytest
import torch

from glassgpt.data import TINYSHAKESPEARE_ENV, packaged_tinyshakespeare

matplotlib.use("Agg")
# Tiny test models are overhead-bound: one thread is faster than two fighting over 2 cores, and
# subprocesses started by the CLI tests inherit the same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# The suite needs no corpus from outside: Tiny Shakespeare comes from the package. A copy named
# in the developer's environment is ignored, so that every run tests the same thing.
os.environ.pop(TINYSHAKESPEARE_ENV, None)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def shakespeare_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Shakespeare as a plain file, unpacked from the package's copy (sha256-checked)."""
    path = tmp_path_factory.mktemp("corpus") / "tinyshakespeare.txt"
    path.write_bytes(packaged_tinyshakespeare())
    return path


@pytest.fixture()
def small_text(tmp_path: Path) -> Path:
    """A short UTF-8 text file (a few KB) that a test may train a tiny model on."""
    lines = [f"To be or not to be, line {i}: that is the question.\n" for i in range(200)]
    path = tmp_path / "small.txt"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def cli_environment(shakespeare_path: Path, cache: Path) -> dict[str, str]:
    """Environment for a `glassgpt` subprocess: the test corpus, and a private user cache."""
    return {**os.environ, TINYSHAKESPEARE_ENV: str(shakespeare_path.resolve()),
            "XDG_CACHE_HOME": str(cache)}


@pytest.fixture(scope="module")
def env(shakespeare_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`cli_environment` with a cache shared by the tests of one module."""
    return cli_environment(shakespeare_path, tmp_path_factory.mktemp("cache"))
