"""Tokenizers: exact round trips, clear errors, JSON files only, GPT-2's files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from glassgpt.errors import TokenizerError
from glassgpt.tokenizers import (
    BPETokenizer,
    CharTokenizer,
    bpe,
    load_tokenizer,
    load_tokenizer_files,
    tokenizer_from_json,
    train_tokenizer,
)

CORPUS = "".join(f"To be, or not to be: that is the question {i}.\n" for i in range(300))
BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
# A tiny GPT-2 style vocabulary: the 256 byte symbols, three merges, the end-of-text token.
GPT2_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
GPT2_VOCAB = {**{s: i for i, s in enumerate(BYTES)}, "Ġt": 256, "he": 257, "Ġthe": 258,
              "<|endoftext|>": 259}


@pytest.fixture(scope="module")
def bpe_tok() -> BPETokenizer:
    return BPETokenizer.train(CORPUS, vocab_size=300)


def test_char_tokenizer_ids_follow_sorted_characters():
    tok = CharTokenizer.from_text("hello")
    assert tok.chars == ["e", "h", "l", "o"]
    assert tok.encode("hole") == [1, 3, 2, 0]
    assert tok.decode([1, 3, 2, 0]) == "hole"
    assert tok.vocab_size == 4 and tok.kind == "char"


@given(st.text(alphabet="abc \n,.!é", max_size=60))
def test_char_round_trip_and_array_encoding_agree(text):
    tok = CharTokenizer(list("é,c b!a\n."))  # not sorted: ids are list positions
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_array(text, np.dtype(np.uint16)).tolist() == tok.encode(text)


def test_char_unknown_characters_are_named():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(TokenizerError, match="'x', 'z'"):
        tok.encode("axbz")
    with pytest.raises(TokenizerError, match="'x', 'z'"):
        tok.encode_array("axbz", np.dtype(np.uint16))
    with pytest.raises(TokenizerError, match="not in the tokenizer's vocabulary"):
        tok.encode("a\udcff")  # a non-UTF-8 byte from a command line


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=80))
def test_bpe_round_trip_on_any_text(bpe_tok, text):
    assert bpe_tok.decode(bpe_tok.encode(text)) == text


def test_bpe_round_trips_unicode_and_whitespace(bpe_tok):
    text = "  two  spaces\n\n\ttab, émoji 🙂, 中文, trailing space "
    assert bpe_tok.decode(bpe_tok.encode(text)) == text
    assert bpe_tok.vocab_size == 300
    # Merges were learned: a frequent word is shorter in tokens than in bytes.
    assert len(bpe_tok.encode(" question")) < len(b" question")


def test_bpe_vocab_too_small_is_an_error():
    with pytest.raises(TokenizerError, match="at least 257"):
        train_tokenizer("bpe", CORPUS, 100)


@pytest.mark.parametrize("vocab_size", [10**8, 10**9, 2**20 + 1])
def test_huge_bpe_vocabularies_are_refused_before_training(vocab_size):
    """10**9 used to abort the process (out of memory in Rust); 10**8 reserved 7 GB."""
    with pytest.raises(TokenizerError, match="at most 1,048,576"):
        train_tokenizer("bpe", CORPUS, vocab_size)


def test_bpe_vocabulary_bounded_by_free_memory(monkeypatch):
    monkeypatch.setattr(bpe, "available_memory", lambda: 50 * 2**20)
    with pytest.raises(TokenizerError, match="takes about 69 MiB, and only 50 MiB"):
        train_tokenizer("bpe", CORPUS, 1_000_000)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_and_load_give_the_same_tokenizer(tmp_path, kind):
    tok = train_tokenizer(kind, CORPUS, 300)
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    json.loads(path.read_text(encoding="utf-8"))  # a JSON file, not a pickle
    loaded = load_tokenizer(path)
    assert loaded.kind == kind and loaded.vocab_size == tok.vocab_size
    assert loaded.encode(CORPUS[:200]) == tok.encode(CORPUS[:200])


def gpt2_like() -> HFTokenizer:
    tok = HFTokenizer(models.BPE(vocab=GPT2_VOCAB, merges=GPT2_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def test_gpt2_vocab_and_merges_make_the_same_tokenizer_as_its_tokenizer_json(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps(GPT2_VOCAB), encoding="utf-8")
    merges.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in GPT2_MERGES),
                      encoding="utf-8")
    from_files = load_tokenizer_files([vocab, merges])
    from_dir = load_tokenizer_files(tmp_path)  # a directory with vocab.json + merges.txt
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "tokenizer.json").write_text(gpt2_like().to_str(), encoding="utf-8")
    from_json = load_tokenizer_files(tmp_path / "json")
    text = "the cat<|endoftext|> then the end"
    ids = from_files.encode(text)
    assert ids[:2] == [GPT2_VOCAB["t"], GPT2_VOCAB["he"]] and 258 in ids  # merges applied
    assert 259 in ids  # the end-of-text token keeps its id
    assert from_dir.encode(text) == from_json.encode(text) == ids
    assert from_files.decode(ids) == text and from_files.vocab_size == 260


@pytest.mark.parametrize("merges, message", [
    ("Ġ t\nx y z\n", "line 2: a merge is two tokens"),
    ("Ġ zz\n", "do not make a BPE tokenizer"),
])
def test_bad_merges_files(tmp_path, merges, message):
    (tmp_path / "vocab.json").write_text(json.dumps(GPT2_VOCAB), encoding="utf-8")
    (tmp_path / "merges.txt").write_text(merges, encoding="utf-8")
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer_files(tmp_path)


def test_a_vocab_json_with_non_integer_ids(tmp_path):
    (tmp_path / "vocab.json").write_text('{"a": "zero"}', encoding="utf-8")
    (tmp_path / "merges.txt").write_text("", encoding="utf-8")
    with pytest.raises(TokenizerError, match="maps tokens to ids"):
        load_tokenizer_files([tmp_path / "vocab.json", tmp_path / "merges.txt"])


def test_a_bpe_that_cannot_give_text_back_is_refused_when_loaded(tmp_path):
    """A Split-regex pre-tokenizer without byte-level mapping drops what it cannot spell:
    refused at load time, not discovered mid-sample."""
    data = json.loads(gpt2_like().to_str())
    data["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "\\s+"},
                             "behavior": "Isolated", "invert": False}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerError, match="does not give text back unchanged"):
        load_tokenizer(path)


def test_a_panic_inside_the_tokenizers_library_is_one_error(bpe_tok):
    class PanicException(BaseException):  # the name pyo3 gives Rust panics
        pass

    class Panicking:
        def encode(self, *args, **kwargs):
            raise PanicException("NormalizedString bad split")

        def get_vocab_size(self):
            return 300

    with pytest.raises(TokenizerError, match="bad split"):
        BPETokenizer(Panicking()).encode("text")


def test_text_that_is_not_unicode_is_an_error_for_bpe(bpe_tok):
    with pytest.raises(TokenizerError, match="lone surrogate"):
        bpe_tok.encode("caf\udce9")  # what Python makes of the byte 0xE9 in argv


@pytest.mark.parametrize("content, message", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"kind": "char", "chars": ["a", "a"]}', "duplicate"),
    ('{"kind": "char", "chars": ["ab"]}', "single characters"),
    ('{"kind": "char", "chars": ["a", "\\ud800"]}', "lone surrogates"),
    ('{"kind": "char", "chars": ["a"], "extra": 1}', "unknown keys"),
    ('{"kind": "word"}', "neither"),
    ('{"model": {"type": "WordPiece"}}', "byte-level BPE"),
    ('{"model": {"type": "BPE", "vocab": 3}}', "not a valid Hugging Face"),
    ('{"kind": "char", "chars": ["a"], "n": NaN}', "not a number JSON allows"),
])
def test_invalid_tokenizer_files_are_errors_naming_the_file(tmp_path, content, message):
    path = tmp_path / "tokenizer.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TokenizerError, match=message) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(TokenizerError, match="holds neither"):
        load_tokenizer_files(tmp_path)


def test_unknown_kind():
    with pytest.raises(TokenizerError, match="unknown tokenizer kind"):
        train_tokenizer("word", CORPUS)


@pytest.mark.parametrize("ids", [[5], [-1], [2**40], ["a"]])
def test_decode_out_of_range_ids(bpe_tok, ids):
    """-1 used to wrap around to the last character."""
    with pytest.raises(TokenizerError, match="outside|integers"):
        CharTokenizer.from_text("ab").decode(ids)
    if ids != [5]:
        with pytest.raises(TokenizerError, match="outside|integers"):
            bpe_tok.decode(ids)


def test_token_byte_lengths_add_up_to_the_text_bytes(bpe_tok):
    text = "Été à 東京 🙂, to be or not.<|endoftext|>\n"
    for tok in (bpe_tok, CharTokenizer.from_text(text)):
        lengths = tok.token_byte_lengths()
        assert len(lengths) == tok.vocab_size
        assert sum(lengths[i] for i in tok.encode(text)) == len(text.encode("utf-8"))


def test_tokenizer_from_json_is_bounded_like_every_file():
    with pytest.raises(TokenizerError, match="does not fit in 64 bits"):
        tokenizer_from_json('{"kind": "char", "chars": ["a"], "x": ' + "9" * 30 + "}")


def test_tokenizers_are_compared_by_what_they_do_not_by_their_json():
    """A tokenizer.json that another tool rewrote (transformers adds a ByteLevel
    post-processor that changes no encoding) is the same tokenizer; another vocabulary is not."""
    import json as json_module

    from glassgpt.tokenizers import BPETokenizer, CharTokenizer, same_tokenizer

    text = "To be or not to be, that is the question.\n" * 30
    bpe = BPETokenizer.train(text, 300)
    data = json_module.loads(bpe.to_json())
    data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets":
                              False, "use_regex": True}
    rewritten = BPETokenizer.from_json(json_module.dumps(data))
    assert rewritten.to_json() != bpe.to_json()
    assert same_tokenizer(bpe, rewritten)
    assert not same_tokenizer(bpe, BPETokenizer.train(text, 280))
    assert same_tokenizer(CharTokenizer(list("abc")), CharTokenizer(list("abc")))
    assert not same_tokenizer(CharTokenizer(list("abc")), CharTokenizer(list("abd")))
    assert not same_tokenizer(CharTokenizer(list("abc")), bpe)
