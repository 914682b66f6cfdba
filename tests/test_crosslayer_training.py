"""Training cross-layer transcoders (glassgpt.interp.sae.training.crosslayer_*): the objective
and its gradients equal llamascopium's CLT on one batch (its fixture:
tests/data/llamascopium/, remade by make_clt_reference.py in a throwaway venv)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.interp.sae.training.crosslayer_objective import crosslayer_step

LLAMASCOPIUM = Path(__file__).parent / "data" / "llamascopium" / "clt_reference.safetensors"


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(LLAMASCOPIUM)


def test_objective_and_gradients_equal_llamascopiums(reference: dict) -> None:
    """llamascopium's loss averages over the layers where the paper (and glassgpt) sums: the
    loss, its two terms and every gradient are L times its own."""
    ref = reference
    n_layers, d_model, d_tc = ref["W_E"].shape
    window, stretch, l1 = ref["settings"].tolist()
    clt = CrossLayerTranscoder(n_layers, d_model, d_tc, dtype=torch.float64)
    log_threshold = ref["log_jumprelu_threshold"].clone().requires_grad_(True)
    with torch.no_grad():
        clt.W_enc.copy_(ref["W_E"])  # the same layout: (L, d_model, d_sae)
        clt.b_enc.copy_(ref["b_E"])
        for t in range(n_layers):  # theirs: W_D[t][s] writes from layer s into layer t
            clt.b_dec[t].copy_(ref[f"b_D.{t}"])
            for s in range(t + 1):
                clt.W_dec[s][:, t - s].copy_(ref[f"W_D.{t}"][s])
    x = torch.stack([ref[f"x.{l}"] for l in range(n_layers)])  # (L, N, d)
    y = torch.stack([ref[f"y.{l}"] for l in range(n_layers)])
    out = crosslayer_step(clt, log_threshold, x, y, l1, stretch, window)
    out.loss.backward()
    L = n_layers
    exact = {"atol": 1e-12, "rtol": 1e-12}
    torch.testing.assert_close(out.loss.detach(), L * ref["loss"], **exact)
    torch.testing.assert_close(out.terms["mse_loss"], L * ref["l_rec"], **exact)
    torch.testing.assert_close(out.terms["sparsity_loss"], L * ref["l_s"], **exact)
    torch.testing.assert_close(clt.W_enc.grad, L * ref["grad.W_E"], **exact)
    torch.testing.assert_close(clt.b_enc.grad, L * ref["grad.b_E"], **exact)
    torch.testing.assert_close(log_threshold.grad, L * ref["grad.log_jumprelu_threshold"],
                               **exact)
    assert (log_threshold.grad != 0).sum() > 5  # the estimator's window holds some
    for t in range(L):
        torch.testing.assert_close(clt.b_dec.grad[t], L * ref[f"grad.b_D.{t}"], **exact)
        for s in range(t + 1):
            torch.testing.assert_close(clt.W_dec[s].grad[:, t - s],
                                       L * ref[f"grad.W_D.{t}"][s], **exact)
