"""GGUF export (`convert RUN --to-gguf OUT.gguf`): read back with gguf's own reader, tensor by
tensor and key by key, and run by llama.cpp (llama-cpp-python, where it is installed): the same
logits, the same greedy tokens, the same token ids for a text."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import TINY_TEXT
from glassgpt import GPT, GPTConfig
from glassgpt.bench.llamacpp import without_repacking
from glassgpt.decoding.generate import generate
from glassgpt.errors import CheckpointError, ConfigError, TokenizerError
from glassgpt.formats.files import MissingExtraError
from glassgpt.formats.gguf import export_gguf, write_gguf
from glassgpt.rundir.checkpoint import save_model
from glassgpt.rundir.directory import commit_files
from glassgpt.storage.layout import CHAT_TEMPLATE_FILE
from glassgpt.tokenizers import BPETokenizer, CharTokenizer
from glassgpt.tokenizers.chat import ChatTemplate
from helpers_cli import glassgpt, one_error_line

gguf = pytest.importorskip("gguf", reason="GGUF export needs the optional extra gguf")

ROTARY = dict(position="rope", norm="rmsnorm", activation="swiglu", bias=False)
# Each architecture, and the switches each writes differently: untied head, grouped K/V and a
# hidden width of its own (llama), biases everywhere (llama_bias), head width apart from the
# model's (qwen3), q/k/v biases alone (qwen2), both rotary scalings.
SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": {},
    "llama": dict(ROTARY, n_kv_head=2, tie_weights=False, mlp_hidden=96),
    "llama_bias": dict(ROTARY, bias=True, n_kv_head=2),
    "qwen3": dict(ROTARY, n_kv_head=2, qk_norm=True, head_dim=16),
    "qwen2": dict(ROTARY, qkv_bias=True, n_kv_head=2),
    "llama3": dict(ROTARY, rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                   rope_high_freq_factor=4.0, rope_original_context=8, rope_theta=500.0),
    "linear": dict(ROTARY, rope_scaling="linear", rope_factor=4.0),
}
ARCHITECTURE = {"gpt2": "gpt2", "qwen3": "qwen3", "qwen2": "qwen2"}  # the rest: llama
# Spaces, tabs, CR LF, digits, contractions, accents, CJK and an emoji: each pre-tokenizer's
# rules are met.
PROBE = "To be, or not to be: 12345 it's  \tthe QUESTION'S\r\n\nÉté 東京 🙂 end "


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(TINY_TEXT, 300)


def random_model(shape: str, vocab_size: int, n_embd: int = 32) -> GPT:
    """A model of `shape` whose every weight is drawn from N(0, 0.2): norms and biases too,
    so a tensor written in the wrong place shows in the logits."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=32, n_layer=2, n_head=4,
                          n_embd=n_embd, **SHAPES[shape])).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def field(reader: Any, key: str) -> Any:
    found = reader.get_field(key)
    return None if found is None else found.contents()


