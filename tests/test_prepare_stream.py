"""Streaming `prepare`: many files, pieces, workers, bounded memory, the same ids as one piece."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from glassgpt.cli import main
from glassgpt.data import PreparedData, pipeline, prepare
from glassgpt.data.pipeline import MIN_BUFFER_BYTES, text_pieces
from glassgpt.errors import DataError
from glassgpt.tokenizers import BPETokenizer, CharTokenizer

MiB = 2**20
# Characters that stress GPT-2's pre-tokenizer: runs of spaces before newlines, tabs, CR,
# contractions, digits, punctuation, accents.
TRICKY = ["a", "b", "é", " ", "  ", "\n", "\n\n", " \n", "\t", "\r\n", "'s", "'ll", "7", "42",
          ",", "!?", "東", "🙂", "<|endoftext|>"]


@pytest.fixture(scope="module")
def text(shakespeare_path) -> str:
    """200 KB of Shakespeare with tricky whitespace mixed in."""
    body = shakespeare_path.read_text(encoding="utf-8")[:200_000]
    rng = np.random.default_rng(0)
    extra = "".join(rng.choice(TRICKY) for _ in range(4000))
    return body[:100_000] + extra + body[100_000:]


@pytest.fixture(scope="module")
def bpe(text) -> BPETokenizer:
    return BPETokenizer.train(text, 400)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(TRICKY), max_size=80), st.integers(1, 12))
def test_pieces_are_cut_only_where_the_tokens_stay_the_same(bpe, parts, piece_chars):
    text = "".join(parts)
    blocks = [text[i:i + 5] for i in range(0, len(text), 5)]
    for cut in (bpe.safe_cut, CharTokenizer.from_text(text or "x").safe_cut):
        pieces = list(text_pieces(blocks, cut, piece_chars, "text"))
        assert "".join(pieces) == text
    pieces = list(text_pieces(blocks, bpe.safe_cut, piece_chars, "text"))
    assert sum((bpe.encode(p) for p in pieces), []) == bpe.encode(text)


def split_into_files(text: str, directory: Path, parts: int) -> list[Path]:
    """The text in `parts` files, cut at arbitrary places (even inside a word)."""
    directory.mkdir()
    bounds = np.linspace(0, len(text), parts + 1).astype(int)
    paths = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        paths.append(directory / f"part{i}.txt")
        paths[-1].write_text(text[start:end], encoding="utf-8", newline="")
    return paths


def assert_same_data(a: Path, b: Path) -> None:
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    for key in ("source", "files"):
        meta_a.pop(key), meta_b.pop(key)
    assert meta_a == meta_b


@pytest.fixture(scope="module")
def one_piece(text, tmp_path_factory) -> dict[str, Path]:
    """The reference: the text in one file, char and BPE, read with a large buffer."""
    root = tmp_path_factory.mktemp("one_piece")
    (root / "text.txt").write_text(text, encoding="utf-8", newline="")
    prepare(root / "char", root / "text.txt", buffer_bytes=64 * MiB)
    prepare(root / "bpe", root / "text.txt", "bpe", 400, buffer_bytes=64 * MiB)
    return {"text": root / "text.txt", "char": root / "char", "bpe": root / "bpe"}


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_many_files_in_small_pieces_give_the_data_of_one_piece(kind, text, one_piece, tmp_path):
    split_into_files(text, tmp_path / "parts", 7)
    meta = prepare(tmp_path / "data", str(tmp_path / "parts" / "part*.txt"), kind,
                   400 if kind == "bpe" else None,
                   buffer_bytes=MIN_BUFFER_BYTES)  # pieces of 4 KiB: about 50 of them
    assert meta["files"] == 7
    assert_same_data(tmp_path / "data", one_piece[kind])


def test_worker_processes_give_the_same_ids(one_piece, tmp_path):
    prepare(tmp_path / "data", one_piece["text"], tokenizer_file=one_piece["bpe"] /
            "tokenizer.json", workers=2, buffer_bytes=MIN_BUFFER_BYTES)
    assert_same_data(tmp_path / "data", one_piece["bpe"])


PEAK_RSS = """
import json, resource, sys
from glassgpt.data import prepare
def peak():  # bytes on Linux (ru_maxrss is in KiB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out, text, kind, tokenizer_file, buffer = sys.argv[1:]
before = peak()
prepare(out, text, kind, tokenizer_file=tokenizer_file or None, buffer_bytes=int(buffer))
print(json.dumps({"growth": peak() - before}))
"""


def test_peak_memory_is_bounded_by_the_buffer_not_the_corpus(shakespeare_path, one_piece,
                                                             tmp_path):
    """Peak RSS of processes preparing corpora several times larger than their buffer.

    Stated bounds (the growth of peak RSS during `prepare`):
      char, 1 MiB buffer, 8.5 MiB corpus: at most 4 MiB (measured about 1.3 MiB), less than
        half the corpus, which takes twice its size in memory for its bytes and text alone.
      BPE (a given tokenizer), 64 KiB buffer, 6.4 x that: at most 4 buffers + 16 MiB for the
        tokenizers library's own tables (measured about 6 MiB); encoding the corpus whole
        takes about 200 bytes per character, 80 MiB.
    """
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(shakespeare_path.read_bytes() * 8)
    bpe_corpus = tmp_path / "bpe_corpus.txt"
    bpe_corpus.write_bytes(one_piece["text"].read_bytes() * 2)
    runs = {"char": [tmp_path / "char", corpus, "char", "", MiB],
            "bpe": [tmp_path / "bpe", bpe_corpus, "bpe", one_piece["bpe"] / "tokenizer.json",
                    MIN_BUFFER_BYTES]}
    processes = {kind: subprocess.Popen([sys.executable, "-c", PEAK_RSS, *map(str, argv)],
                                        stdout=subprocess.PIPE, text=True)
                 for kind, argv in runs.items()}
    growth = {}
    for kind, process in processes.items():
        stdout, _ = process.communicate(timeout=300)
        assert process.returncode == 0
        growth[kind] = json.loads(stdout)["growth"]
    assert growth["char"] <= 4 * MiB < corpus.stat().st_size / 2, growth
    assert growth["bpe"] <= 4 * MIN_BUFFER_BYTES + 16 * MiB, growth
    # ... and the results are those of encoding each text whole.
    text = corpus.read_text(encoding="utf-8")
    ids = np.concatenate([PreparedData(tmp_path / "char").splits[s] for s in ("train", "val")])
    assert np.array_equal(ids, CharTokenizer.from_text(text).encode_array(text, ids.dtype))
    bpe = PreparedData(tmp_path / "bpe")
    ids = np.concatenate([bpe.splits["train"], bpe.splits["val"]]).tolist()
    assert ids == bpe.tokenizer.encode(bpe_corpus.read_bytes().decode("utf-8"))  # CR LF kept


def large_vocabulary_tokenizer(path: Path) -> None:
    """A byte-level BPE of 70,260 tokens whose merge "ab" has an id beyond 65,535."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(alphabet)}
    vocab.update({f"<unused{i}>": 256 + i for i in range(70_000)})
    vocab["ab"] = 70_256
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path.write_text(tok.to_str(), encoding="utf-8")


