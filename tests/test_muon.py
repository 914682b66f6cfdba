"""Muon written out (glassgpt.training.muon): the same steps as torch.optim.Muon and AdamW, an
update with singular values near 1, the parameter split, and exact resumption through the
trainer."""

from __future__ import annotations

import pytest
import torch

from glassgpt.config import GPTConfig, TrainConfig
from glassgpt.data import PreparedData, prepare
from glassgpt.errors import ConfigError
from glassgpt.model import GPT, count_parameters
from glassgpt.training.metrics import read_metrics
from glassgpt.training.muon import (
    Muon,
    lr_scale,
    orthogonalise,
    orthogonalise_all,
    orthogonalise_batched,
)
from glassgpt.training.optim import make_optimizer, muon_parameter_split, set_lr
from glassgpt.training.runs import build_model
from glassgpt.training.trainer import Trainer

TINY = dict(block_size=16, n_layer=2, n_head=2, n_embd=16)
SHAPES = [(12, 12), (8, 20), (24, 6)]  # square, wide, tall


def random_problem(seed: int) -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]]]:
    """Matrices and three steps of random gradients for each."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]
    grads = [[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(3)]
    return params, grads


def run_steps(optimizer_class, settings: dict, seed: int) -> list[torch.Tensor]:
    params, grads = random_problem(seed)
    optimizer = optimizer_class(params, **settings)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch 2.9+")
@pytest.mark.parametrize("settings", [
    dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1),
    dict(lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.0),
    dict(lr=0.01, weight_decay=0.01, adjust_lr_fn="match_rms_adamw", ns_steps=3),
])
def test_a_muon_step_equals_torch_optim_muon(settings):
    for seed in range(3):
        ours = run_steps(Muon, settings, seed)
        theirs = run_steps(torch.optim.Muon, settings, seed)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_adamw_groups_step_as_torch_adamw():
    settings = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    for seed in range(2):
        ours = run_steps(lambda ps, **kw: Muon([{"params": ps, "use_muon": False}],
                                               adam_eps=1e-8, **kw), settings, seed)
        theirs = run_steps(lambda ps, **kw: torch.optim.AdamW(ps, eps=1e-8, foreach=False,
                                                              **kw), settings, seed)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (200, 40), (3, 50)])
def test_orthogonalised_update_has_singular_values_near_one(shape):
    """Any full-rank matrix comes out with singular values in about [0.68, 1.21] (the quintic
    polynomial's band), whatever its own spread, and keeps its singular vectors."""
    generator = torch.Generator().manual_seed(sum(shape))
    u, _ = torch.linalg.qr(torch.randn(shape[0], min(shape), generator=generator))
    v, _ = torch.linalg.qr(torch.randn(shape[1], min(shape), generator=generator))
    spread = torch.logspace(0, -1.5, min(shape))  # singular values 1 .. 0.03: ill-conditioned
    grad = 7.0 * u @ torch.diag(spread) @ v.T  # (rows, cols)
    ortho = orthogonalise(grad).float()
    assert ortho.shape == grad.shape and ortho.dtype == torch.float32
    singular = torch.linalg.svdvals(ortho)
    assert singular.min() > 0.6 and singular.max() < 1.25, singular
    # the same directions: U^T O V is close to diagonal
    core = u.T @ ortho @ v
    assert (core - torch.diag(torch.diagonal(core))).abs().max() < 0.05


def test_lr_scale_follows_the_shape():
    assert lr_scale((512, 128)) == 2.0 and lr_scale((128, 512)) == 1.0
    assert lr_scale((100, 400), "match_rms_adamw") == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="unknown Muon lr scale"):
        lr_scale((2, 2), "bogus")


def test_parameter_split_gives_muon_the_hidden_matrices_only():
    model = GPT(GPTConfig(vocab_size=20, tie_weights=False, **TINY))
    names = {id(p): n for n, p in model.named_parameters()}
    split = muon_parameter_split(model)
    muon = sorted(names[id(p)] for p in split["muon"])
    assert muon == sorted(n for n, p in model.named_parameters()
                          if n.startswith("blocks.") and p.dim() == 2)
    assert all(n.endswith(".weight") and ("attn" in n or "ffn" in n) for n in muon)
    decay = {names[id(p)] for p in split["adamw_decay"]}
    assert {"tok_emb.weight", "lm_head.weight"} <= decay  # embeddings and the untied head
    assert all(p.dim() == 1 for p in split["adamw"])  # norms and biases
    assert sum(p.numel() for group in split.values() for p in group) == count_parameters(model)