def read_back(path: Path) -> tuple[Any, dict[str, tuple[np.ndarray, Any]]]:
    """The reader, and name -> (values as float32, GGUF type) of every tensor."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        [int(n) for n in reversed(t.shape)]), t.tensor_type) for t in reader.tensors}
    return reader, tensors


def adjacent_pairs_undone(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of the export's reordering of llama q/k rows: pairs (2i, 2i+1) back to
    (i, i + d/2) in each head."""
    d = rows.shape[0] // n_heads
    return rows.reshape(n_heads, d // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


OUR_NAMES = {"attn_norm": "ln1", "ffn_norm": "ln2", "attn_qkv": "attn.qkv",
             "attn_output": "attn.proj", "ffn_down": "ffn.proj", "ffn_gate": "ffn.gate",
             "attn_q_norm": "attn.q_norm", "attn_k_norm": "attn.k_norm"}


def as_glassgpt(tensors: dict[str, tuple[np.ndarray, Any]], config: GPTConfig, arch: str
                ) -> dict[str, torch.Tensor]:
    """The file's tensors under glassgpt's names, q/k/v stacked again (llama's rows put back),
    written here from llama.cpp's names rather than from the export's code."""
    ours: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    top = {"token_embd": "tok_emb", "position_embd": "pos_emb", "output_norm": "ln_f",
           "output": "lm_head"}
    for name, (values, _) in tensors.items():
        tensor = torch.from_numpy(values.copy())
        parts = name.split(".")
        if parts[0] in top:
            ours[f"{top[parts[0]]}.{parts[1]}"] = tensor
        elif parts[0] == "blk":
            layer, what, kind = parts[1], parts[2], parts[3]
            if what in ("attn_q", "attn_k", "attn_v"):
                qkv.setdefault(f"blocks.{layer}.attn.qkv.{kind}", {})[what] = tensor
                continue
            mine = "ffn.fc" if what == "ffn_up" and arch == "gpt2" else \
                "ffn.up" if what == "ffn_up" else OUR_NAMES[what]
            ours[f"blocks.{layer}.{mine}.{kind}"] = tensor
    for name, parts in qkv.items():
        q, k = parts["attn_q"], parts["attn_k"]
        if arch == "llama":
            q = adjacent_pairs_undone(q, config.n_head)
            k = adjacent_pairs_undone(k, config.n_kv_head or config.n_head)
        ours[name] = torch.cat([q, k, parts["attn_v"]])
    return ours


def expected_tensors(model: GPT) -> dict[str, torch.Tensor]:
    state = {k: v.float() for k, v in model.state_dict().items()}
    if model.config.tie_weights:
        state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize("shape", SHAPES)
def test_f32_reads_back_as_the_models_weights_and_settings(shape: str, bpe: BPETokenizer,
                                                           tmp_path: Path) -> None:
    model = random_model(shape, bpe.vocab_size)
    config = model.config
    exported = write_gguf(model, bpe, tmp_path / "m.gguf")
    arch = ARCHITECTURE.get(shape, "llama")
    assert exported.architecture == arch and exported.dtype == "f32"
    reader, tensors = read_back(tmp_path / "m.gguf")
    assert {t for _, t in tensors.values()} == {gguf.GGMLQuantizationType.F32}
    factors = tensors.pop("rope_freqs.weight", None)
    found, expected = as_glassgpt(tensors, config, arch), expected_tensors(model)
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name
    assert exported.tensors == len(tensors) + (factors is not None)

    assert field(reader, "general.architecture") == arch
    assert field(reader, "general.file_type") == gguf.LlamaFileType.ALL_F32
    settings = {"context_length": config.block_size, "embedding_length": config.n_embd,
                "block_count": config.n_layer, "feed_forward_length": config.hidden_width,
                "vocab_size": config.vocab_size, "attention.head_count": config.n_head,
                "attention.head_count_kv": config.n_kv_head or config.n_head}
    for key, value in settings.items():
        assert field(reader, f"{arch}.{key}") == value, key
    eps = field(reader, f"{arch}.attention.layer_norm_{'' if arch == 'gpt2' else 'rms_'}epsilon")
    assert eps == pytest.approx(config.norm_eps)
    if arch == "gpt2":
        assert field(reader, "gpt2.rope.freq_base") is None
        return
    assert field(reader, f"{arch}.rope.freq_base") == config.rope_theta
    assert field(reader, f"{arch}.rope.dimension_count") == config.head_dim
    own_width = config.head_dim if config.q_width != config.n_embd else None
    assert field(reader, f"{arch}.attention.key_length") == own_width
    assert field(reader, f"{arch}.attention.value_length") == own_width
    scaled = field(reader, f"{arch}.rope.scaling.type")
    assert scaled == ("linear" if shape == "linear" else None)
    if shape == "linear":
        assert field(reader, f"{arch}.rope.scaling.factor") == config.rope_factor
    assert (factors is not None) == (shape == "llama3")
    if factors is not None:  # what llama.cpp divides each pair's angle by
        from glassgpt.rotary import RopeScaling, rotary_frequencies

        plain = rotary_frequencies(config.head_dim, config.rope_theta, None, torch.float64)
        scaled_freqs = rotary_frequencies(config.head_dim, config.rope_theta,
                                          RopeScaling.from_config(config), torch.float64)
        torch.testing.assert_close(torch.from_numpy(factors[0]).double(), plain / scaled_freqs)
        assert factors[0][1:].tolist() == [8.0] * (len(factors[0]) - 1)  # the slow pairs


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("shape", ["gpt2", "qwen3"])
def test_other_dtypes_round_as_the_format_does(shape: str, dtype: str, bpe: BPETokenizer,
                                                tmp_path: Path) -> None:
    model = random_model(shape, bpe.vocab_size)
    arch = ARCHITECTURE[shape]
    write_gguf(model, bpe, tmp_path / "m.gguf", dtype)
    reader, tensors = read_back(tmp_path / "m.gguf")
    file_types = {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
    assert field(reader, "general.file_type") == gguf.LlamaFileType[file_types[dtype]]
    qtype = gguf.GGMLQuantizationType[dtype.upper()]
    for name, (_, kind) in tensors.items():  # vectors and the position table stay f32
        kept = name.endswith(("norm.weight", ".bias")) or name == "position_embd.weight"
        assert kind == (gguf.GGMLQuantizationType.F32 if kept else qtype), name
    found, expected = as_glassgpt(tensors, model.config, arch), expected_tensors(model)
    for name, tensor in expected.items():
        if tensor.ndim == 1 or name == "pos_emb.weight":
            assert torch.equal(found[name], tensor), name
        elif dtype == "f16":
            assert torch.equal(found[name], tensor.half().float()), name
        elif dtype == "bf16":
            assert torch.equal(found[name], tensor.bfloat16().float()), name
        else:  # q8_0: each block of 32 in steps d = its largest value / 127, d kept in f16:
            blocks = tensor.reshape(-1, 32)  # half a step off, and 127 steps of d's rounding
            step = blocks.abs().amax(dim=1, keepdim=True) / 127
            error = (found[name].reshape(-1, 32) - blocks).abs()
            assert (error <= step * (0.5 + 127 * 2**-11)).all(), name


def test_q8_0_rows_off_its_block_are_f16_and_said(bpe: BPETokenizer, tmp_path: Path) -> None:
    model = random_model("llama", bpe.vocab_size, n_embd=16)  # rows of 16: no q8_0 block
    exported = write_gguf(model, bpe, tmp_path / "m.gguf", "q8_0")
    _, tensors = read_back(tmp_path / "m.gguf")
    assert tensors["blk.0.attn_q.weight"][1] == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.ffn_down.weight"][1] == gguf.GGMLQuantizationType.Q8_0  # rows of 96
    assert len(exported.notes) == 1 and "not a multiple of 32" in exported.notes[0]


@pytest.mark.parametrize(("dtype", "weight", "value", "limit"), [
    ("f16", "blocks.1.ffn.proj.weight", 1e9, "6.55e+04"),  # past f16's largest value
    ("q8_0", "blocks.1.ffn.proj.weight", 1e9, "8.32e+06"),  # a block scale is an f16
    ("q8_0", "blocks.0.attn.qkv.weight", 1e5, "6.55e+04"),  # rows of 16: the f16 fallback
])
def test_a_weight_past_what_the_dtype_holds_is_refused_not_written_infinite(
        dtype: str, weight: str, value: float, limit: str, bpe: BPETokenizer,
        tmp_path: Path) -> None:
    """A finite float32 weight past f16's range was written as infinity, which llama.cpp
    computes with, without a word."""
    model = random_model("llama", bpe.vocab_size, n_embd=16)
    with torch.no_grad():
        model.get_parameter(weight).view(-1)[3] = value
    with pytest.raises(CheckpointError) as refused:
        write_gguf(model, bpe, tmp_path / "m.gguf", dtype)
    assert f"holds {value:.3g}, more than {dtype} can hold (about {limit})" in str(refused.value)
    assert str(refused.value).endswith("export with --dtype f32")
    assert not (tmp_path / "m.gguf").exists()
    assert write_gguf(model, bpe, tmp_path / "m.gguf", "bf16").dtype == "bf16"  # bf16 holds it


# --- the vocabulary ----------------------------------------------------------------------------


def test_a_bpe_vocabulary_is_the_tokenizers_own(bpe: BPETokenizer, tmp_path: Path) -> None:
    model = random_model("gpt2", bpe.vocab_size)
    chat = ChatTemplate("{% for m in messages %}{{ m.content }}<|endoftext|>{% endfor %}",
                        "<|endoftext|>", {"eos_token": "<|endoftext|>"})
    exported = write_gguf(model, bpe, tmp_path / "m.gguf", chat=chat)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert field(reader, "tokenizer.ggml.tokens") == [bpe.tokenizer.id_to_token(i)
                                                       for i in range(bpe.vocab_size)]
    merges = json.loads(bpe.to_json())["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [" ".join(m) for m in merges]
    end = bpe.tokenizer.token_to_id("<|endoftext|>")
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[end] == gguf.TokenType.CONTROL and types.count(gguf.TokenType.NORMAL) == 299
    assert field(reader, "tokenizer.ggml.eos_token_id") == end
    assert field(reader, "tokenizer.ggml.bos_token_id") == end
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, "tokenizer.chat_template") == chat.template
    assert exported.vocabulary == "300 BPE tokens (pre-tokenizer gpt-2)"


def test_chat_and_begin_tokens_get_their_ids(bpe: BPETokenizer, tmp_path: Path) -> None:
    """An instruct tokenizer's end of turn and a Llama 3-like begin token: eot_token_id apart
    from eos_token_id, and add_bos_token where the tokenizer starts every text with one."""
    from tokenizers import processors

    tokenizer = BPETokenizer.from_json(bpe.to_json())
    tokenizer.tokenizer.add_special_tokens(["<|im_end|>", "<|begin|>"])
    tokenizer.tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", 301)])
    chat = ChatTemplate("{{ messages[0].content }}<|im_end|>", "<|im_end|>",
                        {"eos_token": "<|endoftext|>"})
    write_gguf(random_model("qwen3", 302), tokenizer, tmp_path / "m.gguf", chat=chat)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert field(reader, "tokenizer.ggml.eos_token_id") == bpe.tokenizer.token_to_id(
        "<|endoftext|>")
    assert field(reader, "tokenizer.ggml.eot_token_id") == 300
    assert field(reader, "tokenizer.ggml.bos_token_id") == 301
    assert field(reader, "tokenizer.ggml.add_bos_token") is True
    assert field(reader, "tokenizer.ggml.token_type")[300:] == [gguf.TokenType.CONTROL] * 2


def with_split(bpe: BPETokenizer, pre_tokenizer: dict[str, Any], **model: Any) -> BPETokenizer:
    """The same vocabulary and merges, split as another family splits text."""
    data = json.loads(bpe.to_json())
    data["pre_tokenizer"] = pre_tokenizer
    data["model"].update(model)
    return BPETokenizer.from_json(json.dumps(data))


def split_then_bytes(regex: str) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]}


