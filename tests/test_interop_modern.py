"""Hugging Face Llama and Qwen3 interop: the whole model equals transformers', both ways.

Tiny random models built here (offline): GQA 4->2 and MQA 4->1, tied and untied heads, with and
without biases. In float32 the reference is transformers itself, untouched. In float64 it is the
same except for two casts: transformers computes RMSNorm and the rotary angles in float32
whatever the model's dtype, which caps any comparison at float32's precision; the test lifts
those two (same formulas, in float64) so that everything else (the q/k/v split, the grouped
K/V, QK-norm, the MLP, the head) is compared to 1e-10.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from glassgpt import GPT, ConfigError, GPTConfig
from glassgpt.cli import main
from glassgpt.decoding.generate import generate
from glassgpt.errors import CheckpointError
from glassgpt.formats.interop import config_from_hf, from_hf, hf_config_from_glassgpt, to_hf
from glassgpt.rundir.checkpoint import load_model

transformers = pytest.importorskip("transformers")

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
GENERATION_SCALE = 0.05  # small weights keep greedy decoding of a random model from looping
PROMPT = "To be or not"

# (architecture, shape): n_head=4 throughout, 2 or 1 KV heads; vocabularies not multiples of 64.
SHAPES = [
    ("llama", dict(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    ("llama", dict(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                   mlp_bias=True, rms_norm_eps=1e-5, rope_theta=500.0)),
    ("qwen3", dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
    ("qwen3", dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                   tie_word_embeddings=True, rope_theta=1e6)),
]
SHAPE_IDS = ["llama-gqa-tied", "llama-mqa-bias", "qwen3-gqa", "qwen3-mqa-tied"]
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def hf_config(arch: str, block_size: int = 16, **shape) -> transformers.PretrainedConfig:
    config_class = getattr(transformers, CLASSES[arch][0])
    theta = shape.pop("rope_theta", 10000.0)
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
            if "rope_parameters" in config_class().to_dict() else {"rope_theta": theta})
    return config_class(max_position_embeddings=block_size, bos_token_id=None,
                        eos_token_id=None, pad_token_id=None, **rope, **shape)


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Distinct random values in every parameter (norm scales too): a swapped or misplaced
    weight cannot hide behind ones and zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64)
                        * scale)


def tiny_hf_model(arch: str, shape: dict, dtype: torch.dtype = torch.float32, seed: int = 0,
                  scale: float = 0.3, block_size: int = 16) -> torch.nn.Module:
    model = getattr(transformers, CLASSES[arch][1])(hf_config(arch, block_size, **shape))
    model = model.to(dtype)
    randomize(model, seed, scale)
    return model.eval()


def in_float64(hf_model: torch.nn.Module) -> torch.nn.Module:
    """Lift transformers' float32 RMSNorm and rotary angles to float64 (see the module doc)."""
    def rms_norm(self, x):
        mean_square = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(mean_square + self.variance_epsilon))

    def rotary(self, x, position_ids):
        config = self.config
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        d = config.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = position_ids[..., None].double() * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    for module in hf_model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(rms_norm, module)
    rotary_emb = hf_model.model.rotary_emb
    rotary_emb.forward = types.MethodType(rotary, rotary_emb)
    return hf_model


