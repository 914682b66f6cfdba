"""Training cross-layer transcoders (glassgpt.interp.sae.training.crosslayer_*): the objective
and its gradients equal llamascopium's CLT on one batch (its fixture:
tests/data/llamascopium/, remade by make_clt_reference.py in a throwaway venv)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError
from glassgpt.interp import run_with_hooks
from glassgpt.interp.sae.circuit_tracer_clt import load_clt
from glassgpt.interp.sae.crosslayer import CrossLayerTranscoder
from glassgpt.interp.sae.crosslayer_metrics import (
    evaluate_crosslayer,
    layer_activations,
    spliced_logits,
)
from glassgpt.interp.sae.training.crosslayer_objective import crosslayer_step
from glassgpt.interp.sae.training.crosslayer_settings import CrossLayerSettings
from glassgpt.interp.sae.training.crosslayer_trainer import CrossLayerTrainer
from glassgpt.model import GPT

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


# --- the trainer ------------------------------------------------------------------------------

class LayeredToy:
    """Every layer's input a sparse sum of 24 directions (8 wide); each layer's output the
    sum of what the features of it and the layers before it write: a cross-layer structure."""

    def __init__(self, n_layers: int = 3, d: int = 8, n: int = 24, batch: int = 128):
        g = torch.Generator().manual_seed(0)
        self.directions = torch.randn(n_layers, n, d, generator=g) / d ** 0.5
        self.writes = torch.randn(n_layers, n_layers, n, d, generator=g) / d ** 0.5
        self.batch, self.n = batch, n
        self.generator = torch.Generator().manual_seed(1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.directions.shape[0]
        sizes = torch.rand(L, self.batch, self.n, generator=self.generator)
        f = sizes * (torch.rand(L, self.batch, self.n, generator=self.generator) < 0.1)
        x = torch.einsum("lbn,lnd->lbd", f, self.directions)
        y = torch.stack([sum(f[s] @ self.writes[s, t] for s in range(t + 1)) for t in range(L)])
        return x, 3.0 * y  # targets on another scale than inputs

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def toy_clt_settings(**overrides) -> CrossLayerSettings:
    fields = dict(d_transcoder=16, tokens=128 * 20, batch_tokens=128, lr=3e-3, eval_every=0,
                  checkpoint_every=0, l1_coefficient=1e-2)
    return CrossLayerSettings(**{**fields, **overrides})


def trained_files(out: Path) -> dict[str, torch.Tensor]:
    return {f"{p.name}:{k}": v for p in sorted(out.glob("*.safetensors"))
            for k, v in load_file(p).items()}


@pytest.mark.slow  # the first Adam of a process imports torch's compiler: seconds
@pytest.mark.parametrize("architecture, extra", [("jumprelu", {}), ("topk", {"k": 3})])
def test_resume_continues_bit_for_bit(tmp_path: Path, architecture: str, extra: dict) -> None:
    import threading

    settings = toy_clt_settings(architecture=architecture, **extra)
    CrossLayerTrainer(settings, LayeredToy(), 3, 8, tmp_path / "straight").run()
    half = CrossLayerTrainer(settings, LayeredToy(), 3, 8, tmp_path / "halves")
    stop_at_10 = threading.Event()
    half.report = lambda step, record: stop_at_10.set() if step == 10 else None
    half.stop = stop_at_10
    assert (half.run().interrupted, half.step) == (True, 10)
    again = CrossLayerTrainer(settings, LayeredToy(), 3, 8, tmp_path / "halves")
    again.resume()
    assert again.step == 10 and again.run().step == 20
    straight, halves = trained_files(tmp_path / "straight"), trained_files(tmp_path / "halves")
    assert straight.keys() == halves.keys()
    for name in straight:
        assert torch.equal(straight[name], halves[name]), name


def test_saved_clt_reads_raw_activations_as_the_trained_one_reads_scaled(tmp_path) -> None:
    """normalize_activations folded into the saved weights: on raw inputs the saved CLT (read
    back from circuit-tracer's files) gives the trained CLT's features on scaled inputs and
    its reconstructions unscaled."""
    trainer = CrossLayerTrainer(toy_clt_settings(), LayeredToy(), 3, 8, tmp_path / "clt")
    trainer.run()
    saved = load_clt(tmp_path / "clt")
    assert saved.activation == "jumprelu" and saved.input_hook_at(0) == \
        "blocks.0.ln2.hook_normalized"
    a, b = trainer.scaling.float()
    assert not torch.allclose(a, b)  # the toy's targets are on another scale
    x, _ = LayeredToy().next_batch()
    with torch.no_grad():
        trained = trainer.clt
        trained.threshold.copy_(trainer.log_threshold.exp())
        f = trained.encode(x * a[:, None, None])
        torch.testing.assert_close(saved.encode(x), f, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(saved.decode(f), trained.decode(f) / b[:, None, None],
                                   atol=1e-5, rtol=1e-5)


def test_ctrl_c_saves_a_checkpoint_that_resumes(tmp_path: Path) -> None:
    import os
    import signal
    settings = toy_clt_settings()
    trainer = CrossLayerTrainer(settings, LayeredToy(), 3, 8, tmp_path / "clt")
    trainer.report = lambda step, record: os.kill(os.getpid(), signal.SIGINT) \
        if step == 5 else None
    result = trainer.run()
    assert (result.interrupted, result.step) == (True, 5)
    again = CrossLayerTrainer(settings, LayeredToy(), 3, 8, tmp_path / "clt")
    again.resume()
    assert again.step == 5 and again.run().step == 20
    with pytest.raises(ConfigError, match="other settings"):
        CrossLayerTrainer(toy_clt_settings(lr=1e-2), LayeredToy(), 3, 8,
                          tmp_path / "clt").resume()


def test_the_settings_refuse_by_name() -> None:
    with pytest.raises(ConfigError, match="k must be in 1..16"):
        toy_clt_settings(architecture="topk")
    with pytest.raises(ConfigError, match="k is a setting of topk"):
        toy_clt_settings(k=3)
    with pytest.raises(ConfigError, match="input_point"):
        toy_clt_settings(input_point="blocks.0.ln2.hook_normalized")


# --- the metrics ------------------------------------------------------------------------------

def test_spliced_run_and_metrics_are_their_definitions() -> None:
    """The spliced logits replace every MLP output at once, each encoder reading the spliced
    model's own input: computed here layer by layer with the outputs fixed as constants."""
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=3, n_head=2, n_embd=16)).eval()
    torch.manual_seed(3)
    clt = CrossLayerTranscoder(3, 16, 24, "relu")
    with torch.no_grad():
        clt.b_enc.normal_(0, 0.1)
        clt.b_dec.normal_(0, 0.1)
    ids = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(4))
    x_ids, y_ids = ids[:, :-1], ids[:, 1:]
    fixed: list[torch.Tensor] = []
    inputs: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for layer in range(3):
            hooks = [(clt.output_hook_at(s), lambda a, name, s=s: fixed[s]) for s in range(layer)]
            hooks += [(clt.input_hook_at(s), lambda a, name, s=s: inputs.__setitem__(s, a))
                      for s in range(layer + 1)]
            run_with_hooks(model, x_ids, hooks)
            f = [clt.encode_layer(inputs[s], s) for s in range(layer + 1)]
            fixed.append(clt.b_dec[layer] + sum(f[s] @ clt.W_dec[s][:, layer - s]
                                                for s in range(layer + 1)))
        by_hand = run_with_hooks(model, x_ids, [(clt.output_hook_at(s), lambda a, name, s=s:
                                                 fixed[s]) for s in range(3)])
        torch.testing.assert_close(spliced_logits(model, clt, x_ids), by_hand)
        metrics = evaluate_crosslayer(model, clt, [(x_ids, y_ids)])
        spliced = float(F.cross_entropy(by_hand.reshape(-1, 20).double(), y_ids.reshape(-1)))
        x, y = layer_activations(model, clt, x_ids)
        f = clt.encode(x)
        y_hat = clt.decode(f).double()
    assert metrics.ce_loss_spliced == pytest.approx(spliced, rel=1e-9)
    for layer in range(3):
        residual = (y_hat[layer] - y[layer].double()).pow(2).sum(-1).mean()
        variance = (y[layer].double() - y[layer].double().mean(0)).pow(2).sum(-1).mean()
        assert metrics.explained_variance[layer] == pytest.approx(float(1 - residual / variance),
                                                                  rel=1e-6)
        assert metrics.l0[layer] == pytest.approx(float((f[layer] != 0).sum(-1).double().mean()))
    assert metrics.features == 72 and metrics.tokens == 16


