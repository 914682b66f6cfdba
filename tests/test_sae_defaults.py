"""Issue 53's dictionary-training additions: SAELens's normalize_activations (the scale folded
into the saved weights), Bricken et al.'s resampling of dead latents, and their settings."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

import glassgpt.interp.sae.training.trainer as trainer_module
from glassgpt.errors import ConfigError
from glassgpt.interp.sae import SAE
from glassgpt.interp.sae.training import DictionarySettings, DictionaryTrainer
from glassgpt.interp.sae.training.objective import inference_tensors
from test_sae_train import SparseToy, saved_tensors, toy_settings, train_toy

NORMALIZED = "expected_average_only_in"


class ScaledToy(SparseToy):
    """SparseToy's activations times `x_scale`, its targets times `y_scale`: norms far from
    sqrt(width), and for a transcoder's pair, different scales in and out."""

    def __init__(self, x_scale: float = 7.0, y_scale: float = 7.0, **kwargs):
        super().__init__(**kwargs)
        self.x_scale, self.y_scale = x_scale, y_scale

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().next_batch()
        return x * self.x_scale, y * self.y_scale


def train_scaled(out: Path, settings: DictionarySettings, **scales) -> DictionaryTrainer:
    trainer = DictionaryTrainer(settings, ScaledToy(**scales), 16, 16, out)
    trainer.run()
    return trainer


def unscaled_inference(trainer: DictionaryTrainer) -> SAE:
    """The dictionary as it would be saved without the scale folded in: it reads the scaled
    activations it was trained on (a BatchTopK with its batch threshold, as saved)."""
    sae = SAE(trainer.sae.cfg)
    with torch.no_grad():
        for name, tensor in inference_tensors(trainer.sae, trainer.settings,
                                              trainer.batch_threshold).items():
            getattr(sae, name).copy_(tensor)
    return sae


# --- normalize_activations --------------------------------------------------------------------

@pytest.mark.parametrize("extra, scales", [
    ({"architecture": "standard", "l1_coefficient": 0.3}, {}),
    ({"architecture": "topk", "k": 4}, {}),
    ({"architecture": "batchtopk", "k": 2.0}, {}),
    ({"architecture": "jumprelu", "l0_coefficient": 0.03}, {}),
    ({"architecture": "standard", "transcoder": True, "hook": "blocks.0.ln2.hook_normalized",
      "l1_coefficient": 0.3}, {"x_scale": 7.0, "y_scale": 0.2}),
])
def test_the_saved_dictionary_reads_raw_activations(tmp_path: Path, extra: dict,
                                                   scales: dict) -> None:
    """Trained on scaled activations, saved to read raw ones: the saved dictionary's output on
    x is the trained one's on x * s_in, divided by s_out, and its cfg says "none"."""
    settings = toy_settings(tokens=256 * 20, normalize_activations=NORMALIZED, **extra)
    trainer = train_scaled(tmp_path / "sae", settings, **scales)
    s_in, s_out = (float(s) for s in trainer.scaling)
    x_scale, y_scale = scales.get("x_scale", 7.0), scales.get("y_scale", 7.0)
    assert s_in != 1 and s_out * y_scale / (s_in * x_scale) == pytest.approx(1.0, rel=1e-6)
    saved = SAE.load(tmp_path / "sae")
    assert saved.cfg.normalize_activations == "none"
    x, _ = ScaledToy(seed=5, **scales).next_batch()
    with torch.no_grad():
        as_trained = unscaled_inference(trainer)(x * s_in) / s_out  # (batch, 16)
        torch.testing.assert_close(saved(x), as_trained, rtol=1e-4, atol=1e-5)
        assert float((saved.encode(x) != 0).sum()) > 0  # the check is not on empty codes


def test_the_scale_makes_the_mean_norm_sqrt_width(tmp_path: Path) -> None:
    settings = toy_settings(tokens=256 * 2, lr_warm_up_steps=0, k=4,
                            normalize_activations=NORMALIZED)
    trainer = train_scaled(tmp_path / "sae", settings, x_scale=7.0, y_scale=7.0)
    x, _ = ScaledToy(seed=9).next_batch()
    scaled_norm = float((x * float(trainer.scaling[0])).norm(dim=-1).mean())
    assert scaled_norm == pytest.approx(math.sqrt(16), rel=0.1)  # a fresh batch, not the 8 read
    plain = train_scaled(tmp_path / "plain", toy_settings(tokens=256 * 2, lr_warm_up_steps=0,
                                                          k=4, normalize_activations="none"))
    assert plain.scaling is None