def family_tokenizers(bpe: BPETokenizer) -> dict[str, BPETokenizer]:
    """llama.cpp's pre-tokenizer name -> a tokenizer that splits text as that family does."""
    from glassgpt.formats.gguf_vocab import LLAMA3_SPLIT, QWEN2_SPLIT

    digits = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}]}
    return {"gpt-2": bpe, "smollm": with_split(bpe, digits),
            "qwen2": with_split(bpe, split_then_bytes(QWEN2_SPLIT)),
            "llama-bpe": with_split(bpe, split_then_bytes(LLAMA3_SPLIT), ignore_merges=True)}


def test_each_split_gets_llama_cpps_name_and_others_are_refused(bpe: BPETokenizer,
                                                                tmp_path: Path) -> None:
    model = random_model("qwen3", bpe.vocab_size)
    for name, tokenizer in family_tokenizers(bpe).items():
        write_gguf(model, tokenizer, tmp_path / f"{name}.gguf")
        assert field(gguf.GGUFReader(tmp_path / f"{name}.gguf"), "tokenizer.ggml.pre") == name
    other = with_split(bpe, split_then_bytes(r"\s+|\S+"))
    with pytest.raises(TokenizerError, match="none that llama.cpp splits alike"):
        write_gguf(model, other, tmp_path / "other.gguf")
    assert not (tmp_path / "other.gguf").exists()