def tokens(vocab_size: int, length: int, seed: int = 1, batch: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def logits_of(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out[0]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


# --- the whole model, both ways ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("arch", "shape"), SHAPES, ids=SHAPE_IDS)
def test_imported_and_exported_models_equal_transformers(arch, shape, dtype) -> None:
    hf_model = tiny_hf_model(arch, dict(shape), dtype)
    if dtype == torch.float64:
        in_float64(hf_model)
    model = from_hf(hf_model)
    c = model.config
    assert (c.position, c.norm, c.activation, c.qk_norm) == ("rope", "rmsnorm", "swiglu",
                                                            arch == "qwen3")
    assert (c.n_kv_head or c.n_head) == shape["num_key_value_heads"] and c.tie_weights == \
        shape.get("tie_word_embeddings", False)
    assert (model.lm_head.weight is model.tok_emb.weight) == c.tie_weights
    assert model.tok_emb.weight.dtype == dtype
    idx = tokens(shape["vocab_size"], 16)
    theirs = logits_of(hf_model, idx)
    assert theirs.shape == (3, 16, shape["vocab_size"])
    torch.testing.assert_close(logits_of(model, idx), theirs, atol=TOLERANCE[dtype], rtol=0)

    exported = to_hf(model)  # and back out: the same class, the same weights, bit for bit
    assert type(exported).__name__ == CLASSES[arch][1]
    assert_same_tensors(exported.state_dict(), hf_model.state_dict())


@pytest.mark.parametrize(("arch", "shape"), SHAPES[::3], ids=SHAPE_IDS[::3])
def test_imported_model_generates_transformers_greedy_tokens(arch, shape) -> None:
    hf_model = tiny_hf_model(arch, dict(shape), torch.float64, seed=3, scale=GENERATION_SCALE)
    model = from_hf(in_float64(hf_model))
    check_greedy_tokens_equal(hf_model, model, shape["vocab_size"])


def check_greedy_tokens_equal(hf_model: torch.nn.Module, model: torch.nn.Module,
                              vocab_size: int) -> None:
    """13 greedy tokens after a 3-token prompt: glassgpt's `generate` gives transformers'."""
    prompt = tokens(vocab_size, 3, seed=4)
    theirs = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=13, min_new_tokens=13)
    ours = generate(model, prompt, max_new_tokens=13, temperature=0.0)
    assert torch.equal(ours, theirs)
    assert len(set(ours[:, 3:].flatten().tolist())) > 1  # the tokens vary: a real comparison


def test_a_glassgpt_config_round_trips_through_its_hf_config() -> None:
    for qk_norm in (False, True):
        config = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32,
                           position="rope", norm="rmsnorm", activation="swiglu", mlp_hidden=40,
                           n_kv_head=2, qk_norm=qk_norm, bias=False, tie_weights=False,
                           rope_theta=5e5, norm_eps=1e-6)
        hf = hf_config_from_glassgpt(config)
        assert hf.model_type == ("qwen3" if qk_norm else "llama")
        assert config_from_hf(hf) == config


# --- what cannot be mirrored is one line naming it ----------------------------------------------


@pytest.mark.parametrize(("arch", "setting", "named"), [
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic'"),
    ("llama", dict(rope_scaling={"type": "yarn", "factor": 2.0}), "'yarn'"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     "'llama3' needs low_freq_factor"),
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                    "attention_factor": 0.5}), "attention_factor"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("llama", dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
    ("llama", dict(attention_dropout=0.1), "attention_dropout=0.1"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
    ("qwen3", dict(use_sliding_window=True), "use_sliding_window=True"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "sliding_attention"),
    ("qwen2", dict(use_sliding_window=True), "use_sliding_window=True"),
    ("smollm3", dict(no_rope_layers=[2]), "no_rope_layers must hold a 0 or 1"),
])
def test_import_refuses_what_glassgpt_cannot_mirror(arch, setting, named) -> None:
    settings = dict(vocab_size=11, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    settings = types.SimpleNamespace(model_type=arch, **{**settings, **setting})
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf(settings)


MODERN = dict(vocab_size=11, block_size=8, n_layer=1, n_head=4, n_embd=16, position="rope",
              norm="rmsnorm", activation="swiglu", n_kv_head=2)


@pytest.mark.parametrize(("switches", "named"), [
    (dict(position="none"), "position='none' cannot be exported"),
    (dict(activation="relu2"), "activation='relu2' cannot be exported"),
    (dict(norm="layernorm"), "norm='layernorm' cannot be exported"),
    (dict(qk_norm=True, bias=True), "bias=True with qk_norm cannot be exported"),
    (dict(logit_softcap=30.0), "logit_softcap=30.0 cannot be exported"),
    (dict(position="learned", activation="gelu_tanh"), "norm='rmsnorm' with learned positions"),
    (dict(position="learned", norm="layernorm", activation="gelu_tanh"),
     "n_kv_head=2 cannot be exported: GPT-2"),
])
def test_export_refuses_a_run_no_hf_architecture_expresses(switches, named) -> None:
    config = GPTConfig(**{**MODERN, **switches})
    with pytest.raises(ConfigError, match=named):
        to_hf(GPT(config))


# --- directories: read by glassgpt, checked before anything is built ----------------------------


@pytest.fixture(scope="module")
def tokenizer_and_data(tmp_path_factory):
    """A byte-level BPE tokenizer and a data directory prepared with it (offline)."""
    from glassgpt.data import PreparedData, prepare

    root = tmp_path_factory.mktemp("modern-data")
    text = root / "text.txt"
    text.write_text("".join(f"To be or not to be, line {i}: that is the question.\n"
                            for i in range(200)), encoding="utf-8")
    prepare(root / "data", text, "bpe", 300)
    data = PreparedData(root / "data")
    return data.tokenizer, root / "data"


HF_DIRS = {  # the two: a Llama with grouped KV heads, a Qwen3 with QK-norm
    "llama": dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8),
}


