"""A TopK or BatchTopK training step sparse in both directions (issue 53, goal 5:
glassgpt.interp.sae.training.sparse) computes what the dense step computes: the loss, its
terms, the firing counts, the batch threshold and every weight's gradient, equal in float64 to
a dense step written as SAELens writes it (the (N, d_sae) latents, AuxK among the dead
latents, autograd through all of it)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from glassgpt.interp.sae import SAE
from glassgpt.interp.sae.encoding import pre_acts
from glassgpt.interp.sae.training import DictionarySettings
from glassgpt.interp.sae.training.objective import training_step
from glassgpt.interp.sae.training.sparse import kept_of_flat, latent_sums, row_sums
from glassgpt.interp.sae.training.trainer import build_sae

D_IN, D_SAE, N = 8, 24, 40


def _dense_latents(ranked: Tensor, architecture: str, k: float) -> Tensor:
    """The kept latents of pre * n (N, d_sae), zeros elsewhere."""
    if architecture == "topk":
        top = ranked.topk(int(k), dim=-1)
        return torch.zeros_like(ranked).scatter(-1, top.indices, top.values.relu())
    flat = ranked.relu().flatten()
    top = flat.topk(int(k * ranked.shape[0]))
    return torch.zeros_like(flat).scatter(-1, top.indices, top.values).view(ranked.shape)


def dense_step(sae: SAE, settings: DictionarySettings, x: Tensor, y: Tensor,
               dead: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """The loss, its terms and the latents (N, d_sae), every product dense."""
    norms = sae.W_dec.norm(dim=-1)  # (d_sae,)
    ranked = pre_acts(sae, x) * norms  # (N, d_sae)
    f = _dense_latents(ranked, settings.architecture, settings.k)
    x_hat = (f / norms) @ sae.W_dec + sae.b_dec
    terms = {"mse_loss": (x_hat - y).pow(2).sum(-1).mean()}
    k_aux = min(D_IN // 2, int(dead.sum()))
    top = torch.where(dead[None], ranked, -torch.inf).topk(k_aux, dim=-1)
    aux = torch.zeros_like(ranked).scatter(-1, top.indices, top.values)
    error = (y - x_hat).detach()
    scale = min(int(dead.sum()) / (D_IN // 2), 1.0)
    auxk = scale * ((aux / norms) @ sae.W_dec - error).pow(2).sum(-1).mean()
    terms["auxk_loss"] = settings.aux_loss_coefficient * auxk
    return sum(terms.values()), terms, f


def _dictionary(architecture: str, centred: bool) -> tuple[SAE, DictionarySettings]:
    settings = DictionarySettings(
        hook="blocks.0.hook_resid_post", d_sae=D_SAE, architecture=architecture,
        k=3 if architecture == "topk" else 2.5, tokens=N, batch_tokens=N)
    torch.manual_seed(0)
    sae = build_sae(settings, D_IN, D_IN, {}).double()
    sae.cfg.apply_b_dec_to_input = centred  # uncentred: no gradient to b_dec through x
    with torch.no_grad():  # biases and uneven decoder norms, as after some training
        for name in ("b_enc", "b_dec"):
            getattr(sae, name).normal_(0, 0.3)
        sae.W_dec.mul_(torch.rand(D_SAE, 1, dtype=torch.float64) + 0.5)
    return sae, settings


def _gradients(sae: SAE) -> dict[str, Tensor]:
    grads = {name: p.grad.clone() for name, p in sae.named_parameters() if p.grad is not None}
    sae.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("architecture", ["topk", "batchtopk"])
@pytest.mark.parametrize("centred", [True, False], ids=["centred", "uncentred"])
@pytest.mark.parametrize("n_dead", [0, 2, D_SAE], ids=["none-dead", "few-dead", "all-dead"])
def test_the_sparse_step_equals_the_dense_one(architecture: str, centred: bool,
                                              n_dead: int) -> None:
    sae, settings = _dictionary(architecture, centred)
    x = torch.randn(N, D_IN, dtype=torch.float64)
    y = x + 0.1 * torch.randn(N, D_IN, dtype=torch.float64)  # a target apart from x too
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[torch.randperm(D_SAE)[:n_dead]] = True
    threshold = torch.tensor(0.25, dtype=torch.float64)
    out = training_step(sae, settings, x, y, 0.0, dead, threshold)
    out.loss.backward()
    sparse = _gradients(sae)
    loss, terms, f = dense_step(sae, settings, x, y, dead)
    loss.backward()
    dense = _gradients(sae)
    assert set(sparse) == set(dense) == {"W_enc", "b_enc", "W_dec", "b_dec"}
    for name in dense:
        torch.testing.assert_close(sparse[name], dense[name], rtol=0, atol=1e-10)
    torch.testing.assert_close(out.loss.detach(), loss.detach(), rtol=0, atol=1e-10)
    for name, term in terms.items():
        torch.testing.assert_close(out.terms[name], term.detach(), rtol=0, atol=1e-10)
    assert torch.equal(out.firing, torch.count_nonzero(f, dim=0))
    if architecture == "batchtopk":  # the moving average of the smallest kept latent
        lr = settings.topk_threshold_lr
        expected = 0.25 * (1 - lr) + lr * float(f.detach()[f > 0].min())
        assert float(threshold) == pytest.approx(expected, abs=1e-12)


def test_the_sparse_products_are_the_dense_matrix_products() -> None:
    """S @ table and S^T @ dense for a sparse S (N, d_sae) whose rows keep varying numbers of
    entries, some none (a BatchTopK batch)."""
    generator = torch.Generator().manual_seed(2)
    n, d_sae = 6, 10
    flat = torch.randperm(n * d_sae, generator=generator)[:17]
    flat = flat[flat // d_sae != 3]  # row 3 keeps nothing
    kept = kept_of_flat(flat, n, d_sae)
    weights = torch.randn(kept.cols.numel(), dtype=torch.float64, generator=generator)
    s = torch.zeros(n, d_sae, dtype=torch.float64)
    s[kept.rows, kept.cols] = weights
    table = torch.randn(d_sae, 5, dtype=torch.float64, generator=generator)
    dense = torch.randn(n, 5, dtype=torch.float64, generator=generator)
    torch.testing.assert_close(row_sums(kept, weights, table), s @ table, rtol=0, atol=1e-12)
    torch.testing.assert_close(latent_sums(kept, weights, dense), s.T @ dense, rtol=0,
                               atol=1e-12)
