"""glassgpt's dictionary trainer against SAELens's, and the training paths the other files do
not reach: a text file as the data, a transcoder spliced in place of its MLP, and CE loss
recovered on a model whose hook point matters.

The SAELens side of the first test is a fixture (tests/data/saelens/training_reference.json),
written by tests/data/saelens/train_reference.py with SAELens's own `SAETrainer` on the same
activations (see the README there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from glassgpt.config import GPTConfig
from glassgpt.interp import run_with_cache
from glassgpt.interp.sae.training import DictionarySettings, DictionaryTrainer
from glassgpt.interp.sae.training.activations import TensorActivations
from glassgpt.model import GPT
from test_sae_train import settings_before_issue_53

REFERENCE = Path(__file__).parent / "data" / "saelens" / "training_reference.json"
EV_MARGIN, L0_MARGIN = 0.01, 0.10  # issue 41: explained variance within 0.01, L0 within 10%


# --- the same activations, the same settings, SAELens's trainer and glassgpt's -----------------

def reference_activations(recipe: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(train (N, d), held-out (M, d)): `recipe["hook"]` of a seeded random glassgpt model on
    seeded random windows, flattened over positions. train_reference.py saves these for
    SAELens."""
    torch.manual_seed(recipe["model_seed"])
    config = GPTConfig(**{k: recipe[k] for k in ("vocab_size", "block_size", "n_layer",
                                                 "n_head", "n_embd")})
    model = GPT(config).eval()
    windows = recipe["train_windows"] + recipe["held_out_windows"]
    ids = torch.randint(0, config.vocab_size, (windows, config.block_size),
                        generator=torch.Generator().manual_seed(recipe["ids_seed"]))
    with torch.no_grad():
        _, cache = run_with_cache(model, ids, [recipe["hook"]])
    acts = cache[recipe["hook"]].flatten(0, 1)  # (windows * T, d)
    split = recipe["train_windows"] * config.block_size
    return acts[:split], acts[split:]


def glassgpt_settings(reference: dict[str, Any], architecture: str,
                      seed: int) -> DictionarySettings:
    """SAELens's settings of the fixture in glassgpt's names (its dead window counts steps,
    glassgpt's counts tokens)."""
    common, extra = reference["common"], reference["architectures"][architecture]
    return DictionarySettings(
        hook=reference["recipe"]["hook"], d_sae=common["d_sae"], architecture=architecture,
        tokens=reference["train"]["shape"][0], batch_tokens=common["batch_tokens"],
        lr=common["lr"], lr_warm_up_steps=common["lr_warm_up_steps"],
        lr_decay_steps=common["lr_decay_steps"], decoder_init_norm=common["decoder_init_norm"],
        dead_tokens=common["dead_steps"] * common["batch_tokens"], eval_every=0,
        checkpoint_every=0, seed=seed, **settings_before_issue_53(architecture), **extra)


def train_on_reference(reference: dict[str, Any], train: torch.Tensor, held_out: torch.Tensor,
                       architecture: str, seed: int, out: Path) -> dict[str, float]:
    """glassgpt's held-out L0 and explained variance, with the fixture's formulas."""
    settings = glassgpt_settings(reference, architecture, seed)
    source = TensorActivations(train, settings.batch_tokens)
    trainer = DictionaryTrainer(settings, source, train.shape[1], train.shape[1], out)
    trainer.run()
    sae = trainer.inference_sae()  # what is saved: SAELens's inference tensors
    with torch.no_grad():
        f = sae.encode(held_out)
        x_hat = sae.decode(f).double()
    x = held_out.double()
    mse = (x_hat - x).pow(2).sum(-1).mean()
    variance = (x - x.mean(0)).pow(2).sum(-1).mean()
    return {"l0": float((f != 0).double().sum(-1).mean()),
            "explained_variance": float(1 - mse / variance)}


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    saved = json.loads(REFERENCE.read_text())
    train, held_out = reference_activations(saved["recipe"])
    for name, acts in (("train", train), ("held_out", held_out)):  # the same activations
        assert list(acts.shape) == saved[name]["shape"]
        assert float(acts.double().sum()) == pytest.approx(saved[name]["sum"], rel=1e-5)
        assert float(acts.double().pow(2).sum()) == pytest.approx(
            saved[name]["sum_of_squares"], rel=1e-6)
    return saved, train, held_out