def test_muon_optimizer_groups_and_lr_ratio():
    model = GPT(GPTConfig(vocab_size=20, **TINY))
    cfg = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.03)
    optimizer = make_optimizer(model, cfg)
    assert isinstance(optimizer, Muon)
    muon_group, *adamw_groups = optimizer.param_groups
    assert muon_group["use_muon"] and not any(g["use_muon"] for g in adamw_groups)
    set_lr(optimizer, 5e-4)  # half of the peak: both halves at half their peak
    assert muon_group["lr"] == pytest.approx(0.015)
    assert all(g["lr"] == pytest.approx(5e-4) for g in adamw_groups)
    with pytest.raises(ConfigError, match="use_muon=False"):
        Muon([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ConfigError, match="unknown optimizer"):
        TrainConfig(optimizer="sgd")


def test_resume_with_muon_is_bitwise_exact(tmp_path, small_text):
    """8 Muon steps in one go == 4 steps, then a resume from the checkpoint for 4 more."""
    prepare(tmp_path / "data", small_text)
    data = PreparedData(tmp_path / "data")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise at a fixed thread count

    def run(run_dir, max_iters, resume=False) -> Trainer:
        cfg = TrainConfig(max_iters=max_iters, batch_size=4, eval_interval=4, eval_iters=2,
                          log_interval=1, warmup_iters=2, lr_decay_iters=8, lr=3e-3, seed=3,
                          optimizer="muon", muon_lr=0.03, schedule="wsd")
        trainer = Trainer(build_model(TINY, data.vocab_size, seed=cfg.seed), cfg, data, run_dir)
        if resume:
            trainer.resume()
        trainer.run()
        return trainer

    try:
        whole = run(tmp_path / "whole", 8)
        run(tmp_path / "split", 4)
        torch.manual_seed(999)  # the resumed run must not depend on what ran before it
        split = run(tmp_path / "split", 8, resume=True)
    finally:
        torch.set_num_threads(threads)
    losses = [[r["loss"] for r in read_metrics(tmp_path / d) if "loss" in r]
              for d in ("whole", "split")]
    assert len(losses[0]) == 8 and losses[0] == losses[1]
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        assert torch.equal(a, b)
    buffers = [s["momentum_buffer"] for s in split.optimizer.state.values()
               if "momentum_buffer" in s]
    assert len(buffers) == 4 * TINY["n_layer"]  # qkv, proj, fc, proj of each block


MIXED_SHAPES = [(12, 12), (8, 20), (24, 6), (12, 12), (8, 20), (24, 6), (24, 6), (5, 7)]


def test_batched_newton_schulz_equals_the_per_matrix_one():
    """One batched iteration per shape gives each matrix's own `orthogonalise`, whatever the
    order and mix of shapes (repeated, square, wide, tall, alone)."""
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=generator) * (i + 1) for i, s in enumerate(MIXED_SHAPES)]
    grads.append(torch.zeros(12, 12))  # all zeros: the eps keeps it finite, as alone
    batched = orthogonalise_all(grads, steps=4)
    assert len(batched) == len(grads)
    for grad, ortho in zip(grads, batched, strict=True):
        torch.testing.assert_close(ortho, orthogonalise(grad, steps=4), rtol=1e-2, atol=1e-3)
    with pytest.raises(ConfigError, match="stack of matrices"):
        orthogonalise_batched(torch.zeros(3, 4))


class PerMatrixMuon(Muon):
    """The reference: each update orthogonalised alone."""

    def orthogonalise_updates(self, updates, group):
        return [orthogonalise(u, group["ns_steps"], group["ns_coefficients"], group["eps"])
                for u in updates]


def test_a_batched_muon_training_step_equals_the_per_matrix_one():
    """Three steps of a tiny GPT (its blocks' matrices share shapes, so they are batched):
    the same weights as with one Newton-Schulz iteration per matrix."""
    models = [GPT(GPTConfig(vocab_size=20, **TINY)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = []
    for optimizer_class, model in zip((Muon, PerMatrixMuon), models, strict=True):
        split = muon_parameter_split(model)
        optimizers.append(optimizer_class([
            {"params": split["muon"]},
            {"params": split["adamw_decay"] + split["adamw"], "use_muon": False}]))
    batch = torch.randint(0, 20, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            model(batch[:, :-1], batch[:, 1:])[1].backward()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