def test_a_char_vocabulary_is_written_as_rwkv_characters(tmp_path: Path) -> None:
    chars = CharTokenizer(sorted(set(TINY_TEXT + "\\\té")))
    model = random_model("gpt2", chars.vocab_size)
    exported = write_gguf(model, chars, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert field(reader, "tokenizer.ggml.model") == "rwkv"
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens[chars.stoi["\n"]] == "\\n" and tokens[chars.stoi["\\"]] == "\\\\"
    assert tokens[chars.stoi["\t"]] == "\\t" and tokens[chars.stoi["é"]] == "é"
    assert tokens[chars.stoi["a"]] == "a"
    assert field(reader, "tokenizer.ggml.eos_token_id") is None  # nothing ends a text
    assert exported.vocabulary.startswith(f"{chars.vocab_size} characters")


def test_no_tokenizer_writes_placeholders(tmp_path: Path) -> None:
    model = random_model("gpt2", 40)
    exported = write_gguf(model, None, tmp_path / "m.gguf")
    tokens = field(gguf.GGUFReader(tmp_path / "m.gguf"), "tokenizer.ggml.tokens")
    assert tokens == [f"<|id:{i}|>" for i in range(40)]
    assert exported.vocabulary == "40 placeholder tokens (no tokenizer)"


# --- llama.cpp runs it ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python runs the GGUF files")


def llama(llama_cpp: Any, path: Path, logits_all: bool = False) -> Any:
    """A llama.cpp context on `path`: one thread, float32 keys and values (GGML_TYPE_F32), and
    the weights as the file holds them (no AMX repacking of q8_0: the bench's
    `without_repacking`, which faults where the sandbox grants no AMX state)."""
    with without_repacking(llama_cpp):
        return llama_cpp.Llama(str(path), n_ctx=32, n_threads=1, verbose=False,
                               logits_all=logits_all, type_k=0, type_v=0)


def llama_logits(llama_cpp: Any, path: Path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits (T, V) of the file at `path` on `ids`."""
    llm = llama(llama_cpp, path, logits_all=True)
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:len(ids)]))
    finally:
        llm.close()


# llama.cpp's GELU reads a float16 table: GPT-2's logits move by about 1e-4.
LOGITS_ATOL = {"gpt2": 2e-3}


@pytest.mark.parametrize("shape", SHAPES)
def test_llama_cpp_computes_the_same_logits(shape: str, bpe: BPETokenizer, tmp_path: Path,
                                            llama_cpp: Any) -> None:
    model = random_model(shape, bpe.vocab_size)
    write_gguf(model, bpe, tmp_path / "m.gguf")
    ids = bpe.encode(TINY_TEXT)[:32]
    theirs = llama_logits(llama_cpp, tmp_path / "m.gguf", ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0]
    torch.testing.assert_close(theirs, ours, atol=LOGITS_ATOL.get(shape, 1e-5), rtol=0)


def trained(shape: str, tokenizer: BPETokenizer) -> GPT:
    """A random model of `shape` after 40 steps on TINY_TEXT: decisive enough that greedy
    decoding is no coin toss (checked by the test)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=2,
                          n_head=4, n_embd=32, **SHAPES[shape]))
    ids = torch.tensor(tokenizer.encode(TINY_TEXT))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):
        starts = torch.randint(0, len(ids) - 33, (8,))
        x = torch.stack([ids[s:s + 32] for s in starts])
        y = torch.stack([ids[s + 1:s + 33] for s in starts])
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.mark.parametrize("shape", ["gpt2", "qwen3"])
def test_llama_cpp_continues_a_prompt_with_our_greedy_tokens(shape: str, bpe: BPETokenizer,
                                                             tmp_path: Path,
                                                             llama_cpp: Any) -> None:
    model = trained(shape, bpe)
    write_gguf(model, bpe, tmp_path / "m.gguf")
    prompt = bpe.encode("To be or not")
    ours = generate(model, torch.tensor([prompt]), max_new_tokens=16,
                    temperature=0.0)[0].tolist()
    with torch.no_grad():
        top2 = model(torch.tensor([ours[:-1]]))[0][0, len(prompt) - 1:].topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 0.02  # every choice clear of llama.cpp's rounding
    llm = llama(llama_cpp, tmp_path / "m.gguf")
    try:
        theirs = []
        for token in llm.generate(prompt, temp=0.0, top_k=1):
            theirs.append(token)
            if len(theirs) == 16:
                break
    finally:
        llm.close()
    assert theirs == ours[len(prompt):]