@pytest.mark.parametrize("architecture", ["standard", "topk"])
def test_training_reaches_saelens_trainer_on_the_same_activations(reference, tmp_path: Path,
                                                                  architecture: str) -> None:
    """The issue's margins against the mean of SAELens's three seeds; and, as both trainers
    draw the same initial weights from one seed and take the same steps, within 1e-3 (L0 1%)
    of SAELens's run of the same seed (measured: 2e-5 and 0.005 for standard, 6e-10 and 0
    for topk)."""
    saved, train, held_out = reference
    ours = train_on_reference(saved, train, held_out, architecture, 0, tmp_path / "sae")
    for theirs, ev_margin, l0_margin in (
            (saved["results"][architecture]["mean"], EV_MARGIN, L0_MARGIN),
            (saved["results"][architecture]["per_seed"][0], 1e-3, 0.01)):
        assert ours["explained_variance"] == pytest.approx(theirs["explained_variance"],
                                                           abs=ev_margin)
        assert ours["l0"] == pytest.approx(theirs["l0"], rel=l0_margin)


# --- a text file as the data ------------------------------------------------------------------

def test_a_text_file_is_tokenised_with_the_runs_tokenizer_and_streamed(
        trained_run, tmp_path: Path, monkeypatch, capsys) -> None:
    from glassgpt.cli import main
    from glassgpt.data import PreparedData
    from glassgpt.interp.sae import SAE
    from glassgpt.interp.sae.training import run as training_run
    from glassgpt.rundir.checkpoint import read_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = tmp_path / "other.txt"  # the run's characters, another text than its data's
    text.write_text(trained_run.text.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    args = ["sae", "train", str(trained_run.run), "--data", str(text), "--hook",
            "blocks.0.hook_resid_post", "--out", str(tmp_path / "sae"), "--d-sae", "32",
            "--architecture", "topk", "--k", "4", "--tokens", "1280", "--batch-tokens", "128"]
    assert main(args) == 0
    assert "for 10 steps" in capsys.readouterr().out and SAE.load(tmp_path / "sae").cfg.k == 4
    (prepared_dir,) = (tmp_path / "cache" / "glassgpt" / "data").iterdir()
    prepared = PreparedData(prepared_dir)
    ids = [int(i) for split in ("train", "val") for i in prepared.splits[split]]
    assert ids == read_tokenizer(trained_run.run).encode(text.read_text(encoding="utf-8"))

    def no_second_preparation(*args, **kwargs):
        raise AssertionError("the text was prepared again")

    monkeypatch.setattr(training_run, "prepare", no_second_preparation)
    assert main([*args, "--force"]) == 0  # the same text: the cached ids are read


def test_a_text_file_without_a_run_is_refused_by_name(tmp_path: Path) -> None:
    from glassgpt.errors import ConfigError
    from glassgpt.interp.sae.training import train_dictionary
    text = tmp_path / "t.txt"
    text.write_text("abc")
    settings = DictionarySettings(hook="blocks.0.hook_resid_post", d_sae=8, tokens=64,
                                  batch_tokens=64)
    with pytest.raises(ConfigError, match="t.txt is a text file"):
        train_dictionary(GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=1,
                                       n_embd=8)), settings, tmp_path / "sae", data=text)
    assert not (tmp_path / "sae").exists()


# --- a model whose points matter: a 2-layer character model trained a few hundred steps -------

