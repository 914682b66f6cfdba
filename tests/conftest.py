"""Fixtures shared by every test module. Tests are offline, seeded and fast."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
# Tiny test models are overhead-bound: one thread is faster than two fighting over 2 cores, and
# subprocesses started by the CLI tests inherit the same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_SHAKESPEARE = REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    """The Tiny Shakespeare copy for tests: $GLASSGPT_TINYSHAKESPEARE or ../shared/data."""
    path = Path(os.environ.get("GLASSGPT_TINYSHAKESPEARE", SHARED_SHAKESPEARE))
    if not path.is_file():
        pytest.fail(f"Tiny Shakespeare not found at {path}; set GLASSGPT_TINYSHAKESPEARE")
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
    return {**os.environ, "GLASSGPT_TINYSHAKESPEARE": str(shakespeare_path.resolve()),
            "XDG_CACHE_HOME": str(cache)}


@pytest.fixture(scope="module")
def env(shakespeare_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`cli_environment` with a cache shared by the tests of one module."""
    return cli_environment(shakespeare_path, tmp_path_factory.mktemp("cache"))