def test_llama_cpp_tokenizes_text_to_our_ids(bpe: BPETokenizer, tmp_path: Path,
                                             llama_cpp: Any) -> None:
    model = random_model("qwen3", bpe.vocab_size)
    for name, tokenizer in family_tokenizers(bpe).items():
        write_gguf(model, tokenizer, tmp_path / f"{name}.gguf")
        llm = llama(llama_cpp, tmp_path / f"{name}.gguf")
        try:
            theirs = llm.tokenize(PROBE.encode(), add_bos=False, special=False)
            assert theirs == tokenizer.encode(PROBE), name
            assert llm.detokenize(theirs).decode() == PROBE, name
        finally:
            llm.close()
    chars = CharTokenizer(sorted(set(PROBE + "\\")))
    write_gguf(random_model("gpt2", chars.vocab_size), chars, tmp_path / "char.gguf")
    llm = llama(llama_cpp, tmp_path / "char.gguf")
    try:
        assert llm.token_eos() == -1  # a character run has no end-of-text: none stops it
        text = PROBE + "\\n"
        assert llm.tokenize(text.encode(), add_bos=False) == chars.encode(text)
        assert llm.detokenize(chars.encode(text)).decode() == text
    finally:
        llm.close()


def test_llama_cpp_runs_q8_0_close_to_the_model(bpe: BPETokenizer, tmp_path: Path,
                                                llama_cpp: Any) -> None:
    model = random_model("qwen3", bpe.vocab_size)
    write_gguf(model, bpe, tmp_path / "m.gguf", "q8_0")
    ids = bpe.encode(TINY_TEXT)[:16]
    theirs = llama_logits(llama_cpp, tmp_path / "m.gguf", ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0]
    assert (theirs - ours).abs().max() < 0.05 * ours.abs().max()


