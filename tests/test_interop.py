"""Hugging Face GPT-2 interop: same logits, same greedy tokens, bit-exact round trips."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from glassgpt import GPT, ConfigError, GPTConfig
from glassgpt.decoding.generate import generate
from glassgpt.errors import CheckpointError
from glassgpt.formats.interop import (
    MissingExtraError,
    config_from_hf,
    from_hf,
    hf_config_from_glassgpt,
    save_hf,
    to_hf,
)
from glassgpt.tokenizers import BPETokenizer

transformers = pytest.importorskip("transformers")
GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}

# Weights this small keep greedy decoding of a random model from locking onto one token.
GENERATION_SCALE = 0.05

# Tiny shapes; vocabularies that are not multiples of 64, and both tied and untied heads.
HF_SHAPES = [
    dict(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4),
    dict(vocab_size=1001, n_positions=12, n_embd=48, n_layer=3, n_head=6,
         activation_function="gelu", layer_norm_epsilon=1e-6),
    dict(vocab_size=97, n_positions=8, n_embd=16, n_layer=1, n_head=1,
         activation_function="relu", tie_word_embeddings=False),
    dict(vocab_size=211, n_positions=20, n_embd=24, n_layer=2, n_head=3,
         activation_function="gelu_pytorch_tanh"),
]
GLASSGPT_SHAPES = [
    dict(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32),
    dict(vocab_size=1001, block_size=10, n_layer=3, n_head=2, n_embd=40, activation="gelu",
         norm_eps=1e-6, tie_weights=False),
    dict(vocab_size=65, block_size=12, n_layer=1, n_head=4, n_embd=16, activation="relu"),
]


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Give every parameter (LayerNorms too) distinct random values, so a swapped or
    mistransposed weight cannot hide behind the default ones and zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            param.copy_(noise * scale)


def tiny_hf_model(seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 0.3,
                  **shape) -> GPT2LMHeadModel:
    config = GPT2Config(bos_token_id=None, eos_token_id=None, **shape)
    model = GPT2LMHeadModel(config).to(dtype)
    randomize(model, seed, scale)
    return model.eval()


def tiny_glassgpt_model(seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 0.3,
                        **shape) -> GPT:
    model = GPT(GPTConfig(**shape)).to(dtype)
    randomize(model, seed, scale)
    return model.eval()


def random_tokens(vocab_size: int, length: int, seed: int = 1, batch: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def hf_logits(model: GPT2LMHeadModel, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


def our_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx)[0]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


# --- HF -> glassgpt -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", HF_SHAPES, ids=lambda s: f"V{s['vocab_size']}-L{s['n_layer']}")
def test_imported_model_gives_hf_logits(shape: dict, dtype: torch.dtype) -> None:
    hf_model = tiny_hf_model(dtype=dtype, **shape)
    model = from_hf(hf_model)
    assert model.tok_emb.weight.dtype == dtype
    assert model.config.tie_weights == shape.get("tie_word_embeddings", True)
    assert (model.lm_head.weight is model.tok_emb.weight) == model.config.tie_weights
    idx = random_tokens(shape["vocab_size"], shape["n_positions"])
    ours, theirs = our_logits(model, idx), hf_logits(hf_model, idx)
    assert ours.shape == theirs.shape == (3, shape["n_positions"], shape["vocab_size"])
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("shape", HF_SHAPES[:3], ids=lambda s: f"V{s['vocab_size']}")
def test_imported_model_generates_hf_greedy_tokens(shape: dict) -> None:
    hf_model = tiny_hf_model(seed=3, dtype=torch.float64, scale=GENERATION_SCALE, **shape)
    model = from_hf(hf_model)
    prompt = random_tokens(shape["vocab_size"], 3, seed=4)
    new = shape["n_positions"] - 3
    theirs = hf_model.generate(prompt, do_sample=False, max_new_tokens=new, min_new_tokens=new)
    ours = generate(model, prompt, max_new_tokens=new, temperature=0.0)
    assert ours.shape == (3, shape["n_positions"])
    assert torch.equal(ours, theirs)
    assert len(set(ours[:, 3:].flatten().tolist())) > 1  # the tokens vary: a real comparison


def test_mask_buffers_of_old_checkpoints_are_skipped() -> None:
    hf_model = tiny_hf_model(**HF_SHAPES[0])
    T = HF_SHAPES[0]["n_positions"]
    for block in hf_model.transformer.h:  # what transformers < 4.40 kept in every layer
        block.attn.register_buffer("bias", torch.ones(1, 1, T, T, dtype=torch.bool).tril())
        block.attn.register_buffer("masked_bias", torch.tensor(-1e4))
    assert "transformer.h.0.attn.bias" in hf_model.state_dict()
    model = from_hf(hf_model)
    idx = random_tokens(97, T)
    torch.testing.assert_close(our_logits(model, idx), hf_logits(hf_model, idx), atol=1e-5,
                               rtol=0)


def test_import_takes_hf_settings() -> None:
    hf_config = GPT2Config(vocab_size=1001, n_positions=12, n_embd=48, n_layer=3, n_head=6,
                           layer_norm_epsilon=1e-6, resid_pdrop=0.2, embd_pdrop=0.2,
                           attn_pdrop=0.2, activation_function="gelu_new",
                           tie_word_embeddings=False)
    config = config_from_hf(hf_config)
    assert config == GPTConfig(vocab_size=1001, block_size=12, n_layer=3, n_head=6, n_embd=48,
                               dropout=0.2, norm_eps=1e-6, activation="gelu_tanh",
                               tie_weights=False)


@pytest.mark.parametrize(("setting", "named"), [
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(scale_attn_weights=False), "scale_attn_weights"),
    (dict(n_inner=100), "n_inner"),
    (dict(activation_function="silu"), "silu"),
    (dict(add_cross_attention=True), "add_cross_attention"),
    (dict(attn_pdrop=0.0), "dropout"),
])
def test_import_rejects_what_glassgpt_cannot_mirror(setting: dict, named: str) -> None:
    hf_config = GPT2Config(vocab_size=97, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                           **setting)
    with pytest.raises(ConfigError, match=named):
        config_from_hf(hf_config)


def test_differing_dropouts_import_when_one_is_chosen() -> None:
    hf_config = GPT2Config(vocab_size=97, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                           attn_pdrop=0.0)
    assert config_from_hf(hf_config, dropout=0.05).dropout == 0.05


def test_import_rejects_other_model_types() -> None:
    with pytest.raises(ConfigError, match="mistral"):
        config_from_hf(SimpleNamespace(model_type="mistral"))


def test_import_rejects_a_damaged_weights_file(tmp_path) -> None:
    tiny_hf_model(**HF_SHAPES[0]).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])  # a download cut short
    with pytest.raises(CheckpointError, match="holds 5,000 bytes but its header describes"):
        from_hf(tmp_path)


def test_import_rejects_a_file_and_a_directory_without_a_model(tmp_path) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="is a file"):
        from_hf(file)
    with pytest.raises(CheckpointError, match="cannot load a Hugging Face model"):
        from_hf(tmp_path)


# --- glassgpt -> HF -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", GLASSGPT_SHAPES, ids=lambda s: f"V{s['vocab_size']}")
def test_exported_model_gives_our_logits(shape: dict, dtype: torch.dtype) -> None:
    model = tiny_glassgpt_model(dtype=dtype, **shape)
    hf_model = to_hf(model)
    assert hf_model.config.n_positions == shape["block_size"]
    assert hf_model.config.tie_word_embeddings == shape.get("tie_weights", True)
    idx = random_tokens(shape["vocab_size"], shape["block_size"])
    torch.testing.assert_close(hf_logits(hf_model, idx), our_logits(model, idx),
                               atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("shape", GLASSGPT_SHAPES, ids=lambda s: f"V{s['vocab_size']}")
def test_exported_model_generates_our_greedy_tokens(shape: dict) -> None:
    model = tiny_glassgpt_model(seed=5, dtype=torch.float64, scale=GENERATION_SCALE,
                                **shape)
    hf_model = to_hf(model)
    prompt = random_tokens(shape["vocab_size"], 2, seed=6)
    new = shape["block_size"] - 2
    theirs = hf_model.generate(prompt, do_sample=False, max_new_tokens=new, min_new_tokens=new)
    ours = generate(model, prompt, max_new_tokens=new, temperature=0.0)
    assert torch.equal(ours, theirs)
    assert len(set(ours[:, 2:].flatten().tolist())) > 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports
def test_export_unwraps_a_compiled_model() -> None:
    model = tiny_glassgpt_model(**GLASSGPT_SHAPES[0])
    hf_model = to_hf(torch.compile(model))  # compiles nothing: only the weights are read
    assert_same_tensors(from_hf(hf_model).state_dict(), model.state_dict())


def test_saved_directory_reloads_in_transformers(tmp_path) -> None:
    model = tiny_glassgpt_model(**GLASSGPT_SHAPES[1])
    out = save_hf(model, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not list(out.glob("*.bin"))  # safetensors only: nothing to unpickle
    reloaded = GPT2LMHeadModel.from_pretrained(out).eval()
    idx = random_tokens(1001, 10)
    torch.testing.assert_close(hf_logits(reloaded, idx), our_logits(model, idx), atol=1e-5,
                               rtol=0)
    assert not [p.name for p in tmp_path.iterdir() if p.name != "hf"]  # no staging left over


def test_saved_directory_carries_a_bpe_tokenizer(tmp_path, small_text) -> None:
    tokenizer = BPETokenizer.train(small_text.read_text(encoding="utf-8"), 300)
    vocab = tokenizer.vocab_size
    model = tiny_glassgpt_model(vocab_size=vocab, block_size=16, n_layer=1, n_head=2, n_embd=16)
    out = save_hf(model, tmp_path / "hf", tokenizer=tokenizer.tokenizer,
                  eos_token="<|endoftext|>")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "To be or not to be, line 7"
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text)
    eos_id = tokenizer.tokenizer.token_to_id("<|endoftext|>")
    assert hf_tokenizer.eos_token_id == eos_id
    assert GPT2LMHeadModel.from_pretrained(out).config.eos_token_id == eos_id


def test_save_never_overwrites_a_directory_with_files(tmp_path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="already exists"):
        save_hf(tiny_glassgpt_model(**GLASSGPT_SHAPES[0]), tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize(("setting", "named"), [
    (dict(pre_ln=False), "pre_ln=False"),
    (dict(bias=False), "bias=False"),
])
def test_export_rejects_what_gpt2_cannot_represent(setting: dict, named: str) -> None:
    config = GPTConfig(vocab_size=97, block_size=8, n_layer=1, n_head=2, n_embd=16, **setting)
    with pytest.raises(ConfigError, match=named):
        hf_config_from_glassgpt(config)
    with pytest.raises(ConfigError, match=named):
        to_hf(GPT(config))


def test_export_rejects_special_tokens_outside_the_vocabulary() -> None:
    config = GPTConfig(vocab_size=97, block_size=8, n_layer=1, n_head=2, n_embd=16)
    with pytest.raises(ConfigError, match="eos_token_id=50256"):
        hf_config_from_glassgpt(config, eos_token_id=50256)


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", GLASSGPT_SHAPES, ids=lambda s: f"V{s['vocab_size']}")
def test_glassgpt_round_trip_is_bit_exact(shape: dict) -> None:
    model = tiny_glassgpt_model(**shape)
    back = from_hf(to_hf(model))
    assert back.config == model.config
    assert_same_tensors(back.state_dict(), model.state_dict())


@pytest.mark.parametrize("shape", HF_SHAPES, ids=lambda s: f"V{s['vocab_size']}-L{s['n_layer']}")
def test_hf_round_trip_is_bit_exact(shape: dict) -> None:
    hf_model = tiny_hf_model(**shape)
    assert_same_tensors(to_hf(from_hf(hf_model)).state_dict(), hf_model.state_dict())


def test_round_trip_through_a_directory_is_bit_exact(tmp_path) -> None:
    model = tiny_glassgpt_model(dtype=torch.float64, **GLASSGPT_SHAPES[1])
    back = from_hf(save_hf(model, tmp_path / "hf"))
    assert back.config == model.config
    assert_same_tensors(back.state_dict(), model.state_dict())


def test_missing_transformers_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    config = GPTConfig(vocab_size=97, block_size=8, n_layer=1, n_head=2, n_embd=16)
    with pytest.raises(MissingExtraError, match=r"pip install 'glassgpt\[hf\]'"):
        to_hf(GPT(config))
