"""Fully sharded training (FSDP2) on CPU: two gloo processes launched by torchrun.

One torchrun launch does the whole job (starting the two processes is most of a test's cost):
20 steps of a sharded model beside the same steps in one process, whole weights loaded into the
shards, then `glassgpt train --fsdp`
through the command line, in process: a run in one go, the same run in two halves with
`--resume`, and a resume stopped by Ctrl-C on one rank only; last, that the destroyed process
group leaves no gloo thread behind.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from conftest import NO_GLOO_THREAD_LEFT, cli_environment
from glassgpt.cli import main
from glassgpt.config import GPTConfig, TrainConfig
from glassgpt.data import prepare
from glassgpt.errors import ConfigError
from glassgpt.machine.distributed import DistContext
from glassgpt.model import GPT
from glassgpt.rundir import checkpoint as ckpt
from glassgpt.training import fsdp
from glassgpt.training.optim import make_optimizer, optimizer_state_shapes
from glassgpt.training.trainer import train_step

STEPS = 20
MODEL = dict(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16)
RECIPE = dict(lr=1e-2, warmup_iters=0, grad_clip=1.0)
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "2", "--eval-iters", "2", "--log-interval", "1", "--device", "cpu",
        "--warmup-iters", "1", "--fsdp"]

SCRIPT = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from glassgpt.cli import main
    from glassgpt.config import GPTConfig, TrainConfig
    from glassgpt.machine import distributed as ddp
    from glassgpt.model import GPT
    from glassgpt.rundir import checkpoint as ckpt
    from glassgpt.rundir.weights import model_tensors
    from glassgpt.training import fsdp, trainer
    from glassgpt.training.optim import make_optimizer

    tmp, model_settings, recipe, steps = Path(sys.argv[1]), eval(sys.argv[2]), eval(sys.argv[3]), \\
        int(sys.argv[4])
    tiny = sys.argv[5:]
    rank = ddp.rank_from_env()
    # One process group for every command below: re-creating the default group in the same
    # launch reuses its rendezvous keys, and a rank can read the last group's (a hang).
    ddp.init_distributed("cpu")
    shutdown, ddp.shutdown = ddp.shutdown, lambda context: None

    # 1. Twenty steps of a sharded model; rank r takes rows 2r, 2r+1 of each step's batch.
    with ddp.distributed("cpu") as context:
        torch.manual_seed(0)
        model = fsdp.shard_model(GPT(GPTConfig(**model_settings)), torch.device("cpu"), context)
        local = model.blocks[0].attn.qkv.weight.to_local()
        assert local.shape[0] * 2 == model.blocks[0].attn.qkv.weight.shape[0]  # half each
        cfg = TrainConfig(grad_accum=2, **recipe)
        optimizer = make_optimizer(model, cfg)
        batches = torch.load(tmp / "batches.pt", weights_only=True)
        losses = []
        for x, y in batches:
            rows = iter([(x[i:i + 1], y[i:i + 1]) for i in (2 * rank, 2 * rank + 1)])
            loss = trainer.train_step(model, optimizer, lambda: next(rows), cfg)
            losses.append(ddp.mean_over_ranks(loss, context))
        weights = fsdp.full_weights(model)
        if context.is_main:
            save_file({**weights, "losses": torch.stack(losses)}, tmp / "fsdp.safetensors")
        # Whole tensors (a checkpoint's, its tied head stored once) load into the shards.
        torch.manual_seed(1)
        fresh = model_tensors(GPT(GPTConfig(**model_settings)))
        fsdp.load_full_weights(model, fresh)
        reloaded = fsdp.full_weights(model)
        if context.is_main:
            assert all(torch.equal(reloaded[k], fresh[k]) for k in fresh)
            assert torch.equal(reloaded["lm_head.weight"], fresh["tok_emb.weight"])

    # 2. The command line: 4 steps in one go; 2 steps, then --resume to 4.
    data, one_go, halves = tmp / "data", tmp / "one_go", tmp / "halves"
    train = ["train", "--data", str(data), "--eval-interval", "2", *tiny]
    assert main([*train, "--out", str(one_go), "--max-iters", "4"]) == 0
    assert main([*train, "--out", str(halves), "--max-iters", "2"]) == 0
    assert main(["train", "--resume", "--out", str(halves), "--max-iters", "4"]) == 0
    if rank == 0:
        shutil.copytree(halves, tmp / "halves_at_4")

    # 3. Ctrl-C on rank 1 alone, in the first step of a resume: every rank stops at the next
    # log step, and rank 0 saves once.
    saves = []
    save_checkpoint = ckpt.save_checkpoint
    ckpt.save_checkpoint = lambda *a, **k: (saves.append(1), save_checkpoint(*a, **k))
    if rank == 1:
        step = trainer.train_step
        def interrupted_step(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            return step(*args, **kwargs)
        trainer.train_step = interrupted_step
    try:  # in process, the CLI raises the Ctrl-C again once the run is saved
        main(["train", "--resume", "--out", str(halves), "--max-iters", "8"])
        raise AssertionError("not interrupted")
    except KeyboardInterrupt:
        pass
    if rank == 0:
        (tmp / "saves.txt").write_text(str(len(saves)))

    # 4. Destroyed, the group takes gloo's threads with it: neither a sharded model's state nor
    # DTensor's caches keep it alive.
    del model, optimizer, local
    shutdown(context)
""") + NO_GLOO_THREAD_LEFT


