"""Properties that must hold for any input, checked with hypothesis.

Tokenizers give back exactly the text they were given; every parser of a file or a table a user
(or a stranger) wrote either returns a valid object or raises one of glassgpt's own errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_gpt
from glassgpt.config import GPTConfig, TrainConfig
from glassgpt.errors import GlassGPTError
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import (
    TrainState,
    load_model,
    load_train_state,
    read_run_config,
    save_checkpoint,
    save_model,
)
from glassgpt.rundir.trainstate import capture_rng_state, restore_rng_state
from glassgpt.tokenizers import BPETokenizer, CharTokenizer, tokenizer_from_json
from glassgpt.training.optim import adamw_state_shapes, load_adamw_state, make_optimizer

FAST = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

# Any Unicode text a file can hold: every code point but the lone surrogates, which UTF-8
# cannot encode.
unicode_text = st.text(st.characters(blacklist_categories=("Cs",)))

# What json.loads can return. (No subnormal floats: a compiled kernel of an older torch may have
# set flush-to-zero for the whole process, and hypothesis refuses to draw them then.)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_subnormal=False)
    | st.text(max_size=10),
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
    save_model(run, tiny_gpt(vocab_size=8, block_size=8, n_layer=1, n_embd=8),
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


# --- every loader of a run directory: a GlassGPTError or success, nothing else ---------------
# The files of a resumable run are mutated (one JSON value replaced anywhere, a key dropped, a
# safetensors header rewritten, bytes flipped or cut) and then everything `train --resume` does
# with them runs: load the model, load and check the training state, hand it to AdamW and take
# a step (an unchecked moment of the wrong shape made the fused step segfault).

JSON_FILES = ["config.json", "train_state.json", "tokenizer.json", "checkpoint.journal"]
# Fewer examples than FAST: each one loads a model and steps AdamW (3,000 ran clean once).
RUN_FUZZ = settings(FAST, max_examples=40)
TENSOR_FILES = ["model.safetensors", "train_state.safetensors"]
replacements = (json_values | st.integers(-2**63, 2**63 - 1)
                | st.sampled_from([-1, 0, 1, 3, 10**9, 2**40, "", "x", [], {}, None]))


@st.composite
def mutated(draw, value: object) -> object:
    """`value` with one part replaced, or one key dropped, somewhere inside it."""
    if isinstance(value, dict) and value and draw(st.integers(0, 3)):
        key = draw(st.sampled_from(sorted(value)))
        if not draw(st.integers(0, 5)):
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: draw(mutated(value[key]))}
    if isinstance(value, list) and value and draw(st.integers(0, 3)):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], draw(mutated(value[i])), *value[i + 1:]]
    return draw(replacements)


@pytest.fixture(scope="module")
def resumable_run(tmp_path_factory) -> Path:
    """A run a trainer could resume: weights, a stepped AdamW's state, random states."""
    run = tmp_path_factory.mktemp("resumable")
    model = tiny_gpt(vocab_size=8, block_size=8, n_layer=1, n_embd=8)
    optimizer = make_optimizer(model, TrainConfig())
    take_a_step(model, optimizer)
    state = TrainState(iteration=1, best_val_loss=2.0, optimizer=optimizer.state_dict(),
                       rng=[capture_rng_state(torch.Generator().get_state())])
    save_checkpoint(run, model, CharTokenizer(list("abcdefgh")), TrainConfig().to_dict(), None,
                    state)
    (run / "checkpoint.journal").write_text("[]")  # an interrupted commit that named nothing
    return run