# --- the command line -------------------------------------------------------------------------

def test_the_command_trains_resumes_and_circuit_tracer_layout_loads(trained_run, tmp_path,
                                                                     capsys) -> None:
    from glassgpt.cli import main
    from glassgpt.interp.sae.circuit_tracer import load_circuit_tracer

    out = tmp_path / "clt"
    flags = ["--d-transcoder", "16", "--tokens", "256", "--batch-tokens", "64",
             "--eval-every", "2", "--eval-windows", "2", "--context", "16"]
    assert main(["sae", "train-clt", str(trained_run.run), "--out", str(out), *flags]) == 0
    captured = capsys.readouterr()
    assert "training a jumprelu cross-layer transcoder of" in captured.err
    assert "CE loss recovered" in captured.out and "4 steps" in captured.out
    clt = load_circuit_tracer(out)
    assert isinstance(clt, CrossLayerTranscoder) and clt.d_transcoder == 16
    assert clt.metadata["glassgpt_run"] == str(trained_run.run.resolve())
    assert main(["sae", "train-clt", str(trained_run.run), "--out", str(out), "--resume",
                 "--tokens", "384"]) == 0
    assert "6 steps" in capsys.readouterr().out
    assert main(["sae", "train-clt", str(trained_run.run), "--out", str(out), *flags]) != 0
    assert "pass --force" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    ([], "give the number of features a layer (--d-transcoder)"),
    (["--d-transcoder", "8", "--architecture", "topk"], "k must be in 1..8"),
    (["--d-transcoder", "8", "--input-point", "blocks.0.ln2.hook_normalized"], "input_point"),
    (["--d-transcoder", "8", "--input-point", "ln9.hook_normalized"], "ln9.hook_normalized"),
])
def test_the_command_refuses_mistakes_in_one_line(trained_run, tmp_path, capsys, flags,
                                                  says) -> None:
    from tests.helpers_cli import glassgpt, one_error_line

    code, err = glassgpt("sae", "train-clt", trained_run.run, "--out", tmp_path / "clt",
                         "--tokens", "128", "--batch-tokens", "64", *flags, capsys=capsys)
    assert code != 0 and says in one_error_line(err)
    assert not (tmp_path / "clt").exists()
