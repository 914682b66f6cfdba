"""llamascopium's cross-layer transcoder objective and its gradients on one batch: the reference
tests/test_crosslayer_training.py holds glassgpt's CLT objective to.

llamascopium (PyPI, 2.0.0b34) wants TransformerLens < 4 and transformers >= 4.57.1, which
circuit-tracer's venv already holds; a throwaway venv borrows its packages, offline, on a CPU:
    python3.11 -m venv /tmp/lsv
    echo /tmp/ct/lib/python3.11/site-packages > /tmp/lsv/lib/python3.11/site-packages/ct.pth
    /tmp/lsv/bin/pip install --no-deps llamascopium==2.0.0b34 pydantic-settings cattrs \
        json-repair pymongo openai python-dotenv tomlkit more-itertools typer
    /tmp/lsv/bin/python tests/data/llamascopium/make_clt_reference.py tests/data/llamascopium

Writes clt_reference.safetensors: a JumpReLU CLT of 3 layers (d_model 6, 10 features a layer)
in llamascopium's own layout (W_E (L, d_model, d_sae), b_E, W_D.{t} (t + 1, d_sae, d_model):
the decoders from layers 0..t into layer t, b_D.{t}, log_jumprelu_threshold (L, d_sae)), a
batch (x.{l}, y.{l}: (16, d_model) each layer's input and target), and in float64 what
`CrossLayerTranscoder.compute_loss(batch, sparsity_loss_type="tanh", ...)` returns (loss, l_rec,
l_s) and the gradients of the loss (grad.<parameter>). Its settings: act_fn jumprelu,
sparsity_include_decoder_norm False (the form circuit-tracer loads), jumprelu_threshold_window
(the straight-through estimator's width) 0.5, tanh_stretch_coefficient 4, l1_coefficient 0.3.
"""
import sys
from pathlib import Path

import torch
from llamascopium.models.clt import CLTConfig, CrossLayerTranscoder
from safetensors.torch import save_file

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
L, D, F, N = 3, 6, 10, 16
SETTINGS = {"window": 0.5, "tanh_stretch_coefficient": 4.0, "l1_coefficient": 0.3}


def main() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(55)
    cfg = CLTConfig(sae_type="clt", d_model=D, expansion_factor=F / D, act_fn="jumprelu",
                    hook_points_in=[f"in.{l}" for l in range(L)],
                    hook_points_out=[f"out.{l}" for l in range(L)],
                    sparsity_include_decoder_norm=False, use_decoder_bias=True,
                    jumprelu_threshold_window=SETTINGS["window"], device="cpu",
                    dtype=torch.float64, norm_activation="inference")
    assert cfg.d_sae == F, cfg.d_sae
    clt = CrossLayerTranscoder(cfg)
    with torch.no_grad():
        clt.W_E.copy_(torch.randn(L, D, F, generator=g, dtype=torch.float64) / D ** 0.5)
        clt.b_E.copy_(0.2 * torch.randn(L, F, generator=g, dtype=torch.float64))
        for t in range(L):
            clt.W_D[t].copy_(0.4 * torch.randn(t + 1, F, D, generator=g, dtype=torch.float64))
            clt.b_D[t].copy_(0.1 * torch.randn(D, generator=g, dtype=torch.float64))
        # thresholds near the pre-activations, so that the estimator's window holds some
        log_threshold = torch.log(0.2 + 0.6 * torch.rand(L, F, generator=g, dtype=torch.float64))
        clt.activation_function.log_jumprelu_threshold.copy_(log_threshold)
    batch = {}
    for l in range(L):
        batch[f"in.{l}"] = torch.randn(N, D, generator=g, dtype=torch.float64)
        batch[f"out.{l}"] = torch.randn(N, D, generator=g, dtype=torch.float64)
    batch["tokens"] = torch.zeros(N, dtype=torch.long)
    out = clt.compute_loss(batch, sparsity_loss_type="tanh",
                           tanh_stretch_coefficient=SETTINGS["tanh_stretch_coefficient"],
                           l1_coefficient=SETTINGS["l1_coefficient"])
    out["loss"].backward()
    tensors = {"W_E": clt.W_E, "b_E": clt.b_E,
               "log_jumprelu_threshold": clt.activation_function.log_jumprelu_threshold}
    for t in range(L):
        tensors[f"W_D.{t}"], tensors[f"b_D.{t}"] = clt.W_D[t], clt.b_D[t]
    saved = {name: t.detach().clone() for name, t in tensors.items()}
    saved |= {f"grad.{name}": t.grad.detach().clone() for name, t in tensors.items()}
    for l in range(L):
        saved[f"x.{l}"], saved[f"y.{l}"] = batch[f"in.{l}"], batch[f"out.{l}"]
    saved["loss"] = out["loss"].detach().reshape(())
    saved["l_rec"] = out["l_rec"].detach().reshape(())
    saved["l_s"] = out["l_s"].detach().mean().reshape(())
    saved["settings"] = torch.tensor([SETTINGS["window"], SETTINGS["tanh_stretch_coefficient"],
                                      SETTINGS["l1_coefficient"]], dtype=torch.float64)
    active = (out["feature_acts"] > 0).double().mean().item()
    print(f"loss {saved['loss'].item():.6f} (l_rec {saved['l_rec'].item():.6f}, l_s "
          f"{saved['l_s'].item():.6f}); {active:.2f} of the features active; threshold grads "
          f"non-zero: {int((saved['grad.log_jumprelu_threshold'] != 0).sum())}")
    save_file({k: v.contiguous() for k, v in saved.items()}, OUT / "clt_reference.safetensors")


if __name__ == "__main__":
    main()
