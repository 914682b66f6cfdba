"""The trainer as a library: schedule, optimizer groups, accumulation, evaluation, resume."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from conftest import TINY_GPT, tiny_config, tiny_gpt
from glassgpt.config import TrainConfig, load_preset
from glassgpt.data import BatchSampler, PreparedData, prepare
from glassgpt.errors import CheckpointError, ConfigError, DataError
from glassgpt.machine.devices import autocast_dtype
from glassgpt.machine.memory import training_memory
from glassgpt.model import GPT, count_parameters
from glassgpt.rundir.checkpoint import load_train_state
from glassgpt.training.metrics import read_metrics
from glassgpt.training.optim import adamw_state_shapes, load_adamw_state, lr_at, make_optimizer
from glassgpt.training.runs import (
    build_model,
    model_for_finetuning,
    resolve_configs,
    resume_settings,
)
from glassgpt.training.trainer import NonFiniteLossError, Trainer, estimate_loss, train_step

TINY = {k: v for k, v in TINY_GPT.items() if k != "vocab_size"}  # the shared shape


@pytest.fixture()
def data(tmp_path, small_text) -> PreparedData:
    prepare(tmp_path / "data", small_text)
    return PreparedData(tmp_path / "data")


def test_lr_warms_up_linearly_then_decays_to_the_floor():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_iters=10, max_iters=110)
    assert lr_at(0, cfg) == pytest.approx(1 / 11)
    assert lr_at(4, cfg) == pytest.approx(5 / 11)
    assert lr_at(10, cfg) == pytest.approx(1.0)  # the peak, where the cosine starts
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half way: the mean of peak and floor
    assert lr_at(35, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, cfg) == lr_at(500, cfg) == pytest.approx(0.1)
    values = [lr_at(i, cfg) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_lr_decay_iters_and_constant_lr():
    cfg = TrainConfig(lr=1.0, min_lr=0.0, warmup_iters=0, max_iters=1000, lr_decay_iters=100)
    assert lr_at(50, cfg) == pytest.approx(0.5) and lr_at(100, cfg) == 0.0
    assert lr_at(7, TrainConfig(lr=0.3, decay_lr=False)) == 0.3


def test_weight_decay_applies_to_matrices_only():
    model = tiny_gpt()
    optimizer = make_optimizer(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert "tok_emb.weight" in decayed and "pos_emb.weight" in decayed
    assert "blocks.0.attn.qkv.weight" in decayed and "blocks.1.ffn.proj.weight" in decayed
    assert "blocks.0.attn.qkv.bias" in kept and "blocks.0.ln1.weight" in kept
    assert "ln_f.weight" in kept and "ln_f.bias" in kept
    assert all(p.dim() >= 2 for p in decay["params"]) and all(
        p.dim() < 2 for p in no_decay["params"])
    # The tied LM head is the embedding: every parameter appears once.
    assert len(decayed) + len(kept) == len(list(model.parameters()))


def test_gradient_accumulation_equals_one_big_batch():
    """k micro-batches of b give the same step as one batch of k*b (float64)."""
    torch.manual_seed(0)
    model = tiny_gpt().double()
    big, small = model, copy.deepcopy(model)
    x = torch.randint(0, 20, (8, 16))
    y = torch.randint(0, 20, (8, 16))
    cfg_big = TrainConfig(grad_accum=1, lr=1e-2, grad_clip=1.0)
    cfg_small = TrainConfig(grad_accum=4, lr=1e-2, grad_clip=1.0)
    micro = iter([(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)])
    loss_big = train_step(big, make_optimizer(big, cfg_big), lambda: (x, y), cfg_big)
    loss_small = train_step(small, make_optimizer(small, cfg_small), lambda: next(micro),
                            cfg_small)
    assert abs(loss_big.item() - loss_small.item()) < 1e-12
    for (name, a), b in zip(big.named_parameters(), small.parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-6, name
    assert not torch.equal(big.tok_emb.weight, tiny_gpt().double().tok_emb.weight)


def test_estimate_loss_uses_eval_mode_and_restores_it(data):
    model = tiny_gpt(vocab_size=data.vocab_size, dropout=0.5)
    samplers = {s: BatchSampler(data.splits[s], 16, 4, seed=0)
                for s in ("train", "val")}
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    model.train()
    losses = estimate_loss(model, samplers, eval_iters=3)
    assert model.training and seen == [False] * 6
    assert set(losses) == {"train", "val"} and not losses["val"].requires_grad
    assert losses["val"].item() == pytest.approx(math.log(data.vocab_size), rel=0.2)
    model.eval()
    estimate_loss(model, samplers, eval_iters=1)
    assert not model.training


def test_train_config_validation():
    with pytest.raises(ConfigError, match="batch_size must be positive, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="lr must be positive"):
        TrainConfig(lr=-1.0)
    with pytest.raises(ConfigError, match="max_iters must be int"):
        TrainConfig(max_iters=1.5)
    with pytest.raises(ConfigError, match="unknown training settings"):
        TrainConfig.from_dict({"learning_rate": 1e-3})
    with pytest.raises(ConfigError, match="unknown dtype"):
        TrainConfig(dtype="float8")
    assert TrainConfig(lr=1).lr == 1.0 and isinstance(TrainConfig(lr=1).lr, float)


@pytest.mark.parametrize("name", ["cpu-small", "shakespeare-char", "gpt2", "gpt2-medium",
                                  "gpt2-large", "gpt2-xl"])
def test_every_preset_train_table_is_a_valid_config(name):
    TrainConfig.from_dict(load_preset(name)["train"])


def test_settings_precedence_flags_over_file_over_preset(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nn_layer = 3\n[train]\nlr = 0.005\nbatch_size = 7\n")
    model, cfg = resolve_configs("cpu-small", path, {"n_embd": 64}, {"batch_size": 5})
    assert model["n_layer"] == 3 and model["n_embd"] == 64 and model["n_head"] == 4
    assert cfg.lr == 0.005 and cfg.batch_size == 5
    assert cfg.warmup_iters == load_preset("cpu-small")["train"]["warmup_iters"]
    path.write_text("[optimizer]\nlr = 1\n")
    with pytest.raises(ConfigError, match="unknown tables"):
        resolve_configs("cpu-small", path, {}, {})


def run_tiny(data, run_dir, max_iters, resume=False, **overrides) -> Trainer:
    settings = dict(max_iters=max_iters, batch_size=4, eval_interval=4, eval_iters=2,
                    log_interval=1, warmup_iters=2, lr_decay_iters=8, lr=3e-3, seed=3)
    cfg = TrainConfig(**{**settings, **overrides})
    model = build_model({**TINY, "dropout": 0.1}, data.vocab_size, seed=cfg.seed)
    trainer = Trainer(model, cfg, data, run_dir)
    if resume:
        trainer.resume()
    trainer.run()
    return trainer


@pytest.mark.slow
def test_resume_is_bitwise_exact(tmp_path, data):
    """8 steps in one go == 4 steps, then a fresh process-like resume for 4 more."""
    whole = run_tiny(data, tmp_path / "whole", 8)
    run_tiny(data, tmp_path / "split", 4)
    assert load_train_state(tmp_path / "split").iteration == 4
    torch.manual_seed(999)  # the resumed run must not depend on what ran before it
    split = run_tiny(data, tmp_path / "split", 8, resume=True)
    losses = [[r["loss"] for r in read_metrics(tmp_path / d) if "loss" in r]
              for d in ("whole", "split")]
    assert len(losses[0]) == 8 and losses[0] == losses[1]
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for d in ("whole", "split"):
        assert (tmp_path / d / "loss.png").stat().st_size > 0


def test_resume_settings_keep_the_model_and_take_new_training_settings(tmp_path, data):
    run_tiny(data, tmp_path / "run", 4)
    cfg, data_dir = resume_settings(tmp_path / "run", {"n_layer": 2}, {"max_iters": 12})
    assert cfg.max_iters == 12 and cfg.batch_size == 4  # the rest is the run's own
    assert data_dir == data.dir.resolve()
    with pytest.raises(ConfigError, match=r"n_embd=32 \(the run has 16\)"):
        resume_settings(tmp_path / "run", {"n_embd": 32}, {})


def test_finetuning_keeps_the_weights_and_only_dropout_may_change(tmp_path, data, small_text):
    trainer = run_tiny(data, tmp_path / "run", 4)
    model = model_for_finetuning(tmp_path / "run", data, {"dropout": 0.3})
    assert model.training and model.config.dropout == 0.3
    for a, b in zip(model.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(a, b.cpu())
    with pytest.raises(ConfigError, match="only dropout may change"):
        model_for_finetuning(tmp_path / "run", data, {"n_layer": 3})
    prepare(tmp_path / "bpe", small_text, "bpe", 300)
    with pytest.raises(DataError, match="tokenizer differs"):
        model_for_finetuning(tmp_path / "run", PreparedData(tmp_path / "bpe"), {})


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path, data, monkeypatch):
    real_step, calls = train_step, []

    def step_that_diverges(*args, **kwargs):
        calls.append(1)
        loss = real_step(*args, **kwargs)
        return loss * float("nan") if len(calls) == 6 else loss

    monkeypatch.setattr("glassgpt.training.trainer.train_step", step_that_diverges)
    with pytest.raises(NonFiniteLossError, match="at iteration 6"):
        run_tiny(data, tmp_path / "run", 8)
    assert load_train_state(tmp_path / "run").iteration == 4  # the evaluation at step 4
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert all(math.isfinite(json.loads(line).get("loss", 0.0)) for line in metrics)


def test_autocast_dtype_on_a_cpu_is_opt_in_bf16():
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) is None  # full precision unless asked
    assert autocast_dtype("float32", cpu) is None
    assert autocast_dtype("bfloat16", cpu) is torch.bfloat16
    with pytest.raises(ConfigError, match="float16 needs CUDA"):
        autocast_dtype("float16", cpu)


@pytest.mark.slow
def test_bf16_autocast_training_on_a_cpu_keeps_fp32_weights_and_follows_fp32(tmp_path, data):
    """`train --dtype bfloat16` on a CPU: matmuls in bf16, weights and optimizer in fp32, and
    losses that track the fp32 run's closely."""
    fp32 = run_tiny(data, tmp_path / "fp32", 6, dtype="float32")
    bf16 = run_tiny(data, tmp_path / "bf16", 6, dtype="bfloat16")
    assert bf16.amp_dtype is torch.bfloat16 and fp32.amp_dtype is None
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    losses = [[r["loss"] for r in read_metrics(tmp_path / d) if "loss" in r]
              for d in ("fp32", "bf16")]
    assert losses[0] != losses[1]  # bf16 really ran: its rounding shows
    assert losses[1] == pytest.approx(losses[0], rel=0.02)


