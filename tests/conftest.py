"""Fixtures shared by every test module. Tests are offline, seeded and fast.

    tiny_gpt(**overrides)   a GPT small enough for a unit test, any GPTConfig field overridden
                            (`from conftest import tiny_gpt`); `tiny_config` is its config
    trained_run             a tiny run trained once per session through `glassgpt train`, with
                            the data and text it trained on; `run_copy` is a copy of it that a
                            test may damage
    quick_experiment(name, out_dir, seed)   `run_experiment(..., quick=True)`, run once per
                            session for each set of arguments, by any worker (`glassgpt demo
                            all --quick` and each experiment's own tests read the same run)

The suite runs in parallel (`-n logical --dist loadfile` in pyproject.toml): each test file stays
in one worker, in order, so its module fixtures are built once.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.data import TINYSHAKESPEARE_ENV, packaged_tinyshakespeare, prepare
from glassgpt.experiments import ExperimentResult, run_experiment
from glassgpt.hooks import recorded
from glassgpt.model import GPT

matplotlib.use("Agg")
# Tiny test models are overhead-bound: one thread is faster than two fighting over 2 cores, and
# subprocesses started by the CLI tests inherit the same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# The suite needs no corpus from outside: Tiny Shakespeare comes from the package. A copy named
# in the developer's environment is ignored, so that every run tests the same thing.
os.environ.pop(TINYSHAKESPEARE_ENV, None)


_quick_store: Path | None = None  # where quick_experiment keeps its runs (the session's)


@pytest.fixture(scope="session", autouse=True)
def _quick_experiment_store(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One folder for the whole run: under xdist the workers' temporary folders share a parent,
    so a quick run made by one worker is read by the others."""
    global _quick_store
    base = tmp_path_factory.getbasetemp()
    _quick_store = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "quick"
    _quick_store.mkdir(exist_ok=True)


def quick_experiment(name: str, out_dir: Path, seed: int = 0, **options: Any) -> ExperimentResult:
    """`run_experiment(name, out_dir, seed=seed, quick=True, **options)`, run once per test
    session for each set of arguments, whichever worker asks first (the others wait for it):
    each call gets its own copy of the result, with the pictures copied into `out_dir`."""
    assert _quick_store is not None
    key = "-".join([name, str(seed), *(f"{k}={v}" for k, v in sorted(options.items()))])
    folder = _quick_store / key
    with open(_quick_store / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = folder / "result.pickle"  # written by this test session, never a user's file
        if not saved.exists():
            folder.mkdir()
            result = run_experiment(name, folder, seed=seed, quick=True, **options)
            saved.write_bytes(pickle.dumps(result))
    result = pickle.loads(saved.read_bytes())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result.pictures = [Path(shutil.copy2(picture, out_dir / picture.name))
                       for picture in result.pictures]
    return result


@pytest.fixture(scope="module")
def gpt2_and_bridge(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(glassgpt model, TransformerLens 4.x bridge) over one random GPT-2's weights
    (test_interp_reference's `boot`; skipped where transformers or transformer-lens is
    missing)."""
    from test_interp_reference import boot

    _, ours, bridge = boot("gpt2", tmp_path_factory.mktemp("gpt2"))
    return ours, bridge


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


# The last lines of a torchrun'd test script, once its process group is destroyed: the group
# took gloo's threads with it. Left running into interpreter shutdown, they could abort the rank
# ("terminate called without an active exception").
NO_GLOO_THREAD_LEFT = """
from pathlib import Path as _Path
_tasks = _Path("/proc/self/task")
_names = [_Path(t, "comm").read_text().strip() for t in _tasks.iterdir()] if _tasks.is_dir() else []
assert not [name for name in _names if "gloo" in name], _names
"""


def cli_environment(shakespeare_path: Path, cache: Path) -> dict[str, str]:
    """Environment for a `glassgpt` subprocess: the test corpus, and a private user cache."""
    return {**os.environ, TINYSHAKESPEARE_ENV: str(shakespeare_path.resolve()),
            "XDG_CACHE_HOME": str(cache)}


@pytest.fixture(scope="module")
def env(shakespeare_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`cli_environment` with a cache shared by the tests of one module."""
    return cli_environment(shakespeare_path, tmp_path_factory.mktemp("cache"))


# The shape most unit tests need: two layers, two heads, width 16. A test whose assertion
# depends on a size (a vocabulary, a context) names it.
TINY_GPT: dict[str, Any] = dict(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=16)


def attention_with_weights(attn: torch.nn.Module, x: torch.Tensor,
                           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention module's output and the weights it multiplied into v (after its dropout),
    read at its hook points: the pattern watched makes it take the explicit path."""
    with recorded(attn.hook_pattern, attn.attn_dropout) as seen:
        y = attn(x, **kwargs)
    return y, seen[-1]  # seen: the pattern, then it after dropout


def tiny_config(**overrides: Any) -> GPTConfig:
    """`TINY_GPT` with any GPTConfig field overridden."""
    return GPTConfig(**{**TINY_GPT, **overrides})


def tiny_gpt(**overrides: Any) -> GPT:
    """A freshly initialised GPT of `tiny_config(**overrides)`, as `GPT(config)` leaves it (in
    training mode, float32); its weights come from the global seed, set to 0 per test."""
    return GPT(tiny_config(**overrides))


# `glassgpt train` flags of the session's tiny run: 1 layer, 2 heads, width 16, context 16.
TINY_TRAIN_FLAGS = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
                    "--batch-size", "4", "--eval-iters", "2", "--log-interval", "1",
                    "--device", "cpu"]
TINY_TEXT = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(200))


@dataclass(frozen=True)
class TrainedRun:
    run: Path  # the run directory: read it, or copy it (`run_copy`) before changing it
    data: Path  # the character-level data directory it trained on
    text: Path  # the text that data was prepared from
    flags: tuple[str, ...]  # the shape and training flags it was trained with


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """A tiny run of 3 iterations (one evaluation at the end), trained once per session in this
    process by the command line itself, as `glassgpt train` trains one."""
    from glassgpt.cli import main

    root = tmp_path_factory.mktemp("trained_run")
    text = root / "text.txt"
    text.write_text(TINY_TEXT, encoding="utf-8")
    prepare(root / "data", text)
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"),
                 "--max-iters", "3", "--eval-interval", "3", *TINY_TRAIN_FLAGS]) == 0
    return TrainedRun(root / "run", root / "data", text, tuple(TINY_TRAIN_FLAGS))


@pytest.fixture()
def run_copy(trained_run: TrainedRun, tmp_path: Path) -> Path:
    """A copy of the session's trained run that this test may change or break."""
    return shutil.copytree(trained_run.run, tmp_path / "run")