def resume_halfway(settings: DictionarySettings, out: Path, stop_at: int,
                   source: type = ScaledToy) -> DictionaryTrainer:
    """Train to `stop_at`, stop, and resume in a new trainer (with a fresh source) to the end."""
    half = DictionaryTrainer(settings, source(), 16, 16, out)
    stopped = threading.Event()
    half.report = lambda step, record: stopped.set() if step == stop_at else None
    half.stop = stopped
    assert half.run().step == stop_at
    again = DictionaryTrainer(settings, source(), 16, 16, out)
    again.resume()
    again.run()
    return again


def test_a_resume_keeps_the_scale(tmp_path: Path) -> None:
    settings = toy_settings(tokens=256 * 30, k=4, normalize_activations=NORMALIZED)
    straight = train_scaled(tmp_path / "straight", settings)
    resumed = resume_halfway(settings, tmp_path / "halves", 12)
    assert torch.equal(resumed.scaling, straight.scaling)
    one, other = saved_tensors(tmp_path / "straight"), saved_tensors(tmp_path / "halves")
    assert one.keys() == other.keys() and "norm_scaling" in one
    for name in one:
        assert torch.equal(one[name], other[name]), name


# --- resampling -------------------------------------------------------------------------------

def trained_a_little(tmp_path: Path, architecture: str = "standard",
                     **extra) -> DictionaryTrainer:
    settings = toy_settings(architecture=architecture, tokens=256 * 40, resample_every=10,
                            **extra)
    trainer = DictionaryTrainer(settings, SparseToy(), 16, 16, tmp_path / "sae")
    for _ in range(3):  # Adam moments everywhere
        trainer.train_step()
    return trainer


@pytest.mark.parametrize("architecture, extra", [("standard", {"l1_coefficient": 0.3}),
                                                 ("jumprelu", {"l0_coefficient": 0.03})])
def test_resampling_renews_only_the_dead_latents(tmp_path: Path, architecture: str,
                                                 extra: dict) -> None:
    trainer = trained_a_little(tmp_path, architecture=architecture, **extra)
    dead = torch.zeros(64, dtype=torch.bool)
    dead[[3, 17, 40]] = True
    trainer.tokens_since_fired[:] = 0
    trainer.tokens_since_fired[dead] = 10 * 256  # silent since the last resampling
    sae = trainer.sae
    before = {name: p.detach().clone() for name, p in sae.named_parameters()}
    moments = {name: {key: trainer.optimizer.state[p][key].clone()
                      for key in ("exp_avg", "exp_avg_sq")} for name, p in sae.named_parameters()}
    x, y = SparseToy(seed=3).next_batch()
    with torch.no_grad():
        x_hat = sae(x)
    trainer._resample(x, y, x_hat)
    live = ~dead
    for name, p in sae.named_parameters():  # a latent is W_enc's column, the others' row/entry
        column = name == "W_enc"
        pick = (lambda t, m: t[:, m]) if column else (lambda t, m: t[m])
        if p.shape[-1 if column else 0] != 64:  # b_dec: no latent's
            assert torch.equal(p.detach(), before[name]), name
            continue
        assert torch.equal(pick(p.detach(), live), pick(before[name], live)), name
        for key in ("exp_avg", "exp_avg_sq"):
            state = trainer.optimizer.state[p][key]
            assert torch.equal(pick(state, live), pick(moments[name][key], live)), (name, key)
            assert not pick(state, dead).any(), (name, key)
            assert pick(moments[name][key], dead).any(), (name, key)  # they were not zero
    assert not sae.b_enc[dead].any()
    # each new decoder row points along a target of the batch, at the living rows' mean norm
    rows = torch.nn.functional.normalize(sae.W_dec[dead].detach(), dim=-1)  # (3, 16)
    targets = torch.nn.functional.normalize(y, dim=-1)  # (256, 16)
    assert torch.allclose((rows @ targets.T).max(dim=1).values, torch.ones(3), atol=1e-5)
    torch.testing.assert_close(sae.W_dec[dead].norm(dim=-1),
                               before["W_dec"][live].norm(dim=-1).mean().expand(3))
    assert not torch.equal(sae.W_enc[:, dead], before["W_enc"][:, dead])
    if architecture == "jumprelu":
        assert torch.equal(sae.threshold[dead].detach(), torch.full((3,), 0.01))
    assert not trainer.tokens_since_fired[dead].any()


