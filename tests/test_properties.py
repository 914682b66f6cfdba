"""Properties that must hold for any input, checked with hypothesis.

Tokenizers give back exactly the text they were given; every parser of a file or a table a user
(or a stranger) wrote either returns a valid object or raises one of glassgpt's own errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glassgpt.checkpoint import load_model, read_run_config, save_model
from glassgpt.config import GPTConfig
from glassgpt.errors import GlassGPTError
from glassgpt.model import GPT
from glassgpt.tokenizers import BPETokenizer, CharTokenizer, tokenizer_from_json
from glassgpt.train import TrainConfig

FAST = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

# Any Unicode text a file can hold: every code point but the lone surrogates, which UTF-8
# cannot encode.
unicode_text = st.text(st.characters(blacklist_categories=("Cs",)))

# What json.loads can return.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=12)


def tables_with_keys(keys: list[str]) -> st.SearchStrategy[dict]:
    """Tables whose keys are mostly the known ones, with values of any JSON type (and some
    plausible ones: small and huge integers, non-finite floats)."""
    values = (json_values | st.integers(-3, 300) | st.sampled_from([10**12, 2**63, -1, 0])
              | st.sampled_from([float("nan"), float("inf"), 0.5, 1e30]))
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=8), values, max_size=8)


MODEL_KEYS = [f.name for f in dataclasses.fields(GPTConfig)]
TRAIN_KEYS = [f.name for f in dataclasses.fields(TrainConfig)]


# --- tokenizers: decode(encode(text)) == text ----------------------------------------------

@FAST
@given(corpus=st.text(min_size=1), data=st.data())
def test_char_tokenizer_round_trip(corpus, data):
    tokenizer = CharTokenizer.from_text(corpus)
    text = data.draw(st.text(alphabet=sorted(set(corpus))))
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    reloaded = tokenizer_from_json(tokenizer.to_json())
    assert reloaded.encode(text) == ids


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = "".join(f"To be or not to be, line {i}: that is the question. Été, 東京!\n"
                     for i in range(50))
    return BPETokenizer.train(corpus, 300)


@FAST
@given(text=unicode_text)
def test_bpe_tokenizer_round_trip_for_any_unicode_text(bpe, text):
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text


# --- parsers raise only glassgpt's errors --------------------------------------------------

def returns_or_raises_our_error(parse, *args) -> None:
    with contextlib.suppress(GlassGPTError):
        parse(*args)


@FAST
@given(values=tables_with_keys(MODEL_KEYS) | json_values)
def test_model_config_parsing(values):
    returns_or_raises_our_error(GPTConfig.from_dict, values)


@FAST
@given(values=tables_with_keys(TRAIN_KEYS) | json_values)
def test_train_config_parsing(values):
    returns_or_raises_our_error(TrainConfig.from_dict, values)


@FAST
@given(text=st.text(max_size=60) | json_values.map(json.dumps)
       | st.fixed_dictionaries({"kind": st.just("char"), "chars": json_values}).map(json.dumps)
       | st.fixed_dictionaries({"model": json_values}).map(json.dumps))
def test_tokenizer_file_parsing(text):
    returns_or_raises_our_error(tokenizer_from_json, text)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    save_model(run, GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=8)),
               CharTokenizer(list("abcdefgh")))
    return run


@FAST
@given(model=tables_with_keys(MODEL_KEYS),
       extra=st.dictionaries(st.sampled_from(["train", "data_dir", "tokenizer", "extra",
                                              "format", "optimizer"]), json_values))
def test_run_config_loading(run_dir, model, extra):
    """A config.json of any content, next to real weights: loading a run (which builds the
    model when config and weights agree) returns or raises glassgpt's error, never more."""
    config = json.loads((run_dir / "config.json").read_text())
    config["model"] = {**config["model"], **model}
    with tempfile.TemporaryDirectory() as scratch:
        run = Path(scratch)
        for name in ("model.safetensors", "tokenizer.json"):
            (run / name).write_bytes((run_dir / name).read_bytes())
        (run / "config.json").write_text(json.dumps({**config, **extra}))
        returns_or_raises_our_error(read_run_config, run)
        returns_or_raises_our_error(load_model, run)