@pytest.fixture(scope="module")
def hf_dirs(tokenizer_and_data, tmp_path_factory) -> dict[str, Path]:
    tokenizer, _ = tokenizer_and_data
    dirs = {}
    for arch, shape in HF_DIRS.items():
        model = tiny_hf_model(arch, {**shape, "vocab_size": tokenizer.vocab_size}, seed=7,
                              scale=GENERATION_SCALE, block_size=32)
        path = tmp_path_factory.mktemp(arch) / "source"
        model.save_pretrained(path)
        tokenizer.save(path / "tokenizer.json")
        dirs[arch] = path
    return dirs


def greedy_text(hf_model, tokenizer, prompt: str, new: int) -> str:
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=new, min_new_tokens=new)
    return prompt + tokenizer.decode(out[0, ids.shape[1]:].tolist())


def check_run_samples_and_exports(run: Path, out: Path, source, tokenizer, idx: torch.Tensor,
                                  capsys, atol: float):
    """A converted run gives `source`'s logits on idx, `sample --temperature 0` writes the text
    of transformers' greedy `generate`, and `convert --to-hf` gives a directory that loads with
    AutoModelForCausalLM to the same logits; returns that exported model and the sampled text."""
    torch.testing.assert_close(logits_of(load_model(run)[0], idx), logits_of(source, idx),
                               atol=atol, rtol=0)
    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", PROMPT, "--temperature", "0",
                 "--max-new-tokens", "12", "--threads", "1"]) == 0
    sampled = capsys.readouterr().out
    assert sampled == greedy_text(source, tokenizer, PROMPT, 12) + "\n"
    assert len(set(sampled.removeprefix(PROMPT))) > 3  # not one token repeated
    assert main(["convert", str(run), "--to-hf", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits_of(exported, idx), logits_of(source, idx), atol=atol,
                               rtol=0)
    return exported, sampled


@pytest.mark.parametrize("arch", HF_DIRS)
def test_a_directory_goes_through_a_run_and_back_out(arch, hf_dirs, tokenizer_and_data, tmp_path,
                                                     capsys) -> None:
    """convert --from-hf, then --to-hf: the logits of the original; `sample --temperature 0`
    writes the text of transformers' greedy `generate`; the export loads with the Auto classes
    and `pipeline`."""
    tokenizer, _ = tokenizer_and_data
    source = getattr(transformers, CLASSES[arch][1]).from_pretrained(hf_dirs[arch]).eval()
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["convert", "--from-hf", str(hf_dirs[arch]), "--out", str(run)]) == 0
    assert "rope, rmsnorm, swiglu, 2 KV heads" in capsys.readouterr().out
    idx = tokens(tokenizer.vocab_size, 32)
    exported, sampled = check_run_samples_and_exports(run, out, source, tokenizer, idx, capsys,
                                                      atol=1e-5)
    assert type(exported).__name__ == CLASSES[arch][1]
    generator = transformers.pipeline("text-generation", model=str(out))
    piped = generator(PROMPT, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert piped[0]["generated_text"] == sampled.removesuffix("\n")


def test_eval_and_attention_read_an_imported_run(hf_dirs, tokenizer_and_data, tmp_path,
                                                 capsys) -> None:
    _, data = tokenizer_and_data
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(hf_dirs["qwen3"]), "--out", str(run)]) == 0
    assert main(["eval", str(run), "--data", str(data), "--max-batches", "1", "--batch-size",
                 "2", "--threads", "1"]) == 0
    assert "bits per byte" in capsys.readouterr().out
    picture = tmp_path / "attention.png"
    assert main(["attention", str(run), "--prompt", PROMPT, "--out", str(picture)]) == 0
    assert picture.stat().st_size > 1000


def edited_copy(source: Path, tmp_path: Path, **changes) -> Path:
    import shutil
    copy = shutil.copytree(source, tmp_path / "hf")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **changes}))
    return copy


