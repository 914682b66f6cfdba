"""Dictionary architectures as records (issue 52): what differs between architectures is read
from one record each (glassgpt.interp.sae.architectures), and the pre-activation is written
once (glassgpt.interp.sae.encoding.pre_acts) for the model, the trainer, the graphs and the
feature writers. The numbers themselves are held to SAELens's by tests/test_sae.py (a fixture
per architecture) and tests/test_sae_reference.py (the trainer)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from glassgpt.interp.sae import SAE, SAEConfig
from glassgpt.interp.sae.architectures import LOADABLE, REGISTRY, TRAINABLE
from glassgpt.interp.sae.encoding import ACTIVATIONS, pre_acts
from glassgpt.interp.sae.training import DictionarySettings
from glassgpt.interp.sae.training.objective import FORWARDS, inference_tensors, training_step
from glassgpt.interp.sae.training.trainer import build_sae

BASE_TENSORS = {"W_enc", "b_enc", "W_dec", "b_dec"}


def test_the_records_are_saelens_architectures_with_their_torch_behaviour() -> None:
    assert LOADABLE == ("standard", "topk", "jumprelu", "transcoder", "jumprelu_transcoder")
    assert TRAINABLE == ("standard", "topk", "batchtopk", "jumprelu")
    for arch in REGISTRY.values():
        assert arch.loadable == (arch.activation in ACTIVATIONS), arch.name
        assert not arch.trained or arch.activation in FORWARDS, arch.name
        assert ("k" in arch.settings) == (arch.k is not None), arch.name
        if arch.saved_as is not None:  # batchtopk runs, once trained, as a jumprelu
            assert REGISTRY[arch.saved_as].loadable and arch.batch_threshold
            assert "threshold" in REGISTRY[arch.saved_as].tensors
        if arch.transcoder_form is not None:  # its transcoder computes what it computes
            form = REGISTRY[arch.transcoder_form]
            assert form.transcoder and (form.activation, form.tensors) == (arch.activation,
                                                                           arch.tensors)


def test_each_setting_an_architecture_reads_is_claimed_by_its_record() -> None:
    """A setting whose help names architectures ("topk/batchtopk: ...") is in their records'
    `settings`, and a record claims only DictionarySettings's fields."""
    fields = {field.name: field.metadata["help"] for field in dataclasses.fields(
        DictionarySettings)}
    for name, text in fields.items():
        for owners in re.findall(r"(?:^|; )([a-z/]+): ", text):
            for owner in owners.split("/"):
                assert name in REGISTRY[owner].settings, (name, owner)
    claimed = {name for arch in REGISTRY.values() for name in arch.settings}
    assert claimed <= set(fields) and {"k", "l1_coefficient", "l0_coefficient"} <= claimed


@pytest.mark.parametrize("name", TRAINABLE)
def test_a_training_step_computes_the_terms_and_saves_the_tensors_its_record_names(
        name: str) -> None:
    arch = REGISTRY[name]
    settings = DictionarySettings(hook="blocks.0.hook_resid_post", d_sae=16, architecture=name,
                                  k={"count": 2, "mean": 1.5}.get(arch.k), tokens=32,
                                  batch_tokens=32)
    torch.manual_seed(0)
    sae = build_sae(settings, 8, 8, {})
    assert sae.cfg.architecture == (arch.saved_as or name)
    x = torch.randn(32, 8)
    dead = torch.ones(16, dtype=torch.bool)  # every latent dead: AuxK has its say
    threshold = torch.zeros((), dtype=torch.float64)
    out = training_step(sae, settings, x, x, 1.0, dead, threshold)
    assert list(out.terms) == ["mse_loss", *arch.losses]
    assert all(bool(term > 0) for term in out.terms.values())
    assert float(threshold) > 0 if arch.batch_threshold else float(threshold) == 0
    saved = inference_tensors(sae, settings, threshold)
    assert set(saved) == BASE_TENSORS | set(REGISTRY[sae.cfg.architecture].tensors)
    folded = saved["W_dec"].norm(dim=-1)
    assert torch.allclose(folded, torch.ones(16)) == arch.rescales_by_decoder_norm


@pytest.mark.parametrize("centred", [True, False], ids=["centred", "uncentred"])
def test_one_pre_activation_for_the_model_the_graph_and_the_writers(centred: bool) -> None:
    torch.manual_seed(1)
    sae = SAE(SAEConfig(8, 16, apply_b_dec_to_input=centred))
    with torch.no_grad():
        sae.b_enc.normal_()
        sae.b_dec.normal_()
    x = torch.randn(5, 8)
    pre = pre_acts(sae, x)  # (5, 16)
    seen = {}
    sae.encode_visiting(x, lambda point, t: seen.setdefault(point, t))
    assert torch.equal(seen["hook_sae_acts_pre"], pre)  # the splice's and the model's
    features = torch.tensor([0, 3, 3, 15, 7])  # the graph's: row n's feature features[n]
    torch.testing.assert_close(pre_acts(sae, x, features), pre[torch.arange(5), features],
                               rtol=0, atol=1e-5)
    # the feature writers': affine in x, its value at a zero input the constant, in float64
    column, zero = sae.W_enc[:, 3].double(), torch.zeros(1, 8, dtype=torch.float64)
    constant = pre_acts(sae, zero, torch.tensor([3]))
    assert constant.dtype == torch.float64
    expected = sae.b_enc[3].double() - (sae.b_dec.double() @ column if centred else 0)
    torch.testing.assert_close(constant[0], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(x[:1].double() @ column + constant, pre[:1, 3].double(),
                               rtol=0, atol=1e-5)
