"""Training dictionaries (glassgpt.interp.sae.training) and SAELens's metrics
(glassgpt.interp.sae.metrics): a toy with known features recovered, metrics equal to their
definitions computed by hand, a resume bit for bit, a stop that saves, the CLI."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.interp import run_with_cache, run_with_hooks
from glassgpt.interp.sae import SAE
from glassgpt.interp.sae.metrics import evaluate_dictionary
from glassgpt.interp.sae.training import DictionarySettings, DictionaryTrainer
from glassgpt.model import GPT


class SparseToy:
    """Activations that are sparse sums of `n` unit ground-truth directions in `d`
    dimensions (more directions than dimensions: superposition), each present with
    probability `p` at a size in [0.5, 1.5)."""

    def __init__(self, d: int = 16, n: int = 32, p: float = 0.06, batch: int = 256,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.directions = F.normalize(torch.randn(n, d, generator=g), dim=-1)  # (n, d)
        self.p, self.batch = p, batch
        self.generator = torch.Generator().manual_seed(seed + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g, n = self.generator, self.directions.shape[0]
        present = torch.rand(self.batch, n, generator=g) < self.p
        sizes = 0.5 + torch.rand(self.batch, n, generator=g)
        x = (present * sizes) @ self.directions  # (batch, d)
        return x, x

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def settings_before_issue_53(architecture: str) -> dict:
    """The settings whose defaults issue 53 changed, at their old values (what these tests
    were written for): no activation scaling, no resampling where the architecture reads it."""
    old = {"normalize_activations": "none"}
    if architecture in ("standard", "jumprelu"):
        old["resample_every"] = 0
    return old


def toy_settings(**overrides) -> DictionarySettings:
    fields = dict(hook="blocks.0.hook_resid_post", d_sae=64, architecture="topk",
                  tokens=256 * 300, batch_tokens=256, lr=3e-3, lr_warm_up_steps=10,
                  eval_every=0, checkpoint_every=0, dead_tokens=256 * 50)
    architecture = overrides.get("architecture", fields["architecture"])
    return DictionarySettings(**{**fields, **settings_before_issue_53(architecture),
                                 **overrides})


def train_toy(out: Path, settings: DictionarySettings, **kwargs) -> DictionaryTrainer:
    trainer = DictionaryTrainer(settings, SparseToy(), 16, 16, out, **kwargs)
    trainer.run()
    return trainer


def mean_max_cosine(sae: SAE, directions: torch.Tensor) -> float:
    decoder = F.normalize(sae.W_dec.detach(), dim=-1)  # (d_sae, d)
    return float((directions @ decoder.T).max(dim=1).values.mean())


@pytest.mark.parametrize("architecture, extra", [("topk", {"k": 4}),
                                                 ("standard", {"l1_coefficient": 0.3})])
def test_training_recovers_the_toy_features(tmp_path: Path, architecture: str,
                                            extra: dict) -> None:
    settings = toy_settings(architecture=architecture, **extra)
    train_toy(tmp_path / "sae", settings)
    saved = SAE.load(tmp_path / "sae")
    assert saved.cfg.architecture == architecture
    assert mean_max_cosine(saved, SparseToy().directions) > 0.9


@pytest.mark.parametrize("architecture, extra", [("batchtopk", {"k": 2.0}),
                                                 ("jumprelu", {"l0_coefficient": 0.03})])
def test_batchtopk_and_jumprelu_save_as_saelens_runs_them(tmp_path: Path, architecture: str,
                                                          extra: dict) -> None:
    trainer = train_toy(tmp_path / "sae", toy_settings(architecture=architecture,
                                                      tokens=256 * 60, **extra))
    saved = SAE.load(tmp_path / "sae")
    assert saved.cfg.architecture == "jumprelu"
    if architecture == "batchtopk":  # one threshold, the batch's, for every latent
        assert saved.cfg.metadata.training_architecture == "batchtopk"
        assert torch.equal(saved.threshold, torch.full((64,), float(trainer.batch_threshold)))
        assert float(trainer.batch_threshold) > 0
        torch.testing.assert_close(saved.W_dec.norm(dim=-1), torch.ones(64))  # folded
    else:
        assert torch.equal(saved.threshold, trainer.sae.threshold.detach())
        assert not torch.equal(saved.threshold, torch.full((64,), 0.01))  # it was trained
    x, _ = SparseToy(seed=5).next_batch()
    assert 0 < float((saved.encode(x) != 0).float().sum(-1).mean()) < 32  # neither dead nor dense


def test_topk_saved_folded_encodes_as_trained(tmp_path: Path) -> None:
    trainer = train_toy(tmp_path / "sae", toy_settings(architecture="topk", k=4,
                                                       tokens=256 * 20))
    saved = SAE.load(tmp_path / "sae")
    assert saved.cfg.rescale_acts_by_decoder_norm is True
    x, _ = SparseToy(seed=5).next_batch()
    with torch.no_grad():
        trained_view = trainer.inference_sae()
        torch.testing.assert_close(saved(x), trained_view(x), rtol=0, atol=1e-6)
    assert (saved.W_dec.norm(dim=-1) - 1).abs().max() < 1e-6


def saved_tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return {**load_file(out / "sae_weights.safetensors"),
            **load_file(out / "trainer_state.safetensors")}


@pytest.mark.parametrize("architecture, extra", [("topk", {"k": 4}),
                                                 ("jumprelu", {"l0_coefficient": 0.03})])
def test_resume_continues_bit_for_bit(tmp_path: Path, architecture: str, extra: dict) -> None:
    settings = toy_settings(architecture=architecture, tokens=256 * 40, dead_tokens=256 * 3,
                            **extra)
    train_toy(tmp_path / "straight", settings)
    half = DictionaryTrainer(settings, SparseToy(), 16, 16, tmp_path / "halves")
    stop_at_20 = threading.Event()
    half.report = lambda step, record: stop_at_20.set() if step == 20 else None
    half.stop = stop_at_20
    result = half.run()
    assert (result.interrupted, result.step) == (True, 20)
    again = DictionaryTrainer(settings, SparseToy(), 16, 16, tmp_path / "halves")  # at batch 0
    again.resume()
    assert again.run().step == 40
    straight, halves = saved_tensors(tmp_path / "straight"), saved_tensors(tmp_path / "halves")
    assert straight.keys() == halves.keys()
    for name in straight:
        assert torch.equal(straight[name], halves[name]), name


def test_ctrl_c_saves_a_checkpoint_that_resumes(tmp_path: Path) -> None:
    import os
    import signal
    settings = toy_settings(architecture="topk", k=4, tokens=256 * 30)
    trainer = DictionaryTrainer(settings, SparseToy(), 16, 16, tmp_path / "sae")
    trainer.report = lambda step, record: os.kill(os.getpid(), signal.SIGINT) \
        if step == 5 else None
    result = trainer.run()
    assert (result.interrupted, result.step) == (True, 5)
    assert SAE.load(tmp_path / "sae").cfg.architecture == "topk"
    again = DictionaryTrainer(settings, SparseToy(), 16, 16, tmp_path / "sae")
    again.resume()
    assert again.step == 5 and again.run().step == 30


def test_out_is_replaced_only_with_force_and_only_when_glassgpt_trained_it(tmp_path) -> None:
    from glassgpt.interp.sae.training.trainer import check_out
    train_toy(tmp_path / "sae", toy_settings(architecture="topk", k=4, tokens=256 * 2,
                                                       lr_warm_up_steps=0))
    with pytest.raises(CheckpointError, match="--force"):
        check_out(tmp_path / "sae", force=False, resume=False)
    check_out(tmp_path / "sae", force=True, resume=False)
    (tmp_path / "sae" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="notes.txt"):
        check_out(tmp_path / "sae", force=True, resume=False)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "cfg.json").write_text("{}")
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        check_out(tmp_path / "theirs", force=True, resume=False)


def test_settings_refuse_by_name() -> None:
    with pytest.raises(ConfigError, match="needs k"):
        toy_settings(architecture="topk")
    with pytest.raises(ConfigError, match="architecture 'gated'"):
        toy_settings(architecture="gated")
    with pytest.raises(ConfigError, match="d_sae"):
        toy_settings(d_sae=0)
    with pytest.raises(ConfigError, match="hook_out"):
        toy_settings(architecture="standard", transcoder=True)
    tc = toy_settings(architecture="standard", transcoder=True,
                      hook="blocks.1.ln2.hook_normalized")
    assert tc.hook_out == "blocks.1.hook_mlp_out"


# --- metrics against their definitions ------------------------------------------------------

def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()


def test_metrics_equal_their_definitions_computed_by_hand() -> None:
    from glassgpt.interp.sae import SAEConfig
    model = tiny_model()
    hook = "blocks.0.hook_resid_post"
    torch.manual_seed(1)
    sae = SAE(SAEConfig(32, 64, "topk", k=6, metadata={"hook_name": hook}))
    with torch.no_grad():
        sae.b_enc.normal_(0, 0.1)
    ids = torch.randint(0, 20, (3, 17), generator=torch.Generator().manual_seed(2))
    x_ids, y_ids = ids[:, :-1], ids[:, 1:]
    metrics = evaluate_dictionary(model, sae, [(x_ids, y_ids)])
    _, cache = run_with_cache(model, x_ids, [hook])
    acts = cache[hook].reshape(-1, 32).double()
    f = sae.encode(acts.float()).detach().double()
    recon = sae.decode(f.float()).detach().double()
    mse = (recon - acts).pow(2).sum(-1).mean()
    variance = (acts - acts.mean(0)).pow(2).sum(-1).mean()
    assert metrics.l0 == pytest.approx(6.0)
    assert metrics.mse == pytest.approx(float(mse), rel=1e-6)
    assert metrics.explained_variance == pytest.approx(float(1 - mse / variance), rel=1e-6)
    density = (f != 0).double().mean(0)
    assert torch.equal(metrics.feature_density, density.float())
    assert metrics.dead == int((density == 0).sum()) and metrics.dense == int(
        (density > 0.1).sum())

    def ce(hooks=()):
        logits = run_with_hooks(model, x_ids, list(hooks)).detach()
        return float(F.cross_entropy(logits.reshape(-1, 20).double(), y_ids.reshape(-1)))

    def splice(a, name):
        return sae(a)

    def zero(a, name):
        return torch.zeros_like(a)

    clean, spliced, ablated = ce(), ce([(hook, splice)]), ce([(hook, zero)])
    assert metrics.ce_loss_clean == pytest.approx(clean, rel=1e-6)
    assert metrics.ce_loss_spliced == pytest.approx(spliced, rel=1e-6)
    assert metrics.ce_loss_zero_ablated == pytest.approx(ablated, rel=1e-6)
    assert metrics.ce_loss_recovered == pytest.approx((ablated - spliced) / (ablated - clean))
    counts, edges = metrics.density_histogram(bins=10)
    assert int(counts.sum()) == 64 and len(edges) == 11
    assert int(counts[0]) == metrics.dead  # log10(0 + 1e-10) = -10, the first bin


# --- the command line -------------------------------------------------------------------------

def sae_cli(*args, capsys) -> tuple[int, str, str]:
    from glassgpt.cli import main
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_trains_and_evaluates_on_a_run(trained_run, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sae"
    train = ["sae", "train", trained_run.run, "--hook", "blocks.0.hook_resid_post", "--out",
             out, "--d-sae", "64", "--architecture", "topk", "--k", "4", "--tokens", "6400",
             "--batch-tokens", "128", "--lr", "3e-3", "--eval-every", "25"]
    code, stdout, stderr = sae_cli(*train, capsys=capsys)
    assert code == 0 and "for 50 steps" in stdout and "step 25: L0 4.00" in stderr
    sae = SAE.load(out)
    assert (sae.cfg.hook_name, sae.cfg.d_in, sae.cfg.k) == ("blocks.0.hook_resid_post", 16, 4)
    assert sae.log_sparsity is not None
    code, stdout, _ = sae_cli("sae", "eval", out, "--run", trained_run.run, "--tokens", "256",
                              "--json", capsys=capsys)
    import json
    result = json.loads(stdout)
    # The session's run trained 3 steps: zeroing the stream barely moves its loss, so the score
    # is not between 0 and 1 here; it is SAELens's formula of the three losses
    assert result["ce_loss_recovered"] == pytest.approx(
        (result["ce_loss_zero_ablated"] - result["ce_loss_spliced"])
        / (result["ce_loss_zero_ablated"] - result["ce_loss_clean"]))
    assert result["l0"] == 4.0
    assert result["explained_variance"] > 0.5
    assert sum(result["log10_density_histogram"]["counts"]) == 64
    code, _, stderr = sae_cli(*train, capsys=capsys)  # a second training into the same --out
    assert code == 2 and "--force" in stderr and stderr.count("\n") == 1
    assert sae_cli(*train, "--force", "--tokens", "1280", capsys=capsys)[0] == 0


@pytest.mark.parametrize("change, message", [
    (["--hook", "blocks.0.hook_resid_pots"], "did you mean blocks.0.hook_resid_post"),
    (["--d-sae", str(10**12)], "needs about"),
    (["--architecture", "topk"], "needs k"),
])
def test_cli_refuses_mistakes_in_one_line(trained_run, tmp_path: Path, capsys, change,
                                          message) -> None:
    args = {"--hook": "blocks.0.hook_resid_post", "--d-sae": "32", "--out": tmp_path / "s",
            "--tokens": "1280", "--batch-tokens": "128"}
    args.update(dict(zip(change[::2], change[1::2], strict=True)))
    code, _, stderr = sae_cli("sae", "train", trained_run.run,
                              *[x for pair in args.items() for x in pair], capsys=capsys)
    assert code == 2 and message in stderr and stderr.count("\n") == 1
    assert not (tmp_path / "s").exists()


def test_nan_activations_are_refused(tmp_path: Path) -> None:
    from glassgpt.errors import DataError
    from glassgpt.interp.sae.training.activations import check_finite_activations
    check_finite_activations(torch.ones(3, 4), "blocks.0.hook_resid_post")
    with pytest.raises(DataError, match="blocks.0.hook_resid_post hold NaN"):
        check_finite_activations(torch.tensor([[1.0, float("nan")]]), "blocks.0.hook_resid_post")


def test_the_command_lines_defaults_are_the_settings_own() -> None:
    """`glassgpt sae train`'s flags show their defaults in --help, which imports no torch, so
    the numbers stand in the CLI too; this holds them to DictionarySettings's, the one source."""
    import dataclasses

    from glassgpt.cli import build_parser
    from glassgpt.cli.sae import ARCHITECTURES as CLI_ARCHITECTURES
    from glassgpt.interp.sae.training import ARCHITECTURES

    sae = build_parser()._subparsers._group_actions[0].choices["sae"]
    train = sae._subparsers._group_actions[0].choices["train"]
    flags = {action.dest: action.default for action in train._actions}
    fields = {field.name: field.default for field in dataclasses.fields(DictionarySettings)}
    same_as = {"l1": "l1_coefficient", "l0": "l0_coefficient", "tokens": "tokens",
               "batch_tokens": "batch_tokens", "lr": "lr", "eval_every": "eval_every",
               "checkpoint_every": "checkpoint_every", "seed": "seed",
               "architecture": "architecture"}
    assert {flag: flags[flag] for flag in same_as} == {
        flag: fields[field] for flag, field in same_as.items()}
    assert CLI_ARCHITECTURES == ARCHITECTURES