@pytest.mark.parametrize(("changes", "message"), [
    (dict(num_hidden_layers=100_000), "missing from the weights: "
                                      "['model.layers.2.input_layernorm.weight'"),
    (dict(num_key_value_heads=4), "model.layers.0.self_attn.k_proj.weight"),
    (dict(model_type="mistral"), "model_type='mistral'"),
    (dict(num_key_value_heads="2"), "num_key_value_heads must be an integer or null"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
    (dict(max_position_embeddings=2**40), "max_position_embeddings=1,099,511,627,776 is more"),
])
def test_a_lying_llama_directory_is_one_line(changes, message, hf_dirs, tmp_path,
                                             capsys) -> None:
    hf = edited_copy(hf_dirs["llama"], tmp_path, **changes)
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_rope_theta_is_read_where_either_transformers_keeps_it(hf_dirs, tmp_path) -> None:
    """config.json of transformers 4.x: rope_theta beside rope_scaling; of 5.x: inside
    rope_parameters."""
    hf = edited_copy(hf_dirs["llama"], tmp_path)
    config = json.loads((hf / "config.json").read_text())
    config.pop("rope_parameters", None)
    (hf / "config.json").write_text(json.dumps({**config, "rope_theta": 123.0,
                                                "rope_scaling": None}))
    assert from_hf(hf).config.rope_theta == 123.0
    (hf / "config.json").write_text(json.dumps(
        {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 4567.0}}))
    assert from_hf(hf).config.rope_theta == 4567.0


def test_a_base_model_checkpoint_without_the_model_prefix_imports(hf_dirs, tmp_path) -> None:
    """LlamaModel (no LM head) saves `layers.0...`; with a tied head that is a whole LM."""
    from safetensors.torch import load_file, save_file

    hf = edited_copy(hf_dirs["llama"], tmp_path)
    tensors = load_file(hf / "model.safetensors")
    save_file({name.removeprefix("model."): t for name, t in tensors.items()},
              hf / "model.safetensors", metadata={"format": "pt"})
    assert_same_tensors(from_hf(hf).state_dict(), from_hf(hf_dirs["llama"]).state_dict())


def test_a_checkpoint_of_the_wrong_shape_is_named(hf_dirs, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    hf = edited_copy(hf_dirs["qwen3"], tmp_path)
    tensors = load_file(hf / "model.safetensors")
    name = "model.layers.1.self_attn.q_norm.weight"
    tensors[name] = torch.ones(4)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name):
        from_hf(hf)


def test_the_logit_lens_reads_through_the_final_rmsnorm() -> None:
    """Each layer's read-out is transformers' hidden state after that layer, through its final
    RMSNorm (model.norm) and head: the lens and HF agree on what every layer predicts."""
    from glassgpt.interp.methods.lens import logit_lens

    arch, shape = SHAPES[2]
    hf_model = in_float64(tiny_hf_model(arch, dict(shape), torch.float64))
    idx = tokens(shape["vocab_size"], 8, batch=1)
    with torch.no_grad():
        hidden = hf_model(idx, output_hidden_states=True).hidden_states
        theirs = [hf_model.lm_head(hf_model.model.norm(h)) for h in hidden[:-1]]
    ours = logit_lens(from_hf(hf_model), idx)  # (L + 1, B, T, V)
    assert ours.shape[0] == len(hidden) == shape["num_hidden_layers"] + 1
    for depth, read_out in enumerate(theirs):  # HF's last state already went through the norm
        torch.testing.assert_close(ours[depth], read_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(ours[-1], logits_of(hf_model, idx), atol=1e-10, rtol=0)


def test_a_transformers_without_qwen3_names_itself(monkeypatch) -> None:
    """Qwen3 arrived in transformers 4.51; pyproject allows 4.46."""
    from glassgpt.formats import interop
    from glassgpt.formats.interop import MissingExtraError

    older = types.SimpleNamespace(__version__="4.46.0", LlamaConfig=transformers.LlamaConfig)
    monkeypatch.setattr(interop, "_transformers", lambda: older)
    config = GPTConfig(**{**MODERN, "qk_norm": True, "bias": False})
    with pytest.raises(MissingExtraError, match="transformers 4.46.0 has no Qwen3Config; "
                                                "upgrade it"):
        to_hf(GPT(config))
