"""LoRA on the glass model against peft itself: a tiny Llama-family glass model and its Hugging
Face twin (glassgpt's own export) carry the same adapters; the logits and the adapters'
gradients agree in float32, merging and unmerging round-trip, an adapter saved by glassgpt loads
with PeftModel.from_pretrained and one saved by peft loads into glassgpt. GPT-2's fused c_attn
goes out as one block-diagonal adapter that peft computes exactly; one peft trained there (mixing
q, k and v) is refused by name. A run holding an adapter samples and exports merged, or exports
base + adapter with `convert --adapter`."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from glassgpt import GPT, ConfigError, GPTConfig
from glassgpt.adapters.lora import (
    LoraLinear,
    add_lora,
    lora_parameters,
    lora_state_dict,
    merge_lora,
    run_adapter_files,
    unmerge_lora,
)
from glassgpt.adapters.settings import LoraSettings
from glassgpt.cli import main
from glassgpt.errors import CheckpointError
from glassgpt.formats.interop import save_hf, to_hf
from glassgpt.formats.peft import (
    ADAPTER_CONFIG_FILE,
    adapter_files,
    load_adapter,
    read_adapter,
    save_adapter,
)
from glassgpt.rundir.checkpoint import load_model
from glassgpt.rundir.directory import commit_files
from glassgpt.storage.layout import ADAPTER_CONFIG_FILE as RUN_ADAPTER_FILE

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL = ("q", "k", "v", "o", "gate", "up", "down")
# peft's LoRA on Llama's separate projections, one per glass target
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}
LLAMA = dict(vocab_size=61, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
             mlp_hidden=40, norm="rmsnorm", position="rope", activation="swiglu", bias=False)
GPT2 = dict(vocab_size=61, block_size=32, n_layer=2, n_head=4, n_embd=32)


def glass_model(seed: int = 0, **shape) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**(shape or LLAMA))).eval()


def randomize_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """B is zero at the start (the adapted model equals its base): give it values to see."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in lora_parameters(model).values():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def peft_twin(model: GPT, settings: LoraSettings) -> torch.nn.Module:
    """peft's LoRA on the HF export of `model`'s base, holding `model`'s adapters."""
    hf = to_hf(model).eval()
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                             lora_dropout=settings.dropout, task_type="CAUSAL_LM",
                             target_modules=[HF_MODULES[t].split(".")[1]
                                             for t in settings.targets])
    twin = peft.get_peft_model(hf, config).eval()
    named = dict(twin.named_parameters())
    with torch.no_grad():
        for name, tensor in lora_state_dict(model).items():
            named[peft_name(name)].copy_(tensor)
    return twin


def peft_name(glass: str) -> str:
    """blocks.0.attn.q.lora_A.weight -> peft's name of the same adapter in the PeftModel."""
    _, layer, _, target, matrix, _ = glass.split(".")
    return (f"base_model.model.model.layers.{layer}.{HF_MODULES[target]}.{matrix}.default"
            f".weight")