def take_a_step(model: GPT, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randint(0, model.config.vocab_size, (2, model.config.block_size))
    model(x, x)[1].backward()
    optimizer.step()


def resume_everything(run: Path) -> None:
    """What `train --resume` does with a run's files, short of training."""
    model, _ = load_model(run)
    optimizer = make_optimizer(model.train(), TrainConfig())
    state = load_train_state(run, adamw_state_shapes(optimizer))
    load_adamw_state(optimizer, state.optimizer, run)
    for rng in state.rng:
        restore_rng_state(rng)
    take_a_step(model, optimizer)


@contextlib.contextmanager
def copy_of(run: Path):
    """A scratch copy of the run; the global random states it may set are restored after."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "run"
        shutil.copytree(run, copy)
        try:
            yield copy
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            torch.set_rng_state(saved[2])


@RUN_FUZZ
@given(data=st.data())
def test_any_json_file_of_a_run_loads_or_raises_our_error(resumable_run, data):
    name = data.draw(st.sampled_from(JSON_FILES))
    original = json.loads((resumable_run / name).read_text())
    with copy_of(resumable_run) as run:
        (run / name).write_text(json.dumps(data.draw(mutated(original))))
        returns_or_raises_our_error(resume_everything, run)


def with_header(raw: bytes, header: object) -> bytes:
    """A safetensors file's bytes with its JSON header replaced (data kept)."""
    length = int.from_bytes(raw[:8], "little")
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + raw[8 + length:]


@RUN_FUZZ
@given(data=st.data())
def test_any_safetensors_file_of_a_run_loads_or_raises_our_error(resumable_run, data):
    name = data.draw(st.sampled_from(TENSOR_FILES))
    raw = (resumable_run / name).read_bytes()
    if data.draw(st.booleans()):
        length = int.from_bytes(raw[:8], "little")
        damaged = with_header(raw, data.draw(mutated(json.loads(raw[8:8 + length]))))
    else:
        flips = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1),
                                             st.integers(0, 255)), max_size=4))
        damaged = bytearray(raw)
        for position, byte in flips:
            damaged[position] = byte
        damaged = bytes(damaged[:data.draw(st.integers(0, len(raw)))])
    with copy_of(resumable_run) as run:
        (run / name).write_bytes(damaged)
        returns_or_raises_our_error(resume_everything, run)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A save_pretrained-style directory of a tiny GPT-2, written without transformers."""
    from safetensors.torch import save_file

    from glassgpt.formats.weight_mapping import weight_names

    path = tmp_path_factory.mktemp("hf")
    model = tiny_gpt(vocab_size=8, block_size=8, n_embd=8)
    ours = model.state_dict()
    save_file({theirs: (ours[name].t() if conv1d else ours[name]).contiguous()
               for name, theirs, conv1d in weight_names(2, True)}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "vocab_size": 8, "n_positions": 8, "n_embd": 8, "n_layer": 2,
         "n_head": 2, "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
         "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}))
    return path


@RUN_FUZZ
@given(data=st.data())
def test_any_hf_config_imports_or_raises_our_error(hf_dir, data):
    from glassgpt.formats.interop import from_hf

    original = json.loads((hf_dir / "config.json").read_text())
    with tempfile.TemporaryDirectory() as scratch:
        copy = shutil.copytree(hf_dir, Path(scratch) / "hf")
        (copy / "config.json").write_text(json.dumps(data.draw(mutated(original))))
        returns_or_raises_our_error(from_hf, copy)


TOML_PIECES = st.sampled_from(["[model]\n", "[train]\n", "[[model]]\n", "model = 5\n",
                               "train = 'x'\n", "n_layer = 2\n", "n_embd = 1e400\n",
                               "lr = nan\n", "dropout = 0.5\n", "a = [[[[1]]]]\n", "max_iters = ",
                               "99999999999999999999999\n", "= broken\n", "\x00", "é = 1\n"])


@FAST
@given(pieces=st.lists(TOML_PIECES, max_size=8), tail=st.text(max_size=20))
def test_any_config_file_reads_or_raises_our_error(tmp_path_factory, pieces, tail):
    """`train --config FILE`: any text is a settings table or one GlassGPTError, also once the
    settings meet the preset (wrong types, tables where values belong, numbers out of reach)."""
    from glassgpt.training.runs import read_config_file, resolve_configs

    path = tmp_path_factory.mktemp("toml") / "recipe.toml"
    path.write_text("".join(pieces) + tail, encoding="utf-8", errors="surrogatepass")
    returns_or_raises_our_error(read_config_file, path)
    returns_or_raises_our_error(
        lambda: GPTConfig.from_dict({**resolve_configs("cpu-small", path, {}, {})[0],
                                     "vocab_size": 65}))


@FAST
@given(values=st.dictionaries(st.sampled_from(["max_new_tokens", "temperature", "top_k", "top_p",
                                               "seed", "stop_token", "use_cache", "compiled",
                                               "engine"]), json_values, max_size=4))
def test_any_sampling_settings_are_valid_or_our_error(values):
    from glassgpt.config import SamplingConfig

    returns_or_raises_our_error(lambda: SamplingConfig(**values))


@FAST
@given(temperature=st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1e300,
                                                     exclude_min=True)),
       top_p=st.one_of(st.none(), st.floats(min_value=0.0, max_value=1.0, exclude_min=True)),
       top_k=st.one_of(st.none(), st.integers(min_value=1, max_value=2**40)),
       logits=st.lists(st.floats(min_value=-1e4, max_value=1e4), min_size=1, max_size=6))
def test_any_valid_sampling_settings_pick_a_token(temperature, top_p, top_k, logits):
    """Every setting SamplingConfig takes samples a token id from finite logits: a temperature
    or nucleus below float32's range (1e-300) made NaN and crashed torch's multinomial."""
    from glassgpt.decoding.generate import sample_next_token

    row = torch.tensor([logits])  # (1, V)
    token = sample_next_token(row, temperature, top_k, top_p, torch.Generator().manual_seed(0))
    assert token.shape == (1, 1) and 0 <= int(token) < len(logits)
    if temperature < 1e-38:  # greedy in effect (a huge one may tie the scaled logits instead)
        assert row[0, int(token)] == row.max()