@pytest.mark.slow  # importing transformers: about 3 s
def test_transformers_reads_the_llama_reordering_back(bpe: BPETokenizer, tmp_path: Path) -> None:
    """A second reader of the format: transformers' GGUF loader undoes llama.cpp's q/k order
    itself, so the llama file (reordered) and the qwen2 file (not) give glassgpt's logits.
    (It reads neither GPT-2's context_length nor Qwen3's key_length, so those two are not
    asked of it.)"""
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor([bpe.encode(TINY_TEXT)[:32]])
    for shape in ("llama", "qwen2"):
        model = random_model(shape, bpe.vocab_size)
        write_gguf(model, bpe, tmp_path / f"{shape}.gguf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                               gguf_file=f"{shape}.gguf")
        with torch.no_grad():
            torch.testing.assert_close(hf.eval()(ids).logits, model(ids)[0], atol=1e-5,
                                       rtol=0)


# --- runs and the command line ---------------------------------------------------------------


@pytest.fixture()
def bpe_run(tmp_path: Path, bpe: BPETokenizer) -> Path:
    run = tmp_path / "run"
    save_model(run, random_model("llama", bpe.vocab_size), bpe)
    chat = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "<|endoftext|>")
    commit_files(run, {CHAT_TEMPLATE_FILE: chat.to_json().encode("utf-8")})
    return run