def tokens(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def adapted() -> tuple[GPT, LoraSettings]:
    settings = LoraSettings(rank=4, alpha=8.0, targets=ALL)
    model = glass_model()
    add_lora(model, settings)
    randomize_adapters(model)
    return model, settings


def test_forward_and_adapter_gradients_equal_peft(adapted) -> None:
    model, settings = adapted
    twin = peft_twin(model, settings)
    idx, targets = tokens(), tokens(3)
    ours = model(idx)[0]
    theirs = twin(input_ids=idx).logits
    assert (ours - theirs).abs().max() < 1e-6
    with torch.no_grad():
        base = glass_model()(idx)[0]
    assert (ours - base).abs().max() > 1e-2  # the adapters change the output
    F.cross_entropy(ours.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(theirs.flatten(0, 1), targets.flatten()).backward()
    named = dict(twin.named_parameters())
    grads = lora_parameters(model)
    assert len(grads) == 2 * 7 * 2
    for name, parameter in grads.items():
        assert (parameter.grad - named[peft_name(name)].grad).abs().max() < 1e-6, name
        parameter.grad = None
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == len(grads)  # the base is frozen


def test_state_dict_keeps_the_base_names() -> None:
    model = glass_model()
    names = list(model.state_dict())
    add_lora(model, LoraSettings(rank=2, alpha=4.0, targets=("q", "v", "down")))
    assert list(model.state_dict()) == names
    assert isinstance(model.blocks[0].attn.qkv, LoraLinear)
    model.load_state_dict(glass_model(seed=5).state_dict())  # a base loads into it strictly


def test_merge_and_unmerge_round_trip_and_equal_peft_merge(adapted) -> None:
    model, settings = adapted
    idx = tokens()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(idx)[0]
        merge_lora(model)
        merged_logits = model(idx)[0]
        merged = to_hf(model).state_dict()
        unmerge_lora(model)
        after = model(idx)[0]
    assert (merged_logits - before).abs().max() < 1e-5
    assert (after - before).abs().max() < 1e-6
    for name, tensor in model.state_dict().items():
        assert (tensor - weights[name]).abs().max() < 1e-6, name
    peft_merged = peft_twin(model, settings).merge_and_unload().state_dict()
    for name, tensor in peft_merged.items():
        assert (merged[name] - tensor).abs().max() < 1e-6, name


def test_glassgpt_adapter_loads_in_peft(adapted, tmp_path) -> None:
    model, _ = adapted
    save_hf(model, tmp_path / "hf")  # the base (the adapters are kept apart)
    save_adapter(model, tmp_path / "hf" / "adapter", base_model=str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "adapter" / ADAPTER_CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(m.split(".")[1]
                                                      for m in HF_MODULES.values())
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter").eval()
    idx = tokens()
    with torch.no_grad():
        assert (model(idx)[0] - theirs(input_ids=idx).logits).abs().max() < 1e-5


def test_peft_adapter_loads_into_glassgpt(tmp_path) -> None:
    model = glass_model()
    config = peft.LoraConfig(r=3, lora_alpha=5.0, target_modules=["q_proj", "v_proj", "up_proj"],
                             task_type="CAUSAL_LM", init_lora_weights=False)  # B not zero
    torch.manual_seed(7)
    theirs = peft.get_peft_model(to_hf(model), config).eval()
    theirs.save_pretrained(tmp_path / "peft")
    settings = load_adapter(model, tmp_path / "peft")
    assert settings == LoraSettings(rank=3, alpha=5.0, targets=("q", "v", "up"))
    idx = tokens()
    with torch.no_grad():
        assert (model(idx)[0] - theirs(input_ids=idx).logits).abs().max() < 1e-5


@pytest.mark.parametrize("settings, named", [
    (dict(rank=0, alpha=1.0), "rank"),
    (dict(rank=33, alpha=1.0), "rank 33"),
    (dict(rank=2, alpha=1.0, targets=("q", "x")), "targets"),
])
def test_bad_settings_are_refused(settings: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        add_lora(glass_model(), LoraSettings(**settings))


def test_a_target_the_model_lacks_is_refused_naming_those_it_has() -> None:
    with pytest.raises(ConfigError, match="gate.*q, k, v, o, up, down"):
        add_lora(glass_model(**GPT2), LoraSettings(2, 4.0, targets=("gate",)))


def test_rank_above_the_narrowest_width_is_refused() -> None:  # k and v are 16 wide (GQA)
    with pytest.raises(ConfigError, match="rank 17 is more than the width of k"):
        add_lora(glass_model(), LoraSettings(17, 4.0, targets=("q", "k")))


def test_adapter_for_another_base_is_one_checkpoint_error(adapted, tmp_path) -> None:
    model, _ = adapted
    save_adapter(model, tmp_path / "adapter", base_model="tiny")
    wider = glass_model(**{**LLAMA, "n_embd": 64})
    with pytest.raises(CheckpointError, match="shape"):
        load_adapter(wider, tmp_path / "adapter")
    deeper = glass_model(**{**LLAMA, "n_layer": 1})
    with pytest.raises(CheckpointError, match="another base"):
        load_adapter(deeper, tmp_path / "adapter")
    with pytest.raises(CheckpointError, match="fan_in_fan_out"):
        load_adapter(glass_model(**GPT2), tmp_path / "adapter")


def test_gpt2_c_attn_adapter_is_exact_in_peft_and_reads_back(tmp_path) -> None:
    model = glass_model(**GPT2)
    settings = LoraSettings(rank=2, alpha=3.0, targets=("q", "k", "v", "o", "up", "down"))
    add_lora(model, settings)
    randomize_adapters(model)
    save_hf(model, tmp_path / "hf")
    save_adapter(model, tmp_path / "hf" / "adapter", base_model=str(tmp_path / "hf"))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter").eval()
    idx = tokens()
    with torch.no_grad():
        assert (model(idx)[0] - theirs(input_ids=idx).logits).abs().max() < 1e-5
    read, tensors = read_adapter(tmp_path / "hf" / "adapter", model.config)
    assert read == settings
    for name, tensor in lora_state_dict(model).items():
        assert torch.equal(tensors[name], tensor), name


def test_gpt2_q_alone_and_a_mixing_c_attn_adapter_are_refused(tmp_path) -> None:
    model = glass_model(**GPT2)
    add_lora(model, LoraSettings(rank=2, alpha=3.0, targets=("q",)))
    with pytest.raises(ConfigError, match="c_attn holds q, k and v together"):
        adapter_files(model, "tiny")
    config = peft.LoraConfig(r=2, lora_alpha=4.0, target_modules=["c_attn"],
                             fan_in_fan_out=True, task_type="CAUSAL_LM",
                             init_lora_weights=False)
    theirs = peft.get_peft_model(to_hf(glass_model(**GPT2)), config)
    theirs.save_pretrained(tmp_path / "peft")
    with pytest.raises(CheckpointError, match="c_attn"):
        load_adapter(glass_model(**GPT2), tmp_path / "peft")


def test_run_with_an_adapter_samples_and_exports_merged_or_apart(run_copy, tmp_path) -> None:
    base, _ = load_model(run_copy)
    settings = LoraSettings(rank=2, alpha=4.0)
    add_lora(base, settings)
    randomize_adapters(base)
    commit_files(run_copy, run_adapter_files(base))
    assert (run_copy / RUN_ADAPTER_FILE).is_file()  # beside the base, which is unchanged
    idx = torch.randint(0, base.config.vocab_size, (1, 8), generator=torch.Generator())
    with torch.no_grad():
        expected = base(idx)[0]
        tuned, _ = load_model(run_copy)  # merged, a plain GPT again
        assert not any(isinstance(m, LoraLinear) for m in tuned.modules())
        # as trainable as any loaded model: the view's head scores sized their batch by the
        # trainable parameters and divided by zero on a tuned run's frozen ones
        assert all(p.requires_grad for p in tuned.parameters())
        assert (tuned(idx)[0] - expected).abs().max() < 1e-5
    assert main(["convert", str(run_copy), "--to-hf", str(tmp_path / "apart"), "--adapter"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "apart")
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "apart" / "adapter").eval()
    assert main(["convert", str(run_copy), "--to-hf", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert (theirs(input_ids=idx).logits - expected).abs().max() < 1e-5
        assert (merged(input_ids=idx).logits - expected).abs().max() < 1e-5


def test_convert_adapter_of_a_run_without_one_is_refused(run_copy, tmp_path, capsys) -> None:
    assert main(["convert", str(run_copy), "--to-hf", str(tmp_path / "out"), "--adapter"]) == 2
    assert "holds no LoRA adapter" in capsys.readouterr().err


def test_the_lora_bench_measures_a_tune_in_its_own_process() -> None:
    from glassgpt.bench.lora import LoraBenchSize, base_model, bench_lora

    size = LoraBenchSize(preset="cpu-small-modern", n_layer=1, rank=2, alpha=4.0, seq_len=16,
                         steps=2, checkpointed=True)
    result = bench_lora(size)
    model = base_model(size, torch.float32)
    add_lora(model, LoraSettings(2, 4.0, targets=("q", "k", "v", "o", "gate", "up", "down")))
    assert result.adapter_parameters == sum(p.numel() for p in lora_parameters(model).values())
    assert result.parameters == sum(p.numel() for p in model.parameters()) - \
        result.adapter_parameters
    assert result.base_weight_mib == result.parameters * 2 / 2**20
    assert result.peak_rss_mib > result.base_weight_mib and result.seconds_per_step > 0
    assert result.peak_over_bf16_weights == result.peak_rss_mib / result.base_weight_mib
