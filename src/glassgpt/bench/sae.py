"""Training a sparse dictionary: activations/s and peak memory, glassgpt beside SAELens.

`bench_sae(size)` caches activations of a 128-wide glassgpt model (random weights, random
ids; blocks.1.hook_resid_post) to a safetensors file, then runs each contender in a fresh
process of its own, so that each one's peak resident memory (ru_maxrss) is its own:

  * glassgpt, cached   DictionaryTrainer reading the file's activations (TensorActivations)
  * SAELens, cached    SAELens's SAETrainer fed the same activations in the same order, in
                       SAELens's venv (`saelens_python`: SAELens cannot be installed beside
                       glassgpt); left out, and said so, when no such python is given
  * glassgpt, streamed train_dictionary's own path: the model runs on windows of ids and its
                       activations are never stored; at `tokens` and at a quarter of them, to
                       show that memory follows the batch, not the number of tokens

Each trains a TopK dictionary of expansion x d_model latents with the same settings. Timing
skips the first WARMUP_STEPS steps. The two cached contenders take turns, `rounds` times (a
load that comes and goes on a shared machine falls on both alike), and each row is the round of
the median rate (the highest peak memory of its rounds). Library only: the CLI (`glassgpt bench
sae`) prints it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glassgpt.errors import ConfigError

WARMUP_STEPS = 3
HOOK = "blocks.1.hook_resid_post"
SAELENS_WORKER = Path(__file__).with_name("saelens_trainer.py")
SAELENS_PYTHON_ENV = "GLASSGPT_SAELENS_PYTHON"


@dataclass(frozen=True)
class SAEBenchSize:
    d_model: int = 128
    expansion: int = 16
    tokens: int = 2_000_000  # activations trained on
    batch_tokens: int = 4096
    cached: int = 262_144  # distinct activations in the file, read round and round
    k: int = 32
    lr: float = 3e-4
    rounds: int = 1  # turns of each cached contender (see the module docstring)

    @property
    def d_sae(self) -> int:
        return self.d_model * self.expansion

    @property
    def steps(self) -> int:
        return self.tokens // self.batch_tokens


FULL = SAEBenchSize()
QUICK = SAEBenchSize(tokens=262_144, cached=65_536, rounds=3)


@dataclass
class SAEBenchRow:
    contender: str
    tokens: int  # activations trained on
    timed_tokens: int  # after the warm-up steps
    seconds: float  # of the timed steps
    activations_per_s: float
    peak_rss_mib: float  # the process's high-water resident memory
    explained_variance: float | None  # on held-out cached activations (cached contenders)


def bench_sae(size: SAEBenchSize = FULL, saelens_python: str | Path | None = None
              ) -> list[SAEBenchRow]:
    """The rows of each contender (see the module docstring), SAELens's when a python of a
    venv with sae_lens is given (or named by $GLASSGPT_SAELENS_PYTHON)."""
    saelens_python = saelens_python or os.environ.get(SAELENS_PYTHON_ENV) or None
    if saelens_python is not None and not Path(saelens_python).is_file():
        raise ConfigError(f"SAELens's python {saelens_python} does not exist")
    if size.steps <= WARMUP_STEPS:
        raise ConfigError(f"tokens={size.tokens} is {size.steps} steps of "
                          f"{size.batch_tokens}; the bench needs more than {WARMUP_STEPS}")
    with tempfile.TemporaryDirectory(prefix="glassgpt-bench-sae-") as folder:
        acts = Path(folder) / "activations.safetensors"
        write_activations(acts, size)
        cached = {"glassgpt, cached": [sys.executable, "-m", "glassgpt.bench.sae", "cached",
                                       str(acts)]}
        if saelens_python is not None:
            cached["SAELens, cached"] = [str(saelens_python), str(SAELENS_WORKER), str(acts)]
        rows = _taking_turns(cached, size)
        for tokens in (size.tokens, size.tokens // 4):
            if tokens // size.batch_tokens > WARMUP_STEPS:
                rows.append(_worker([sys.executable, "-m", "glassgpt.bench.sae", "streamed"],
                                    "glassgpt, streamed", SAEBenchSize(
                                        **{**asdict(size), "tokens": tokens})))
    return rows


def _taking_turns(commands: dict[str, list[str]], size: SAEBenchSize) -> list[SAEBenchRow]:
    """Each contender's row of the median rate over size.rounds turns, run in alternation."""
    rounds: dict[str, list[SAEBenchRow]] = {name: [] for name in commands}
    for _ in range(max(size.rounds, 1)):
        for name, command in commands.items():
            rounds[name].append(_worker(command, name, size))
    rows = []
    for measured in rounds.values():
        median = sorted(measured, key=lambda row: row.activations_per_s)[len(measured) // 2]
        rows.append(dataclasses.replace(median, peak_rss_mib=max(
            row.peak_rss_mib for row in measured)))
    return rows


def _worker(command: list[str], contender: str, size: SAEBenchSize) -> SAEBenchRow:
    from glassgpt.interp.sae.training import DictionarySettings
    # SAELens counts a latent dead after a number of steps; glassgpt after a number of tokens
    dead_steps = DictionarySettings.dead_tokens // size.batch_tokens
    payload = json.dumps({**asdict(size), "dead_feature_window": dead_steps})
    done = subprocess.run([*command, payload], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{contender} failed: {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return SAEBenchRow(contender, size.tokens, result["timed_tokens"], result["seconds"],
                       result["timed_tokens"] / result["seconds"],
                       result["peak_rss_kib"] / 1024, result.get("explained_variance"))


# --- the activations --------------------------------------------------------------------------

def bench_model(size: SAEBenchSize) -> torch.nn.Module:
    from glassgpt.config import GPTConfig
    from glassgpt.model import GPT
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4,
                         n_embd=size.d_model)).eval()


def bench_ids(tokens: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, tokens + 1, dtype=np.int64)


def write_activations(path: Path, size: SAEBenchSize) -> None:
    """`cached` activations to train on and a held-out 8,192, in chunks of windows."""
    from safetensors.torch import save_file

    from glassgpt.interp.sae.training.activations import WindowActivations
    held_out = 8192
    source = WindowActivations(bench_model(size), HOOK, HOOK,
                               bench_ids(size.cached + held_out), 128, 8192, 0, "cpu")
    chunks = [source.next_batch()[0] for _ in range(-(-(size.cached + held_out) // 8192))]
    acts = torch.cat(chunks)  # (rows, d_model)
    save_file({"train": acts[:size.cached].contiguous(),
               "held_out": acts[size.cached:size.cached + held_out].contiguous()}, str(path))


# --- the glassgpt contenders, each in its own process -----------------------------------------

def settings_for(size: SAEBenchSize) -> Any:
    from glassgpt.interp.sae.training import DictionarySettings
    return DictionarySettings(hook=HOOK, d_sae=size.d_sae, architecture="topk", k=size.k,
                              tokens=size.tokens, batch_tokens=size.batch_tokens,
                              lr=size.lr, normalize_activations="none", eval_every=0,
                              checkpoint_every=0)


class WarmupClock:
    """report(step, record) for the trainer: the clock runs from the end of step
    WARMUP_STEPS to the end of the last step (the final save is not timed)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.start, self.end = steps, 0.0, 0.0

    def __call__(self, step: int, record: dict[str, Any]) -> None:
        if step == WARMUP_STEPS:
            self.start = time.perf_counter()
        if step == self.steps:
            self.end = time.perf_counter()

    @property
    def seconds(self) -> float:
        return self.end - self.start


def run_cached(path: str, size: SAEBenchSize) -> dict[str, Any]:
    from safetensors.torch import load_file

    from glassgpt.interp.sae.training import DictionaryTrainer
    from glassgpt.interp.sae.training.activations import TensorActivations
    acts = load_file(path)
    clock = WarmupClock(size.steps)
    with tempfile.TemporaryDirectory() as out:
        trainer = DictionaryTrainer(settings_for(size), TensorActivations(
            acts["train"], size.batch_tokens), size.d_model, size.d_model, out, report=clock)
        trainer.run()
        sae = trainer.inference_sae()
    with torch.no_grad():
        x = acts["held_out"].double()
        x_hat = sae(acts["held_out"]).double()
    variance = (x - x.mean(0)).pow(2).sum(-1).mean()
    explained = float(1 - (x_hat - x).pow(2).sum(-1).mean() / variance)
    return _measured(size, clock.seconds, explained_variance=explained)


def run_streamed(size: SAEBenchSize) -> dict[str, Any]:
    from glassgpt.interp.sae.training import DictionaryTrainer
    from glassgpt.interp.sae.training.activations import WindowActivations
    source = WindowActivations(bench_model(size), HOOK, HOOK, bench_ids(1_000_000), 128,
                               size.batch_tokens, 0, "cpu")
    clock = WarmupClock(size.steps)
    with tempfile.TemporaryDirectory() as out:
        DictionaryTrainer(settings_for(size), source, size.d_model, size.d_model, out,
                          report=clock).run()
    return _measured(size, clock.seconds)


def _measured(size: SAEBenchSize, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"seconds": seconds, "timed_tokens": (size.steps - WARMUP_STEPS) * size.batch_tokens,
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, **extra}


if __name__ == "__main__":  # a contender's process: python -m glassgpt.bench.sae KIND ... SIZE
    kind, *paths, size_json = sys.argv[1:]
    measured_size = SAEBenchSize(**{key: value for key, value in json.loads(size_json).items()
                                    if key in SAEBenchSize.__dataclass_fields__})
    measured = run_cached(paths[0], measured_size) if kind == "cached" else \
        run_streamed(measured_size)
    print(json.dumps(measured))
