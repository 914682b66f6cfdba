"""Tokenizers: exact round trips, clear errors, JSON files only."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from glassgpt.errors import TokenizerError
from glassgpt.tokenizers import (
    BPETokenizer,
    CharTokenizer,
    load_tokenizer,
    train_tokenizer,
)

CORPUS = "".join(f"To be, or not to be: that is the question {i}.\n" for i in range(300))


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(CORPUS, vocab_size=300)


def test_char_tokenizer_ids_follow_sorted_characters():
    tok = CharTokenizer.from_text("hello")
    assert tok.chars == ["e", "h", "l", "o"]
    assert tok.encode("hole") == [1, 3, 2, 0]
    assert tok.decode([1, 3, 2, 0]) == "hole"
    assert tok.vocab_size == 4 and tok.kind == "char"


@given(st.text(alphabet="abc \n,.!", max_size=60))
def test_char_round_trip(text):
    tok = CharTokenizer.from_text("abc \n,.!")
    assert tok.decode(tok.encode(text)) == text


def test_char_unknown_characters_are_named():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(TokenizerError, match="'xz'"):
        tok.encode("axbz")


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=80))
def test_bpe_round_trip_on_any_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_round_trips_unicode_and_whitespace(bpe):
    text = "  two  spaces\n\n\ttab, émoji 🙂, 中文, trailing space "
    assert bpe.decode(bpe.encode(text)) == text
    assert bpe.vocab_size == 300
    # Merges were learned: a frequent word is shorter in tokens than in bytes.
    assert len(bpe.encode(" question")) < len(b" question")


def test_bpe_vocab_too_small_is_an_error():
    with pytest.raises(TokenizerError, match="at least 257"):
        train_tokenizer("bpe", CORPUS, 100)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_and_load_give_the_same_tokenizer(tmp_path, kind):
    tok = train_tokenizer(kind, CORPUS, 300)
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    json.loads(path.read_text(encoding="utf-8"))  # a JSON file, not a pickle
    loaded = load_tokenizer(path)
    assert loaded.kind == kind and loaded.vocab_size == tok.vocab_size
    assert loaded.encode(CORPUS[:200]) == tok.encode(CORPUS[:200])


def test_bpe_wraps_a_foreign_tokenizer_json(tmp_path):
    """A byte-level tokenizer.json from elsewhere (GPT-2's layout) loads as a BPE tokenizer."""
    foreign = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    foreign.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    foreign.decoder = decoders.ByteLevel()
    path = tmp_path / "tokenizer.json"
    path.write_text(foreign.to_str(), encoding="utf-8")
    tok = load_tokenizer(path)
    assert isinstance(tok, BPETokenizer)
    assert tok.encode("abab") == [2, 2] and tok.decode([2, 0]) == "aba"


@pytest.mark.parametrize("content, message", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"kind": "char", "chars": ["a", "a"]}', "duplicate"),
    ('{"kind": "char", "chars": ["ab"]}', "single characters"),
    ('{"kind": "char", "chars": ["a"], "extra": 1}', "unknown keys"),
    ('{"kind": "word"}', "neither"),
    ('{"model": {"type": "WordPiece"}}', "byte-level BPE"),
    ('{"model": {"type": "BPE", "vocab": 3}}', "not a valid Hugging Face"),
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


def test_unknown_kind():
    with pytest.raises(TokenizerError, match="unknown tokenizer kind"):
        train_tokenizer("word", CORPUS)


def test_decode_out_of_range_ids(bpe):
    with pytest.raises(TokenizerError, match="outside"):
        CharTokenizer.from_text("ab").decode([5])
    with pytest.raises(TokenizerError, match="outside"):
        bpe.decode([10_000])