def test_training_memory_counts_16_bytes_a_parameter_and_one_micro_batch():
    config = tiny_config(vocab_size=50)
    params = count_parameters(GPT(config))
    parts = training_memory(config, batch_size=4, amp_dtype=None, parameters=params)
    assert parts["weights"] == parts["gradients"] == 4 * params
    assert parts["AdamW moments"] == 8 * params
    tokens = 4 * 16  # B * T
    per_token = 2 * 20 * 16  # layers * floats per layer (in units of C) * C
    assert parts["activations"] == tokens * per_token * 4 + tokens * 50 * 4 * 3  # + logits
    assert training_memory(config, 4, torch.bfloat16, params)["activations"] < \
        parts["activations"]


def test_a_training_step_too_big_for_the_machine_is_refused_before_anything_is_allocated(
        data, tmp_path):
    model = build_model(TINY, data.vocab_size, seed=0)
    with pytest.raises(ConfigError, match=r"training needs about .* batch_size=100000000"):
        Trainer(model, TrainConfig(batch_size=100_000_000, device="cpu"), data, tmp_path / "r")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("setting", ["lr", "min_lr", "weight_decay", "grad_clip"])
def test_infinite_float_settings_are_refused(setting):
    with pytest.raises(ConfigError, match=f"{setting} must be a finite number, got inf"):
        TrainConfig(**{setting: math.inf})


def test_optimizer_state_is_checked_before_adamw_sees_it(tmp_path, data):
    trainer = run_tiny(data, tmp_path / "run", 2)
    state = load_train_state(tmp_path / "run", adamw_state_shapes(trainer.optimizer))
    optimizer = trainer.optimizer
    groups = state.optimizer["param_groups"]
    with pytest.raises(CheckpointError, match="parameter groups do not fit"):
        load_adamw_state(optimizer, {**state.optimizer, "param_groups": groups[::-1]}, tmp_path)
    extra = {i: {**values, "max_exp_avg_sq": values["exp_avg_sq"]}
             for i, values in state.optimizer["state"].items()}
    with pytest.raises(CheckpointError, match="AdamW keeps"):
        load_adamw_state(optimizer, {**state.optimizer, "state": extra}, tmp_path)
    load_adamw_state(optimizer, state.optimizer, tmp_path)  # the real one loads
