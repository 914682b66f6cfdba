"""Data parallel training on CPU: two gloo processes launched by torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import NO_GLOO_THREAD_LEFT, cli_environment
from glassgpt.config import GPTConfig, TrainConfig
from glassgpt.data import prepare
from glassgpt.model import GPT
from glassgpt.training.optim import make_optimizer
from glassgpt.training.trainer import train_step

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "2", "--eval-iters", "2", "--log-interval", "1"]
# Two ranks need two devices: on a machine with fewer GPUs they train on the CPU (gloo).
DEVICE = ["--device", "auto" if torch.cuda.device_count() >= 2 else "cpu"]

ONE_STEP = textwrap.dedent("""
    import sys
    import torch
    from safetensors.torch import save_file
    from glassgpt.machine import distributed as ddp
    from glassgpt.rundir.weights import model_tensors
    from glassgpt.config import GPTConfig
    from glassgpt.model import GPT
    from glassgpt.config import TrainConfig
    from glassgpt.training.optim import make_optimizer
    from glassgpt.training.trainer import train_step

    with ddp.distributed("cpu") as context:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16))
        x, y = torch.load(sys.argv[1], weights_only=True)
        # Rank r takes rows 2r and 2r+1, as two micro-batches of one row each.
        rows = [(x[i:i + 1], y[i:i + 1]) for i in (2 * context.rank, 2 * context.rank + 1)]
        cfg = TrainConfig(grad_accum=2, lr=1e-2, optimizer=sys.argv[3], muon_lr=1e-3)
        wrapped = ddp.wrap_model(model, context, torch.device("cpu"))
        batches = iter(rows)
        loss = train_step(wrapped, make_optimizer(model, cfg), lambda: next(batches), cfg)
        mean_loss = ddp.mean_over_ranks(loss, context)
        if context.is_main:
            save_file({**model_tensors(model), "loss": mean_loss.reshape(1)}, sys.argv[2])
        # DDP's reducer goes before the process group does: torn down after it, at exit, it
        # could abort the rank ("terminate called without an active exception").
        del wrapped
""") + NO_GLOO_THREAD_LEFT


def torchrun(*args: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture()
def env(shakespeare_path, tmp_path) -> dict[str, str]:
    return {**cli_environment(shakespeare_path, tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_ranks_take_the_same_step_as_one_process_with_both_batches(tmp_path, env,
                                                                        optimizer):
    x = torch.randint(0, 20, (4, 8))
    y = torch.randint(0, 20, (4, 8))
    torch.save((x, y), tmp_path / "batch.pt")
    (tmp_path / "one_step.py").write_text(ONE_STEP)
    torchrun(tmp_path / "one_step.py", tmp_path / "batch.pt", tmp_path / "ddp.safetensors",
             optimizer, env=env)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16))
    cfg = TrainConfig(grad_accum=1, lr=1e-2, optimizer=optimizer, muon_lr=1e-3)
    loss = train_step(model, make_optimizer(model, cfg), lambda: (x, y), cfg)
    ddp_result = load_file(tmp_path / "ddp.safetensors")
    assert abs(ddp_result.pop("loss").item() - loss.item()) < 1e-5
    single = model.state_dict()
    for name, tensor in ddp_result.items():
        assert torch.allclose(tensor, single[name], atol=1e-5, rtol=0), name
    assert not torch.equal(ddp_result["tok_emb.weight"],
                           GPT(model.config).tok_emb.weight)  # the step did change weights


def test_two_ranks_train_checkpoint_and_resume(tmp_path, env, small_text):
    data, run = tmp_path / "data", tmp_path / "run"
    prepare(data, small_text)
    train = ["-m", "glassgpt", "train", "--data", data, "--out", run, "--eval-interval", "2",
             *TINY, *DEVICE]
    first = torchrun(*train, "--max-iters", "2", env=env)
    assert "Traceback" not in first.stderr
    state = json.loads((run / "train_state.json").read_text())
    assert state["iteration"] == 2 and len(state["rng"]) == 2  # every rank's random state
    torchrun("-m", "glassgpt", "train", "--resume", "--out", run, "--max-iters", "4", *DEVICE,
             env=env)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in metrics if "loss" in r] == [1, 2, 3, 4]  # rank 0 alone writes
    assert json.loads((run / "train_state.json").read_text())["iteration"] == 4
    assert (run / "loss.png").is_file()