def test_resampling_skips_when_none_is_dead(tmp_path: Path) -> None:
    trainer = trained_a_little(tmp_path)
    trainer.tokens_since_fired[:] = 0
    before = {name: p.detach().clone() for name, p in trainer.sae.named_parameters()}
    x, y = SparseToy(seed=3).next_batch()
    trainer._resample(x, y, torch.zeros_like(y))
    for name, p in trainer.sae.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_a_resumed_training_resamples_as_the_straight_one(tmp_path: Path, monkeypatch) -> None:
    """The resampling's draws are seeded by the step: a training stopped and resumed before
    a resampling makes the same one."""
    resampled: list[tuple[str, int, int]] = []
    original = trainer_module.resample_dead

    def counting(sae, settings, x, y, x_hat, dead, generator):
        latents = original(sae, settings, x, y, x_hat, dead, generator)
        resampled.append((run_name[0], int(settings.steps), latents.numel()))
        return latents

    monkeypatch.setattr(trainer_module, "resample_dead", counting)
    # a strong L1 leaves latents dead for resampling to renew
    settings = toy_settings(architecture="standard", l1_coefficient=3.0, tokens=256 * 40,
                            resample_every=4, dead_tokens=256 * 4, normalize_activations="none")
    run_name = ["straight"]
    train_scaled(tmp_path / "straight", settings, x_scale=1.0, y_scale=1.0)
    run_name[0] = "halves"
    resume_halfway(settings, tmp_path / "halves", 6, source=SparseToy)
    straight = [n for name, _, n in resampled if name == "straight"]
    halves = [n for name, _, n in resampled if name == "halves"]
    assert straight == halves and len(straight) == 5 and sum(straight[2:]) > 0
    one, other = saved_tensors(tmp_path / "straight"), saved_tensors(tmp_path / "halves")
    for name in one:
        assert torch.equal(one[name], other[name]), name


# --- settings ---------------------------------------------------------------------------------

def test_the_new_settings_are_checked_by_name() -> None:
    with pytest.raises(ConfigError, match="normalize_activations 'layer_norm' is none of"):
        toy_settings(normalize_activations="layer_norm")
    with pytest.raises(ConfigError, match="resample_every"):
        toy_settings(architecture="standard", resample_every=-1)
    with pytest.raises(ConfigError, match="resample_every is a setting of standard and "
                                          "jumprelu, not of topk"):
        toy_settings(architecture="topk", k=4, resample_every=7)
    assert toy_settings(architecture="jumprelu", resample_every=7).resample_every == 7


def test_a_state_saved_before_the_new_settings_resumes_as_trained(tmp_path: Path) -> None:
    """A trainer_state.json without normalize_activations and resample_every was trained with
    neither: its resume takes "none" and 0, whatever today's defaults are."""
    import json

    from glassgpt.interp.sae.training.state import saved_settings
    settings = toy_settings(architecture="standard", l1_coefficient=0.3, tokens=256 * 12,
                            normalize_activations="none", resample_every=0)
    train_scaled(tmp_path / "sae", settings)
    path = tmp_path / "sae" / "trainer_state.json"
    state = json.loads(path.read_text())
    for name in ("normalize_activations", "resample_every"):
        del state["settings"][name]
    path.write_text(json.dumps(state))
    fields = saved_settings(tmp_path / "sae")
    assert (fields["normalize_activations"], fields["resample_every"]) == ("none", 0)
    again = DictionaryTrainer(DictionarySettings(**fields), ScaledToy(), 16, 16, tmp_path / "sae")
    again.resume()
    assert again.step == 12 and again.scaling is None


def test_topk_keeps_auxk_and_never_resamples(tmp_path: Path, monkeypatch) -> None:
    """resample_every's default is not topk's setting: a TopK trains past it unresampled."""
    every = DictionarySettings.__dataclass_fields__["resample_every"].default
    assert every > 0

    def refused(*args) -> None:
        raise AssertionError("a topk dictionary was resampled")

    monkeypatch.setattr(trainer_module, "resample_dead", refused)
    settings = toy_settings(architecture="topk", k=4, tokens=256 * 2 * every,
                            lr_warm_up_steps=0)
    assert train_toy(tmp_path / "sae", settings).step == 2 * every