def test_convert_writes_one_file_with_the_runs_template(bpe_run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    code, err = glassgpt("convert", bpe_run, "--to-gguf", out, "--dtype", "q8_0",
                         capsys=capsys)
    assert code == 0, err
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]  # no temporary file left
    reader = gguf.GGUFReader(out)
    assert field(reader, "general.architecture") == "llama"
    assert field(reader, "general.name") == "run"
    assert field(reader, "tokenizer.chat_template").startswith("{% for m in messages %}")
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0


def test_the_command_line_says_what_it_wrote(bpe_run: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    from glassgpt.cli import main

    assert main(["convert", str(bpe_run), "--to-gguf", str(tmp_path / "m.gguf")]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"wrote {tmp_path / 'm.gguf'}: GGUF, llama architecture, "
                                   f"f32 matrices")
    assert len(captured.out.strip().splitlines()) == 1
    assert "exporting the last weights" in captured.err


def test_the_default_char_run_exports(tmp_path: Path) -> None:
    chars = CharTokenizer.from_text(TINY_TEXT)
    run = tmp_path / "run"
    save_model(run, GPT(GPTConfig(vocab_size=chars.vocab_size, block_size=16, n_layer=1,
                                  n_head=2, n_embd=16)), chars)
    exported = export_gguf(run, tmp_path / "m.gguf")
    assert exported.architecture == "gpt2" and exported.weights.startswith("the last weights")
    assert exported.bytes == (tmp_path / "m.gguf").stat().st_size


def test_an_existing_file_is_replaced_only_with_force(bpe_run: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "m.gguf"
    out.write_text("keep me")
    code, err = glassgpt("convert", bpe_run, "--to-gguf", out, capsys=capsys)
    assert code == 2 and "already exists; pass --force" in one_error_line(err)
    assert out.read_text() == "keep me"
    code, err = glassgpt("convert", bpe_run, "--to-gguf", out, "--force", capsys=capsys)
    assert code == 2 and "is not a GGUF file; --force replaces only a GGUF file" in \
        one_error_line(err)
    assert out.read_text() == "keep me"  # not ours: kept even with --force
    out.unlink()
    assert glassgpt("convert", bpe_run, "--to-gguf", out, capsys=capsys)[0] == 0
    code, err = glassgpt("convert", bpe_run, "--to-gguf", out, "--force", capsys=capsys)
    assert code == 0, err  # an earlier export is replaced
    assert out.read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("damage", ["notes", "cut_in_header", "cut_in_tensors"])
def test_force_keeps_a_file_that_only_starts_like_gguf(damage: str, bpe_run: Path,
                                                       tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """The magic bytes alone are no proof: a notes file that begins "GGUF" and an export cut
    short are kept, with one line that says why."""
    out = tmp_path / "m.gguf"
    if damage == "notes":
        out.write_bytes(b"GGUF export notes: which dtype to use, and why\n")
    else:
        whole = export_gguf(bpe_run, tmp_path / "whole.gguf")
        data = whole.out.read_bytes()
        out.write_bytes(data[:64] if damage == "cut_in_header" else data[:len(data) - 1000])
    before = out.read_bytes()
    code, err = glassgpt("convert", bpe_run, "--to-gguf", out, "--force", capsys=capsys)
    line = one_error_line(err)
    assert code == 2 and "is not a GGUF file" in line, err
    assert "gguf's reader cannot parse it" in line, err
    assert out.read_bytes() == before


@pytest.mark.parametrize(("args", "message"), [
    (["--to-gguf", "OUT", "--dtype", "q4_k"], "argument --dtype: invalid choice: 'q4_k'"),
    (["--to-hf", "OUT", "--dtype", "f16"], "--dtype applies to --to-gguf only"),
    (["--to-gguf", "OUT", "--to-hf", "OUT2"], "give one of --to-hf and --to-gguf, not both"),
    (["--to-gguf", "OUT", "--adapter"], "--adapter applies to --to-hf only"),
    (["--to-lens", "OUT", "--adapter"], "--adapter applies to --to-hf only"),  # was ignored
])
def test_flag_mistakes_are_one_line(args: list[str], message: str, bpe_run: Path,
                                    tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = [str(tmp_path / a) if a.startswith("OUT") else a for a in args]
    code, err = glassgpt("convert", bpe_run, *args, capsys=capsys)
    assert code == 2 and message in one_error_line(err)
    assert not any(p.name.startswith("OUT") for p in tmp_path.iterdir())


def test_a_missing_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = glassgpt("convert", tmp_path / "nowhere", "--to-gguf", tmp_path / "m.gguf",
                         capsys=capsys)
    assert code == 2 and "nowhere" in one_error_line(err)
    assert not (tmp_path / "m.gguf").exists()


def test_an_output_inside_the_run_is_refused(bpe_run: Path) -> None:
    with pytest.raises(CheckpointError, match="overlaps"):
        export_gguf(bpe_run, bpe_run / "m.gguf")


@pytest.mark.parametrize(("switches", "named"), [
    (dict(ROTARY, post_norms=True, norm_offset=True), "post_norms=True"),  # Gemma 2
    (dict(position="rope", norm="layernorm", activation="gelu"), "norm='layernorm'"),  # NeoX
    (dict(ROTARY, nope_layers=(1,)), "nope_layers=(1,)"),  # SmolLM3
    (dict(activation="gelu"), "activation='gelu'"),  # GPT-2 with an exact GELU
    (dict(ROTARY, logit_softcap=30.0), "logit_softcap=30.0"),
    (dict(ROTARY, sliding_window=8), "sliding_window=8"),
    (dict(ROTARY, qkv_bias=True, head_dim=16), "head_dim=16"),  # Qwen2 of wider heads
    (dict(ROTARY, qk_norm=True, rope_scaling="llama3", rope_factor=8.0,
          rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_context=8),
     "rope_scaling='llama3'"),
])
def test_what_llama_cpp_lacks_is_refused_by_name(switches: dict[str, Any], named: str,
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    config = GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=16,
                       **switches)
    run = tmp_path / "run"
    save_model(run, GPT(config), CharTokenizer.from_text("abcdefghijklmnopqrst"))
    code, err = glassgpt("convert", run, "--to-gguf", tmp_path / "m.gguf", capsys=capsys)
    assert code == 2 and named in one_error_line(err)
    assert not (tmp_path / "m.gguf").exists()


def test_an_unknown_dtype_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown GGUF dtype 'int4'"):
        export_gguf(tmp_path / "nowhere", tmp_path / "m.gguf", dtype="int4")


def test_a_full_disk_leaves_no_file(bpe: BPETokenizer, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "m.gguf"
    out.write_bytes(b"an earlier export")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", no_space)
    with pytest.raises(CheckpointError, match="No space left on device"):
        write_gguf(random_model("gpt2", bpe.vocab_size), bpe, out)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    assert out.read_bytes() == b"an earlier export"


def test_without_the_gguf_package_the_install_line_is_given(bpe: BPETokenizer, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'glassgpt\[gguf\]'"):
        write_gguf(random_model("gpt2", bpe.vocab_size), bpe, tmp_path / "m.gguf")