def torchrun(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    # each rank's own last lines: the rank that failed first is the one to read
    ranks = {rank: [line for line in result.stderr.splitlines() if f"[rank{rank}]" in line]
             for rank in (0, 1)}
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 0, "\n".join(
        [*said, *ranks[1][-25:], *ranks[0][-25:], result.stderr[-1500:]])
    return result


def one_process_losses(batches: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps in one process, each on the whole batch of 4 rows."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    cfg = TrainConfig(grad_accum=1, **RECIPE)
    optimizer = make_optimizer(model, cfg)
    losses = [train_step(model, optimizer, lambda b=b: b, cfg).item() for b in batches]
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def sharded(shakespeare_path, tmp_path_factory, request):
    """Everything the torchrun launch left, for the tests below to read."""
    tmp = tmp_path_factory.mktemp("fsdp")
    text = tmp / "small.txt"
    text.write_text("".join(f"To be or not to be, line {i}: that is the question.\n"
                            for i in range(200)), encoding="utf-8")
    prepare(tmp / "data", text)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 20, (4, 8), generator=generator),
                torch.randint(0, 20, (4, 8), generator=generator)) for _ in range(STEPS)]
    torch.save(batches, tmp / "batches.pt")
    (tmp / "script.py").write_text(SCRIPT)
    env = {**cli_environment(shakespeare_path, tmp / "cache"), "OMP_NUM_THREADS": "1"}
    result = torchrun(str(tmp / "script.py"), str(tmp), repr(MODEL), repr(RECIPE), str(STEPS),
                      *TINY, env=env)
    return tmp, batches, result


def test_two_sharded_ranks_take_the_steps_of_one_process(sharded):
    tmp, batches, _ = sharded
    result = load_file(tmp / "fsdp.safetensors")
    losses, weights = one_process_losses(batches)
    assert torch.allclose(result.pop("losses"), torch.tensor(losses), atol=1e-5, rtol=0)
    assert set(result) == set(weights)
    for name, tensor in result.items():  # AdamW divides by tiny moments: 1e-3 after 20 steps
        assert torch.allclose(tensor, weights[name], atol=1e-3, rtol=0), name
    assert not torch.equal(result["tok_emb.weight"], GPT(GPTConfig(**MODEL)).tok_emb.weight)


def test_a_sharded_run_resumed_equals_the_run_in_one_go(sharded):
    tmp, _, _ = sharded
    one_go, halves = tmp / "one_go", tmp / "halves_at_4"
    for name in ("model.safetensors", "best.safetensors", "train_state.safetensors"):
        a, b = load_file(one_go / name), load_file(halves / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    metrics = [json.loads(line) for line in (halves / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in metrics if "loss" in r] == [1, 2, 3, 4]
    config = json.loads((one_go / "config.json").read_text())
    assert config["train"]["fsdp"] is True


def test_a_sharded_run_is_an_ordinary_run_directory(sharded):
    """One consolidated model.safetensors and a whole optimizer state: a one-process reader
    loads both as it loads any run's."""
    tmp, _, _ = sharded
    run = ckpt.Run(tmp / "one_go")
    model, _ = run.load_model()
    cfg = TrainConfig.from_dict(run.train_settings)
    state = run.train_state(optimizer_state_shapes(make_optimizer(model, cfg)))
    assert state.iteration == 4 and len(state.rng) == 2
    assert state.optimizer["state"][0]["exp_avg"].shape == model.tok_emb.weight.shape


def test_ctrl_c_on_one_rank_stops_every_rank_and_saves_once(sharded):
    tmp, _, result = sharded
    assert (tmp / "saves.txt").read_text() == "1"
    state = json.loads((tmp / "halves" / "train_state.json").read_text())
    assert state["iteration"] == 5
    assert "interrupted at iteration 5; checkpoint saved" in result.stderr + result.stdout


def test_fsdp_outside_torchrun_is_one_line_and_writes_nothing(tmp_path, small_text, capsys):
    prepare(tmp_path / "data", small_text)
    code = main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"),
                 "--max-iters", "2", *TINY])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "torchrun --nproc_per_node" in err
    assert not (tmp_path / "run").exists()


def test_fsdp_refuses_muon_and_a_torch_without_fully_shard(monkeypatch):
    ranks = DistContext(rank=0, world_size=2)
    with pytest.raises(ConfigError, match="Muon orthogonalises whole matrices"):
        fsdp.check_can_shard(TrainConfig(fsdp=True, optimizer="muon"), ranks)
    monkeypatch.setattr(fsdp, "_fsdp_api", lambda: None)
    with pytest.raises(ConfigError, match=re.escape(f"torch {torch.__version__}")):
        fsdp.check_can_shard(TrainConfig(fsdp=True), ranks)


def test_only_the_writing_rank_asks_whether_the_run_is_in_use(tmp_path) -> None:
    """Under torchrun rank 0 takes the run's lock as soon as it reaches the training; a rank
    still checking its arguments then must not read that lock as another writer's (it did:
    "is in use by another glassgpt process", now and then, in the two-rank tests)."""
    from glassgpt.errors import CheckpointError
    from glassgpt.rundir import directory
    from glassgpt.storage import files

    run = tmp_path / "run"
    run.mkdir()
    with files.locked_directory(run, CheckpointError):  # rank 0, already writing
        directory.check_out_dir(run, force=False, writer=False)  # rank 1: fine
        with pytest.raises(CheckpointError, match="in use by another glassgpt process"):
            directory.check_out_dir(run, force=False)  # a second writer is still refused
