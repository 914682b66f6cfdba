"""glassgpt.interp.sae against SAELens: its saved dictionaries load here with its numbers, ours
are written in its format, and dictionaries splice into a glassgpt model's hook points.

The fixtures in tests/data/saelens were written by SAELens 6.54.12 itself (make_fixtures.py
there; SAELens cannot be installed beside transformer-lens 4, so the suite reads its files). The
other direction (glassgpt's files loaded by SAELens's SAE.load_from_disk) is run by
check_in_saelens.py there; its result is in that directory's README.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glassgpt.config import GPTConfig
from glassgpt.errors import CheckpointError, ConfigError, InputError
from glassgpt.interp import run_with_cache, run_with_hooks
from glassgpt.interp.sae import SAE, SAEConfig, run_with_cache_and_saes, run_with_saes
from glassgpt.model import GPT
from glassgpt.storage import files

FIXTURES = Path(__file__).parent / "data" / "saelens"
ARCHITECTURES = ["standard", "standard_no_b_dec_input", "topk", "topk_rescaled", "jumprelu",
                 "batchtopk", "transcoder", "jumprelu_transcoder"]
RESID, MLP_IN, MLP_OUT = "blocks.1.hook_resid_post", "blocks.0.ln2.hook_normalized", \
    "blocks.0.hook_mlp_out"


def expected(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "expected.safetensors")


def saved_cfg(directory: Path) -> dict:
    return json.loads((directory / "cfg.json").read_text())


def tensor_names(path: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in load_file(path).items()}


# --- SAELens's files, read here -------------------------------------------------------------

@pytest.mark.parametrize("name", ARCHITECTURES)
def test_saelens_fixture_encodes_and_decodes_as_saelens(name: str) -> None:
    sae = SAE.load(FIXTURES / name)
    want = expected(name)
    seen = {}

    def keep(point: str, tensor: torch.Tensor) -> torch.Tensor:
        seen[point] = tensor
        return tensor

    with torch.no_grad():
        encoded = sae.encode_visiting(want["x"], keep)
        decoded = sae.decode(want["encode"])
    assert encoded.dtype == torch.float32
    torch.testing.assert_close(seen["hook_sae_acts_pre"], want["acts_pre"], rtol=0, atol=1e-6)
    torch.testing.assert_close(encoded, want["encode"], rtol=0, atol=1e-6)
    torch.testing.assert_close(decoded, want["decode"], rtol=0, atol=1e-6)
    torch.testing.assert_close(sae(want["x"]), want["decode"], rtol=0, atol=1e-6)
    assert (encoded > 0).any() and (encoded == 0).any()  # neither dead nor dense: a real test


def test_saelens_fields_are_read_as_saelens_wrote_them() -> None:
    topk = SAE.load(FIXTURES / "topk_rescaled")
    assert (topk.cfg.k, topk.cfg.rescale_acts_by_decoder_norm) == (8, True)
    assert (SAE.load(FIXTURES / "topk").encode(expected("topk")["x"]) > 0).sum(-1).eq(8).all()
    assert SAE.load(FIXTURES / "standard_no_b_dec_input").cfg.apply_b_dec_to_input is False
    transcoder = SAE.load(FIXTURES / "transcoder")
    assert (transcoder.cfg.d_in, transcoder.cfg.d_out, transcoder.W_dec.shape) == (16, 24,
                                                                                  (64, 24))
    assert (transcoder.cfg.hook_name, transcoder.cfg.hook_name_out) == (MLP_IN, MLP_OUT)
    assert transcoder.threshold is None
    assert SAE.load(FIXTURES / "jumprelu_transcoder").threshold.shape == (64,)
    assert SAE.load(FIXTURES / "jumprelu").cfg.metadata.model_name == "glassgpt-fixture"


def test_a_batchtopk_dictionary_runs_as_saelens_saves_it_a_jumprelu_of_one_threshold() -> None:
    sae = SAE.load(FIXTURES / "batchtopk")
    assert sae.cfg.architecture == "jumprelu"
    assert sae.cfg.metadata.training_architecture == "batchtopk"
    assert torch.equal(sae.threshold, torch.full((64,), sae.threshold[0].item()))
    built = SAEConfig.batchtopk(16, 64, k=4, hook_name=RESID)
    assert (built.architecture, built.metadata.training_architecture) == ("jumprelu",
                                                                          "batchtopk")


def test_sparsity_file_is_read_and_written_back() -> None:
    sae = SAE.load(FIXTURES / "standard")
    assert torch.equal(sae.log_sparsity, load_file(FIXTURES / "standard" /
                                                   "sparsity.safetensors")["sparsity"])
    assert SAE.load(FIXTURES / "topk").log_sparsity is None


# --- glassgpt's files, in SAELens's format -----------------------------------------------------

@pytest.mark.parametrize("name", ARCHITECTURES)
def test_save_then_load_is_bit_exact_and_writes_saelens_cfg_key_for_key(name: str,
                                                                       tmp_path: Path) -> None:
    sae = SAE.load(FIXTURES / name)
    sae.save(tmp_path / "copy")
    again = SAE.load(tmp_path / "copy")
    assert sae.state_dict().keys() == again.state_dict().keys()
    for key, tensor in sae.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[key]), key
    assert saved_cfg(tmp_path / "copy") == saved_cfg(FIXTURES / name)  # values too, in order
    assert list(saved_cfg(tmp_path / "copy")) == list(saved_cfg(FIXTURES / name)) \
        or name == "batchtopk"  # SAELens's training config writes that one in another order
    for file in ("sae_weights.safetensors", "sparsity.safetensors"):
        if (FIXTURES / name / file).exists():
            assert tensor_names(tmp_path / "copy" / file) == tensor_names(FIXTURES / name / file)
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == \
        sorted(p.name for p in (FIXTURES / name).iterdir() if p.name != "expected.safetensors")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_dictionary_built_here_writes_saelens_fields_and_tensor_names(name: str,
                                                                       tmp_path: Path) -> None:
    theirs = saved_cfg(FIXTURES / name)
    fields = {key: theirs[key] for key in ("k", "rescale_acts_by_decoder_norm", "d_out",
                                           "apply_b_dec_to_input") if key in theirs}
    if name == "batchtopk":
        config = SAEConfig.batchtopk(16, 64, k=4, hook_name=RESID)
    else:
        config = SAEConfig(16, 64, theirs["architecture"], **fields,
                           metadata={"hook_name": theirs["metadata"]["hook_name"]})
    SAE(config).save(tmp_path / "ours")
    ours = saved_cfg(tmp_path / "ours")
    assert set(ours) == set(theirs)
    assert {k: v for k, v in ours.items() if k != "metadata"} == \
        {k: v for k, v in theirs.items() if k != "metadata"}
    assert ours["metadata"]["sae_lens_version"].split(".")[0] == "6"  # SAELens reads it as 6.x
    assert tensor_names(tmp_path / "ours" / "sae_weights.safetensors") == \
        tensor_names(FIXTURES / name / "sae_weights.safetensors")


def test_dtype_follows_the_weights_into_cfg_json(tmp_path: Path) -> None:
    sae = SAE.load(FIXTURES / "jumprelu").double()
    assert sae.cfg.dtype == "float64"
    sae.save(tmp_path / "wide")
    assert saved_cfg(tmp_path / "wide")["dtype"] == "float64"
    again = SAE.load(tmp_path / "wide")
    assert again.W_enc.dtype == torch.float64 and torch.equal(again.W_enc, sae.W_enc)
    assert SAE.load(tmp_path / "wide", dtype="float32").W_dec.dtype == torch.float32


def test_save_is_atomic_and_replaces_only_a_dictionary(tmp_path: Path, monkeypatch) -> None:
    sae = SAE.load(FIXTURES / "standard")
    sae.save(tmp_path / "sae")
    with pytest.raises(CheckpointError, match="not empty"):
        sae.save(tmp_path / "sae")
    sae.save(tmp_path / "sae", overwrite=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.safetensors").write_bytes(b"mine")
    with pytest.raises(CheckpointError, match="more than a dictionary"):
        sae.save(tmp_path / "run", overwrite=True)
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == b"mine"

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_bytes_atomic", full_disk)
    with pytest.raises(CheckpointError, match="nothing was left"):
        sae.save(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "sae"]


# --- a corrupt or lying directory is refused, by name ------------------------------------------

def broken_copy(tmp_path: Path, name: str = "topk", **cfg_changes) -> Path:
    directory = tmp_path / "broken"
    shutil.copytree(FIXTURES / name, directory)
    cfg = saved_cfg(directory)
    for key, value in cfg_changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    (directory / "cfg.json").write_text(json.dumps(cfg))
    return directory


@pytest.mark.parametrize(("changes", "message"), [
    ({"d_sae": None}, "lacks d_sae"),
    ({"k": None}, "lacks k"),
    ({"architecture": "gated"}, "unknown architecture 'gated'"),
    ({"architecture": "batchtopk"}, "saves a trained BatchTopK SAE as 'jumprelu'"),
    ({"d_sae": 65}, "tensor W_enc has shape \\(16, 64\\), but cfg.json says \\(16, 65\\)"),
    ({"d_in": 16.0}, "d_in must be a positive integer"),
    ({"k": 65}, "k = 65 latents of d_sae = 64"),
    ({"dtype": "int8"}, "dtype 'int8'"),
    ({"normalize_activations": "layer_norm"}, "normalize_activations 'layer_norm' is not"),
    ({"metadata": None}, "no metadata object"),
    ({"metadata": {"sae_lens_version": "5.9.0"}}, "sae_lens_version '5.9.0'"),
    ({"metadata": {"sae_lens_version": "6.0.0", "hook_name": 3}}, "metadata.hook_name must"),
])
def test_a_lying_cfg_json_is_one_clear_error(tmp_path: Path, changes: dict,
                                              message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        SAE.load(broken_copy(tmp_path, **changes))


def test_a_transcoder_that_subtracts_b_dec_from_its_input_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="apply_b_dec_to_input must be false"):
        SAE.load(broken_copy(tmp_path, "transcoder", apply_b_dec_to_input=True))


def test_bad_weights_are_refused_before_anything_is_built(tmp_path: Path) -> None:
    directory = broken_copy(tmp_path)
    weights = load_file(directory / "sae_weights.safetensors")
    weights["b_enc"][3] = float("nan")
    save_file(weights, directory / "sae_weights.safetensors")
    with pytest.raises(CheckpointError, match="b_enc holds 1 NaN or infinite"):
        SAE.load(directory)
    weights["b_enc"][3] = 0.0
    save_file({**weights, "b_enc": torch.zeros(64, dtype=torch.int64)},
              directory / "sae_weights.safetensors")
    with pytest.raises(CheckpointError, match="b_enc has dtype I64; weights are floating"):
        SAE.load(directory)
    save_file({**weights, "threshold": torch.zeros(64)}, directory / "sae_weights.safetensors")
    with pytest.raises(CheckpointError, match="needs exactly"):
        SAE.load(directory)
    (directory / "sae_weights.safetensors").write_bytes(b"\x80\x04 a pickle, never loaded")
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        SAE.load(directory)
    (directory / "cfg.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SAE.load(directory)
    with pytest.raises(CheckpointError, match="is not a directory"):
        SAE.load(tmp_path / "absent")


def test_a_config_built_in_code_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="k = 9 latents of d_sae = 8"):
        SAEConfig(4, 8, "topk", k=9)
    with pytest.raises(ConfigError, match="fields of 'topk'"):
        SAEConfig(4, 8, "standard", k=2)
    with pytest.raises(ConfigError, match="apply_b_dec_to_input must be false"):
        SAEConfig(4, 8, "transcoder", d_out=5)
    with pytest.raises(ConfigError, match="device 'gpu' is not a torch device"):
        SAEConfig(4, 8, device="gpu")
    config = SAEConfig(4, 8)
    SAE(config).double()
    assert config.dtype == "float32"  # an SAE moves its own copy of the config


# --- splicing into a glassgpt model -----------------------------------------------------------

def tiny_model() -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=29, block_size=16, n_layer=2, n_head=4, n_embd=32,
                       dropout=0.0, bias=True)
    model = GPT(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def random_sae(config: SAEConfig, seed: int = 3) -> SAE:
    sae = SAE(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        if sae.threshold is not None:
            sae.threshold.abs_()
    return sae


def ids() -> torch.Tensor:
    return torch.randint(0, 29, (2, 7), generator=torch.Generator().manual_seed(4))


def resid_sae(architecture: str = "standard", **fields) -> SAE:
    return random_sae(SAEConfig(32, 64, architecture, metadata={"hook_name": RESID}, **fields))


def transcoder() -> SAE:
    return random_sae(SAEConfig(32, 48, "jumprelu_transcoder", d_out=32,
                                apply_b_dec_to_input=False,
                                metadata={"hook_name": MLP_IN, "hook_name_out": MLP_OUT}))


@pytest.mark.parametrize("make", [resid_sae, lambda: resid_sae("topk", k=5), transcoder],
                         ids=["standard", "topk", "transcoder"])
def test_the_error_term_leaves_the_logits_unchanged_and_without_it_they_change(make) -> None:
    model, sae = tiny_model(), make()
    clean, _ = model(ids())
    with_error = run_with_saes(model, ids(), [sae], use_error_term=True)
    torch.testing.assert_close(with_error, clean, rtol=0, atol=1e-5)
    spliced = run_with_saes(model, ids(), sae)
    assert (spliced - clean).abs().max() > 1e-2


def test_the_splice_is_the_reconstruction_in_place_of_the_activation() -> None:
    model, sae = tiny_model(), resid_sae("jumprelu")
    by_hand = run_with_hooks(model, ids(), [(RESID, lambda x, name: sae.decode(sae.encode(x)))])
    assert torch.equal(run_with_saes(model, ids(), [sae]), by_hand)


def test_a_transcoder_reads_one_point_and_writes_another() -> None:
    model, sae = tiny_model(), transcoder()
    held = {}
    by_hand = run_with_hooks(model, ids(), [
        (MLP_IN, lambda x, name: held.update(x=x)),
        (MLP_OUT, lambda y, name: sae.decode(sae.encode(held["x"])))])
    assert torch.equal(run_with_saes(model, ids(), [sae]), by_hand)


def test_the_cache_holds_saelens_names_after_the_model_point() -> None:
    model, sae = tiny_model(), resid_sae("topk", k=5)
    _, plain = run_with_cache(model, ids())
    logits, cache = run_with_cache_and_saes(model, ids(), [sae], use_error_term=True)
    names = list(cache)
    suffixes = ["hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons",
                "hook_sae_error", "hook_sae_output"]
    at = names.index(RESID)
    assert names[at + 1:at + 7] == [f"{RESID}.{suffix}" for suffix in suffixes]
    x = cache[RESID]
    assert torch.equal(x, plain[RESID])  # the model's own point: what the model computed
    assert torch.equal(cache[f"{RESID}.hook_sae_input"], x)
    assert torch.equal(cache[f"{RESID}.hook_sae_acts_post"], sae.encode(x))
    assert torch.equal(cache[f"{RESID}.hook_sae_recons"], sae(x))
    assert torch.equal(cache[f"{RESID}.hook_sae_error"], x - sae(x))
    assert torch.equal(cache[f"{RESID}.hook_sae_output"], sae(x) + (x - sae(x)))
    _, without = run_with_cache_and_saes(model, ids(), sae, names=lambda n: "hook_sae" in n)
    assert list(without) == [f"{RESID}.{s}" for s in suffixes if s != "hook_sae_error"]
    assert not torch.equal(without[f"{RESID}.hook_sae_output"], x)


def test_a_transcoders_names_sit_under_its_output_point() -> None:
    model, sae = tiny_model(), transcoder()
    _, cache = run_with_cache_and_saes(model, ids(), [sae])
    assert torch.equal(cache[f"{MLP_OUT}.hook_sae_input"], cache[MLP_IN])
    assert torch.equal(cache[f"{MLP_OUT}.hook_sae_output"], sae(cache[MLP_IN]))


def test_an_edited_latent_shows_through_the_error_term() -> None:
    model, sae = tiny_model(), resid_sae()

    def raise_latent_7(f: torch.Tensor, name: str) -> torch.Tensor:
        f = f.clone()
        f[..., 7] += 2.0
        return f

    _, cache = run_with_cache_and_saes(model, ids(), [sae], use_error_term=True)
    hooks = [(f"{RESID}.hook_sae_acts_post", raise_latent_7),
             (f"{RESID}.hook_sae_output", lambda out, name: held.update(out=out))]
    held = {}
    run_with_saes(model, ids(), [sae], use_error_term=True, hooks=hooks)
    torch.testing.assert_close(held["out"], cache[RESID] + 2.0 * sae.W_dec[7], rtol=0,
                               atol=1e-5)


def test_a_dictionary_over_hook_z_reads_the_heads_side_by_side() -> None:
    model = tiny_model()
    sae = random_sae(SAEConfig(32, 64, reshape_activations="hook_z",
                               metadata={"hook_name": "blocks.0.attn.hook_z"}))
    clean, _ = model(ids())
    torch.testing.assert_close(run_with_saes(model, ids(), [sae], use_error_term=True), clean,
                               rtol=0, atol=1e-5)
    assert (run_with_saes(model, ids(), [sae]) - clean).abs().max() > 1e-2


@pytest.mark.parametrize(("make", "message"), [
    (lambda: random_sae(SAEConfig(16, 64, metadata={"hook_name": RESID})),
     f"dictionary for {RESID} takes width 16, but {RESID} is 32 wide"),
    (lambda: random_sae(SAEConfig(32, 64, metadata={"hook_name": "blocks.7.hook_resid_post"})),
     "no hook point 'blocks.7.hook_resid_post' in the model"),
    (lambda: random_sae(SAEConfig(32, 64)), "has no metadata.hook_name"),
    (lambda: random_sae(SAEConfig(32, 48, "transcoder", d_out=32, apply_b_dec_to_input=False,
                                  metadata={"hook_name": MLP_OUT, "hook_name_out": MLP_IN})),
     f"reads {MLP_OUT}, which the model computes after {MLP_IN}"),
    (lambda: random_sae(SAEConfig(32, 48, "transcoder", d_out=40, apply_b_dec_to_input=False,
                                  metadata={"hook_name": MLP_IN, "hook_name_out": MLP_OUT})),
     f"for {MLP_OUT} takes width 40"),
    (lambda: [resid_sae(), resid_sae()], f"two dictionaries write to {RESID}"),
    (lambda: random_sae(SAEConfig(32, 64, reshape_activations="hook_z",
                                  metadata={"hook_name": RESID})), f"{RESID} has no head axis"),
    (lambda: [object()], "saes must hold glassgpt.interp.sae.SAE"),
])
def test_a_dictionary_that_does_not_fit_is_refused_by_name_before_the_run(make,
                                                                          message) -> None:
    model = tiny_model()
    ran = []
    model.blocks[0].register_forward_hook(lambda *args: ran.append(1))
    with pytest.raises(InputError, match=message):
        run_with_saes(model, ids(), make())
    assert len(ran) <= 1  # at most the one-token probe of the widths


def test_an_absent_sae_point_is_refused_by_name() -> None:
    model, sae = tiny_model(), resid_sae()
    with pytest.raises(InputError, match="exists only with use_error_term=True"):
        run_with_saes(model, ids(), [sae], hooks=[(f"{RESID}.hook_sae_error", print)])
    with pytest.raises(InputError, match="hook_sae_acts_post"):
        run_with_saes(model, ids(), [sae], hooks=[(f"{RESID}.hook_sae_acts_pst", print)])