def test_ids_become_uint32_when_the_vocabulary_needs_it(tmp_path):
    large_vocabulary_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "text.txt").write_text("abc cab ab\n" * 50, encoding="utf-8")
    meta = prepare(tmp_path / "data", tmp_path / "text.txt",
                   tokenizer_file=tmp_path / "tokenizer.json")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_257
    data = PreparedData(tmp_path / "data")
    assert data.splits["train"].dtype == np.uint32
    assert data.splits["train"][0] == 70_256  # "ab", stored whole
    ids = np.concatenate([data.splits["train"], data.splits["val"]]).tolist()
    assert data.tokenizer.decode(ids) == "abc cab ab\n" * 50


def test_the_command_line_takes_files_patterns_workers_and_a_buffer(tmp_path, capsys, text):
    split_into_files(text[:20_000], tmp_path / "docs", 3)
    (tmp_path / "intro.txt").write_text("Preface.\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["prepare", "--text", str(tmp_path / "intro.txt"), str(tmp_path / "docs" / "*"),
                 "--buffer-mb", "0.0625", "--out", str(tmp_path / "data")]) == 0
    assert "from 4 files" in capsys.readouterr().out
    data = PreparedData(tmp_path / "data")
    ids = np.concatenate([data.splits["train"], data.splits["val"]]).tolist()
    assert data.tokenizer.decode(ids) == "Preface.\n" + text[:20_000]
    assert data.meta["source"] == [str(tmp_path / "intro.txt"), str(tmp_path / "docs" / "*")]


def test_gpt2_style_vocab_and_merges_on_the_command_line(tmp_path, capsys):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {**{s: i for i, s in enumerate(alphabet)}, "Ġt": 256, "he": 257, "Ġthe": 258,
             "<|endoftext|>": 259}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ t\nh e\nĠt he\n", encoding="utf-8")
    (tmp_path / "text.txt").write_text("to the sea, then the end\n" * 20, encoding="utf-8")
    assert main(["prepare", "--text", str(tmp_path / "text.txt"), "--tokenizer-file",
                 str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), "--out",
                 str(tmp_path / "data")]) == 0
    data = PreparedData(tmp_path / "data")
    assert data.meta["tokenizer"] == "bpe" and data.vocab_size == 260
    assert 258 in data.splits["train"]  # " the" is one token


def test_a_tokenizer_that_never_splits_is_not_cut(bpe, monkeypatch):
    """Without a pre-tokenizer a text is one word: no cut is safe, so a short text stays whole
    and a long one is refused rather than tokenized differently."""
    whole = BPETokenizer.train("hello world\n" * 50, 300)
    whole.tokenizer.pre_tokenizer = None
    text = "hello world\n" * 100
    assert whole.safe_cut(text) is None and bpe.safe_cut(text) == len(text) - 7
    blocks = [text[i:i + 100] for i in range(0, len(text), 100)]
    assert list(text_pieces(blocks, whole.safe_cut, 50, "text")) == [text]
    monkeypatch.setattr(pipeline, "MAX_UNCUT_CHARS", 500)
    with pytest.raises(DataError, match="found no place to cut"):
        list(text_pieces(blocks, whole.safe_cut, 50, "text"))