CHAR_MODEL = dict(block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def char_model(tmp_path_factory) -> tuple[GPT, Path]:
    """(model, its prepared data): Tiny Shakespeare's first 200 KB at character level, 200
    AdamW steps, enough that zeroing a layer's output costs the model its loss."""
    from glassgpt.data import BatchSampler, PreparedData, packaged_tinyshakespeare, prepare
    root = tmp_path_factory.mktemp("char_model")
    (root / "text.txt").write_bytes(packaged_tinyshakespeare()[:200_000])
    prepare(root / "data", root / "text.txt")
    data = PreparedData(root / "data")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, **CHAR_MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = BatchSampler(data.splits["train"], CHAR_MODEL["block_size"], 16, 0, "cpu")
    for _ in range(200):
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval(), root / "data"


def held_out_windows(data_dir: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from glassgpt.data import PreparedData, sequential_batches
    return list(sequential_batches(PreparedData(data_dir).splits["val"],
                                   CHAR_MODEL["block_size"], 8, 2, "cpu"))


def char_settings(**fields: Any) -> DictionarySettings:
    architecture = fields.setdefault("architecture", "standard")  # the default until issue 53
    return DictionarySettings(**{"d_sae": 128, "tokens": 256 * 120, "batch_tokens": 256,
                                 "context": CHAR_MODEL["block_size"], "lr": 3e-3,
                                 "eval_every": 0, "eval_windows": 16, "checkpoint_every": 0,
                                 **settings_before_issue_53(architecture), **fields})


def test_ce_loss_recovered_is_between_0_and_1_and_its_formula(char_model, tmp_path) -> None:
    import torch.nn.functional as F

    from glassgpt.interp import run_with_hooks
    from glassgpt.interp.sae import SAE
    from glassgpt.interp.sae.metrics import evaluate_dictionary
    from glassgpt.interp.sae.training import train_dictionary
    model, data_dir = char_model
    hook = "blocks.0.hook_resid_post"
    train_dictionary(model, char_settings(hook=hook, architecture="topk", k=8),
                     tmp_path / "sae", data=data_dir)
    sae = SAE.load(tmp_path / "sae")
    batches = held_out_windows(data_dir)
    metrics = evaluate_dictionary(model, sae, batches)

    def cross_entropy(replace=None) -> float:  # over every held-out token, by hand
        hooks = [] if replace is None else [(hook, lambda a, name: replace(a))]
        losses = [F.cross_entropy(run_with_hooks(model, x, hooks).flatten(0, 1).double(),
                                  y.flatten(), reduction="sum") for x, y in batches]
        return float(sum(losses)) / sum(y.numel() for _, y in batches)

    with torch.no_grad():
        clean, spliced, zero = cross_entropy(), cross_entropy(sae), cross_entropy(
            torch.zeros_like)
    assert clean < spliced < zero  # the point matters, and the dictionary keeps most of it
    recovered = (zero - spliced) / (zero - clean)
    assert 0.5 < metrics.ce_loss_recovered < 1
    assert metrics.ce_loss_recovered == pytest.approx(recovered, abs=1e-6)
    assert (metrics.ce_loss_clean, metrics.ce_loss_spliced, metrics.ce_loss_zero_ablated) == \
        pytest.approx((clean, spliced, zero), rel=1e-6)


def test_a_trained_transcoder_stands_in_for_its_mlp(char_model, tmp_path: Path) -> None:
    from glassgpt.interp import run_with_hooks
    from glassgpt.interp.sae import SAE, run_with_saes
    from glassgpt.interp.sae.metrics import evaluate_dictionary
    from glassgpt.interp.sae.training import train_dictionary
    model, data_dir = char_model
    settings = char_settings(hook="blocks.1.ln2.hook_normalized", transcoder=True,
                             l1_coefficient=1e-3)
    assert settings.target_hook == "blocks.1.hook_mlp_out"
    result = train_dictionary(model, settings, tmp_path / "tc", data=data_dir)
    transcoder = SAE.load(tmp_path / "tc")
    assert transcoder.cfg.architecture == "transcoder"
    untrained = SAE(transcoder.cfg)
    batches = held_out_windows(data_dir)
    before = evaluate_dictionary(model, untrained, batches)
    assert result.metrics.explained_variance > 0.8 > before.explained_variance  # it learnt
    x, _ = batches[0]
    with torch.no_grad():
        read = {}
        by_hand = run_with_hooks(model, x, [
            ("blocks.1.ln2.hook_normalized", lambda a, name: read.setdefault("in", a)),
            ("blocks.1.hook_mlp_out", lambda a, name: transcoder(read["in"]))])
        spliced = run_with_saes(model, x, transcoder)
        clean = model(x)[0]
        no_mlp = run_with_hooks(model, x, [("blocks.1.hook_mlp_out",
                                            lambda a, name: torch.zeros_like(a))])
    assert torch.equal(spliced, by_hand)  # the MLP's output replaced by the transcoder's
    moved, ablated = (spliced - clean).abs().mean(), (no_mlp - clean).abs().mean()
    assert 0 < moved < 0.1 * ablated  # close to the MLP's own output, and not it
