"""Every user mistake and every damaged or hostile file, through the command line.

Each row must end with exit code 2, exactly one `error:` line on stderr that names the problem and
the offending value, no traceback, and not one byte changed in or around the run directory. One
tiny run is trained once for the module; each row damages its own copy. Rows named in
THROUGH_A_PROCESS run as `python -m glassgpt` processes (a few at a time, before the tests check
them); the rest call the same entry point, `glassgpt.cli.main`, in-process.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import TINY_TRAIN_FLAGS, cli_environment
from glassgpt.cli import main
from glassgpt.data import prepare
from glassgpt.errors import GlassGPTError
from glassgpt.rundir.checkpoint import load_model, load_train_state
from helpers_dirs import Snapshot, assert_unchanged, snapshot

TINY = TINY_TRAIN_FLAGS  # the shape of the session's trained run
PARALLEL_PROCESSES = 4


@dataclass(frozen=True)
class Where:
    """The paths a row may use: its own copy of the run, shared data, a scratch directory."""

    run: Path
    data: Path  # char tokenizer, the data the run was trained on
    bpe_data: Path  # the same text, BPE tokenizer
    text: Path  # the text both were prepared from
    work: Path


@dataclass(frozen=True)
class Case:
    argv: Callable[[Where], list]
    message: str  # must appear in the one line on stderr
    damage: Callable[[Path], None] | None = None  # edits the row's copy of the run first
    succeeds: bool = False


def write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def edit_json(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    """A damage that rewrites one JSON file of the run through `change(data)`."""
    def damage(run: Path) -> None:
        data = json.loads((run / name).read_text())
        replaced = change(data)
        (run / name).write_text(json.dumps(data if replaced is None else replaced))
    return damage


def edit_model(**values: object) -> Callable[[Path], None]:
    return edit_json("config.json", lambda c: c["model"].update(values))


def truncate_weights(run: Path, name: str = "model.safetensors") -> None:
    path = run / name
    path.write_bytes(path.read_bytes()[:1000])


def pickle_as_weights(run: Path) -> None:
    write(run / "model.safetensors", pickle.dumps({"tok_emb.weight": [0.0] * 16}))


def nanogpt_layout(run: Path) -> None:
    """A nanoGPT out dir: one pickled ckpt.pt instead of config, weights and tokenizer."""
    for name in ("config.json", "model.safetensors"):
        (run / name).unlink()
    write(run / "ckpt.pt", pickle.dumps({"model": {}}))


def hostile_journal(run: Path) -> None:
    """A journal that would rename a file outside the run directory while recovering."""
    write(run.parent / "victim.pending", "x")
    write(run / "checkpoint.journal", json.dumps(["../victim"]))


def huge_tokenizer_file(run: Path) -> None:
    """65 MiB (sparse: costs no disk) behind a valid JSON start."""
    with open(run / "tokenizer.json", "r+b") as file:
        file.truncate(65 * 2**20)


def shorten_sampler_state(run: Path) -> None:
    """A batch-sampler random state cut short (a generator state has a fixed size)."""
    from safetensors.torch import load_file, save_file

    path = run / "train_state.safetensors"
    tensors = load_file(path)
    tensors["rng.0.sampler"] = tensors["rng.0.sampler"][:10].clone()
    save_file(tensors, path)


DEEP_JSON = "[" * 100_000 + "]" * 100_000


def deep_json(name: str) -> Callable[[Path], None]:
    """A damage that nests the file's JSON 100,000 deep (a recursive parser's end)."""
    return lambda run: write(run / name, DEEP_JSON) and None


def edit_tensors(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    """A damage that rewrites one safetensors file of the run through `change(tensors)`."""
    def damage(run: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(run / name)
        change(tensors)
        save_file(tensors, run / name)
    return damage


def set_first(name: str, value: float) -> Callable[[dict], None]:
    return lambda tensors: tensors[name].view(-1).__setitem__(0, value)


def sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A float32 safetensors file of these shapes whose data is a hole (costs no disk)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        file.truncate(8 + len(text) + offset)


def header_shapes(run: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(run / "model.safetensors", "pt") as file:
        return {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}  # noqa: SIM118


def weights_promising_64_gib(run: Path) -> None:
    """tok_emb.weight described as (2**30, 16): 64 GiB, in a sparse file that size."""
    sparse_safetensors(run / "model.safetensors",
                       {**header_shapes(run), "tok_emb.weight": (2**30, 16)})


def config_and_weights_of_1_tib(run: Path) -> None:
    """config.json and the weights agree on a 2**34-token vocabulary: 1 TiB of float32."""
    sparse_safetensors(run / "model.safetensors",
                       {**header_shapes(run), "tok_emb.weight": (2**34, 16)})
    edit_model(vocab_size=2**34)(run)


def pad_weights_to_64_gib(run: Path) -> None:
    with open(run / "model.safetensors", "r+b") as file:
        file.truncate(64 * 2**30)


def journal_naming(*names: str) -> Callable[[Path], None]:
    return lambda run: write(run / "checkpoint.journal", json.dumps(list(names))) and None


def pending_link_the_journal_names(run: Path) -> None:
    """A committed-looking journal whose model.safetensors.pending links outside the run."""
    outside = run.parent / "outside"
    outside.mkdir()
    write(outside / "secret.safetensors", (run / "model.safetensors").read_bytes())
    (run / "model.safetensors.pending").symlink_to(outside / "secret.safetensors")
    journal_naming("model.safetensors")(run)


def pending_directory(run: Path) -> None:
    (run / "model.safetensors.pending").mkdir()


def fresh_out_with_a_dangling_metrics_link(run: Path) -> None:
    """A new --out whose metrics.jsonl links to a file (not there yet) outside it."""
    (run.parent / "outside").mkdir()
    (run.parent / "fresh").mkdir()
    (run.parent / "fresh" / "metrics.jsonl").symlink_to(run.parent / "outside" / "m.jsonl")


def lock_file_link(run: Path) -> None:
    (run.parent / "outside").mkdir()
    (run / ".glassgpt.lock").unlink(missing_ok=True)
    (run / ".glassgpt.lock").symlink_to(run.parent / "outside" / "lock")


def data_with_bad_meta(w: Where) -> Path:
    """A copy of the data whose meta.json names an id type glassgpt never writes."""
    data = shutil.copytree(w.data, w.work / "data")
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "dtype": "float64"}))
    return data


def sample(*extra: str, checkpoint: str = "last") -> Callable[[Where], list]:
    """`sample` of the run; its last weights by default here, the file most rows damage."""
    return lambda w: ["sample", w.run, "--max-new-tokens", "3", "--device", "cpu",
                      "--checkpoint", checkpoint, *extra]


def train(*extra: object) -> Callable[[Where], list]:
    return lambda w: ["train", "--data", w.data, "--out", w.work / "new", *TINY,
                      *[e(w) if callable(e) else e for e in extra]]


def resume(*extra: object) -> Callable[[Where], list]:
    return lambda w: ["train", "--resume", "--out", w.run, "--max-iters", "6",
                      *[e(w) if callable(e) else e for e in extra]]


CASES: dict[str, Case] = {
    # --- text to prepare
    "missing text": Case(lambda w: ["prepare", "--text", w.work / "nope.txt", "--out", w.work],
                         "not found: " + "{work}/nope.txt"),
    "empty text": Case(lambda w: ["prepare", "--text", write(w.work / "e.txt", ""), "--out",
                                  w.work], "e.txt is empty"),
    "blank text": Case(lambda w: ["prepare", "--text", write(w.work / "b.txt", " \n\t\n"),
                                  "--out", w.work], "b.txt is empty"),
    "binary text": Case(lambda w: ["prepare", "--text", write(w.work / "x.png",
                                                               b"\x89PNG\r\n\x1a\n\x00\xff"),
                                   "--out", w.work], "x.png is not UTF-8 text (byte 0: b'\\x89')"),
    "too-short text": Case(lambda w: ["prepare", "--text", write(w.work / "s.txt", "ab"),
                                      "--out", w.work], "too short to split: 2 tokens"),
    "unknown tokenizer": Case(lambda w: ["prepare", "--tokenizer", "wordpiece", "--out", w.work],
                              "'wordpiece'"),
    "BPE vocabulary too small": Case(
        lambda w: ["prepare", "--text", w.text, "--tokenizer", "bpe",
                   "--vocab-size", "10", "--out", w.work], "at least 257"),
    "validation fraction 1.5": Case(
        lambda w: ["prepare", "--text", w.text, "--val-fraction", "1.5",
                   "--out", w.work], "got 1.5"),
    "tokenizer file that is not JSON": Case(
        lambda w: ["prepare", "--text", w.text, "--tokenizer-file",
                   write(w.work / "tok.json", "{chars"), "--out", w.work / "o"],
        "tok.json is not valid JSON"),
    # --- training settings
    "no command": Case(lambda w: [], "no command given"),
    "unknown preset": Case(train("--preset", "gpt5"), "'gpt5'"),
    "unknown flag": Case(train("--learning-rate", "1"), "--learning-rate"),
    "flag of the wrong type": Case(train("--max-iters", "ten"), "'ten'"),
    "unknown device": Case(train("--device", "tpu"), "'tpu'"),
    "unknown dtype": Case(train("--dtype", "float8"), "'float8'"),
    "float16 on a CPU": Case(train("--dtype", "float16"), "float16 needs CUDA"),
    "zero layers": Case(train("--n-layer", "0"), "n_layer must be positive, got 0"),
    "negative width": Case(train("--n-embd", "-16"), "n_embd must be positive, got -16"),
    "zero batch size": Case(train("--batch-size", "0"), "batch_size must be positive, got 0"),
    "negative max iters": Case(train("--max-iters", "-5"), "max_iters must be positive, got -5"),
    "zero learning rate": Case(train("--lr", "0"), "lr must be positive, got 0.0"),
    "dropout 1.5": Case(train("--dropout", "1.5"), "got 1.5"),
    "width not divisible by heads": Case(train("--n-embd", "30", "--n-head", "4"),
                                         "d_model=30 is not divisible by n_heads=4"),
    "huge model": Case(train("--n-embd", "1048576", "--n-head", "1", "--n-layer", "64"),
                       "d_model=1048576 is too large"),
    "context longer than the text": Case(train("--block-size", "5000"),
                                         "too short for block_size=5000"),
    "config file that is not TOML": Case(
        train("--config", lambda w: write(w.work / "c.toml", "[model")), "not valid TOML"),
    "config file with an unknown table": Case(
        train("--config", lambda w: write(w.work / "c.toml", "[optim]\nlr = 1\n")),
        "unknown tables ['optim']"),
    "config file with an unknown setting": Case(
        train("--config", lambda w: write(w.work / "c.toml", "[train]\nlearning_rate = 1\n")),
        "['learning_rate']"),
    "data directory with a bad meta.json": Case(
        lambda w: ["train", "--data", data_with_bad_meta(w), "--out", w.work / "r", *TINY],
        "dtype must be uint16 or uint32, got 'float64'"),
    "data directory that is not one": Case(
        lambda w: ["train", "--data", w.work, "--out", w.work / "r", *TINY],
        "is not a prepared data directory"),
    "training over an existing run": Case(lambda w: ["train", "--data", w.data, "--out", w.run,
                                                     *TINY], "already holds a run"),
    # --- resuming and fine-tuning
    "resume past the position table": Case(resume("--block-size", "64"),
                                           "block_size=64 (the run has 16)"),
    "resume with data of another tokenizer": Case(resume("--data", lambda w: w.bpe_data),
                                                  "tokenizer differs"),
    "resume a directory that is not a run": Case(
        lambda w: ["train", "--resume", "--out", w.work], "holds no checkpoint"),
    "resume a run without training state": Case(
        resume(), "no training state",
        damage=lambda run: (run / "train_state.json").unlink()),
    "resume with malformed training state": Case(
        resume(), "malformed training state",
        damage=edit_json("train_state.json", lambda s: s.update(iteration="three"))),
    "resume with a negative iteration": Case(
        resume(), "iteration must be an integer >= 0, got -5",
        damage=edit_json("train_state.json", lambda s: s.update(iteration=-5))),
    "resume with malformed random states": Case(
        resume(), "rng[0].python is not a random.getstate()",
        damage=edit_json("train_state.json", lambda s: s["rng"][0].update(python=[3, [1], None]))),
    "resume with a malformed sampler state": Case(
        resume(), "batch-sampler state is malformed", damage=shorten_sampler_state),
    "resume with a train table that is not one": Case(
        resume(), "'train' must be",
        damage=edit_json("config.json", lambda c: c.update(train=[1, 2]))),
    "fine-tune with a new width": Case(
        lambda w: ["train", "--data", w.data, "--out", w.work / "ft", "--init-from", w.run,
                   *TINY[:4], "--n-embd", "32"], "only dropout may change"),
    "fine-tune on data of another tokenizer": Case(
        lambda w: ["train", "--data", w.bpe_data, "--out", w.work / "ft", "--init-from", w.run,
                   "--max-iters", "1"], "tokenizer differs"),
    # --- sampling
    "prompt outside the vocabulary": Case(sample("--prompt", "Zebra{"), "'Z', '{'"),
    "prompt longer than the context": Case(sample("--prompt", "to be " * 20),
                                           "the prompt has 120 tokens", succeeds=True),
    "top-p 0": Case(sample("--top-p", "0"), "top_p must be in (0, 1], got 0.0"),
    "top-p 1.5": Case(sample("--top-p", "1.5"), "top_p must be in (0, 1], got 1.5"),
    "negative temperature": Case(sample("--temperature", "-1"), "got -1.0"),
    "top-k 0": Case(sample("--top-k", "0"), "top_k must be a positive integer, got 0"),
    "negative token count": Case(sample("--max-new-tokens", "-1"), "got -1"),
    "zero samples": Case(sample("--num-samples", "0"), "got 0"),
    "sample on an unknown device": Case(sample("--device", "quantum"), "'quantum'"),
    # --- eval
    "eval on data of another tokenizer": Case(
        lambda w: ["eval", w.run, "--data", w.bpe_data, "--device", "cpu"], "tokenizer differs"),
    "eval of an unknown split": Case(lambda w: ["eval", w.run, "--split", "test"], "'test'"),
    "eval with batch size 0": Case(lambda w: ["eval", w.run, "--batch-size", "0"], "got 0"),
    # --- run directories and checkpoints
    "sample a directory that is not a run": Case(lambda w: ["sample", w.work],
                                                 "holds no checkpoint"),
    "sample a missing directory": Case(lambda w: ["sample", w.work / "nope"],
                                       "run directory not found"),
    "pickle file offered as a checkpoint": Case(
        lambda w: ["sample", write(w.work / "model.pt", pickle.dumps({"w": [1.0]}))],
        "never loads pickle"),
    "pickle inside model.safetensors": Case(sample(), "not a valid safetensors file",
                                            damage=pickle_as_weights),
    "nanoGPT ckpt.pt run directory": Case(sample(), "ckpt.pt", damage=nanogpt_layout),
    "truncated model.safetensors": Case(sample(), "not a valid safetensors file",
                                        damage=truncate_weights),
    "truncated best.safetensors (what sample reads by default)": Case(
        sample(checkpoint="best"), "best.safetensors is not a valid safetensors file",
        damage=lambda run: truncate_weights(run, "best.safetensors")),
    "tensor shapes that do not match the config": Case(
        sample(), "has shape (29, 16), config.json needs (29, 32)",
        damage=edit_model(n_embd=32)),
    "config.json that is not JSON": Case(
        sample(), "config.json is not valid JSON",
        damage=lambda run: write(run / "config.json", "{'model': 1")),
    "config.json with an unknown key": Case(
        sample(), "unknown keys ['optimizer']",
        damage=edit_json("config.json", lambda c: c.update(optimizer="sgd"))),
    "config.json with an unknown model key": Case(
        sample(), "['n_experts']", damage=edit_model(n_experts=8)),
    "config.json with a string size": Case(sample(), "n_layer must be int, got '1'",
                                           damage=edit_model(n_layer="1")),
    "config.json asking for 10**12 tokens": Case(sample(), "needs (1000000000000, 16)",
                                                 damage=edit_model(vocab_size=10**12)),
    "config.json asking for a 10**9 context": Case(sample(), "needs (1000000000, 16)",
                                                   damage=edit_model(block_size=10**9)),
    "config.json asking for a huge width": Case(sample(), "d_model=4294967296 is too large",
                                                damage=edit_model(n_embd=2**32, n_head=1)),
    "tokenizer.json that is not JSON": Case(
        sample(), "tokenizer.json is not UTF-8 text",
        damage=lambda run: write(run / "tokenizer.json", b"\xff\xfe")),
    "tokenizer.json with a non-character": Case(
        sample(), "single characters, got ['ab']",
        damage=edit_json("tokenizer.json", lambda t: t["chars"].append("ab"))),
    "tokenizer.json of 65 MiB": Case(sample(), "68,157,440 bytes, more than the 67,108,864",
                                     damage=huge_tokenizer_file),
    "tokenizer larger than the model": Case(
        sample(), "more than the model's vocab_size=29",
        damage=edit_json("tokenizer.json", lambda t: t["chars"].extend("ÀÁÂ"))),
    "journal that points outside the run": Case(sample(), "'../victim'",
                                                damage=hostile_journal),
    # --- hostile run directories (issue 11): bounded JSON, checked tensors, no links
    "config.json nested 100,000 deep": Case(sample(), "nested too deeply",
                                            damage=deep_json("config.json")),
    "tokenizer.json nested 100,000 deep": Case(sample(), "nested too deeply",
                                               damage=deep_json("tokenizer.json")),
    "journal nested 100,000 deep": Case(sample(), "more than the 4,096 such a file may hold",
                                        damage=deep_json("checkpoint.journal")),
    "journal nested 2,000 deep": Case(sample(), "nested too deeply", damage=lambda run: write(
        run / "checkpoint.journal", "[" * 2000 + "]" * 2000)),
    "train_state.json nested 100,000 deep": Case(resume(), "nested too deeply",
                                                 damage=deep_json("train_state.json")),
    "journal naming a list": Case(sample(), "may only name the checkpoint files",
                                  damage=lambda run: write(run / "checkpoint.journal", '[["x"]]')),
    "journal naming an object": Case(sample(), "may only name the checkpoint files",
                                     damage=lambda run: write(run / "checkpoint.journal", "[{}]")),
    "NaN in the weights": Case(sample(), "tok_emb.weight holds 1 NaN or infinite values",
                               damage=edit_tensors("model.safetensors",
                                                   set_first("tok_emb.weight", math.nan))),
    "infinity in an AdamW moment": Case(
        resume(), "optimizer.0.exp_avg holds 1 NaN or infinite values",
        damage=edit_tensors("train_state.safetensors", set_first("optimizer.0.exp_avg", math.inf))),
    "bool weights": Case(sample(), "ln_f.weight has dtype BOOL",
                         damage=edit_tensors("model.safetensors", lambda t: t.update(
                             {"ln_f.weight": t["ln_f.weight"] > 0}))),
    "int64 weights": Case(sample(), "ln_f.weight has dtype I64",
                          damage=edit_tensors("model.safetensors", lambda t: t.update(
                              {"ln_f.weight": t["ln_f.weight"].long()}))),
    "model.safetensors padded to 64 GiB": Case(
        sample(), "holds 68,719,476,736 bytes but its header describes",
        damage=pad_weights_to_64_gib),
    "a weights header promising 64 GiB": Case(
        sample(), "tok_emb.weight has shape (1073741824, 16), config.json needs (29, 16)",
        damage=weights_promising_64_gib),
    "config and weights asking for 1 TiB together": Case(
        sample(), "needs 1,024.0 GiB of memory to load, more than",  # the file once, no copy
        damage=config_and_weights_of_1_tib),
    "a pending link the journal names": Case(sample(), "is a symbolic link",
                                             damage=pending_link_the_journal_names),
    "resume through a pending link the journal names": Case(
        resume(), "is a symbolic link", damage=pending_link_the_journal_names),
    "a pending directory the journal names": Case(
        sample(), "model.safetensors.pending is not a regular file",
        damage=lambda run: (pending_directory(run), journal_naming("model.safetensors")(run))),
    "resume over a pending directory": Case(
        resume(), "model.safetensors.pending is a directory", damage=pending_directory),
    "a lock file that is a link": Case(resume(), ".glassgpt.lock is a symbolic link",
                                       damage=lock_file_link),
    "malformed best_val_loss": Case(
        resume(), "best_val_loss must be a number or null, got 'x'",
        damage=edit_json("train_state.json", lambda s: s.update(best_val_loss="x"))),
    "param_groups that is not a list": Case(
        resume(), "optimizer param_groups must be a list",
        damage=edit_json("train_state.json", lambda s: s["optimizer"].update(param_groups="x"))),
    "a scaler that is a number": Case(
        resume(), "scaler must be null or a table",
        damage=edit_json("train_state.json", lambda s: s.update(scaler=5))),
    "random states that are a string": Case(
        resume(), "rng must be a list", damage=edit_json("train_state.json",
                                                         lambda s: s.update(rng="x"))),
    "an AdamW moment of the wrong shape (it segfaulted)": Case(
        resume(), "optimizer.0.exp_avg has shape (3,), the parameter it belongs to needs (29, 16)",
        damage=edit_tensors("train_state.safetensors",
                            lambda t: t.update({"optimizer.0.exp_avg": torch.zeros(3)}))),
    "an AdamW moment missing": Case(
        resume(), "missing ['optimizer.0.exp_avg_sq']",
        damage=edit_tensors("train_state.safetensors", lambda t: t.pop("optimizer.0.exp_avg_sq"))),
    "an AdamW step count of 0": Case(
        resume(), "a saved step count is at least 1",
        damage=edit_tensors("train_state.safetensors", lambda t: t["optimizer.0.step"].zero_())),
    # --- flags that cannot work together, or cannot fit
    # A resume may repeat the run's settings; one that differs is refused.
    "resume with a --config that changes the model": Case(
        resume("--config", lambda w: write(w.work / "c.toml", "[model]\nn_layer = 3\n")),
        "cannot change model settings of a run when resuming: n_layer=3 (the run has 1)"),
    "resume with another --preset": Case(resume("--preset", "cpu-small"),
                                         "cannot change model settings of a run when resuming"),
    "resume with --init-from": Case(resume("--init-from", lambda w: w.run),
                                    "differs from the run's (it was not fine-tuned)"),
    "a batch of ten million sequences": Case(train("--batch-size", "10000000"),
                                             "training needs about"),
    "--out that is a file": Case(
        lambda w: ["train", "--data", w.data, "--out", write(w.work / "f", "x"), *TINY],
        "is a file, not a directory"),
    "--out below a file": Case(
        lambda w: ["train", "--data", w.data, "--out", write(w.work / "f", "x") / "run", *TINY],
        "is a file, not a directory"),
    "--out with a name of 300 bytes": Case(
        lambda w: ["train", "--data", w.data, "--out", w.work / ("n" * 300), *TINY],
        "file systems take at most 255"),
    "--to-hf that is a file": Case(
        lambda w: ["convert", w.run, "--to-hf", write(w.work / "f", "x")], "is a file"),
    "--to-hf below a file": Case(
        lambda w: ["convert", w.run, "--to-hf", write(w.work / "f", "x") / "hf"],
        "is a file, not a directory"),
    "--to-hf with a name of 300 bytes": Case(
        lambda w: ["convert", w.run, "--to-hf", w.work / ("n" * 300)],
        "file systems take at most 255"),
    # --- `train --force` typos: everything is checked before the old run is touched
    "--out naming the data directory, forced": Case(
        lambda w: ["train", "--data", w.data, "--out", w.data, "--force", *TINY],
        "is a prepared data directory"),
    "a forced run over a data directory that is not there": Case(
        lambda w: ["train", "--data", w.work / "nonexistent", "--out", w.run, "--force", *TINY],
        "is not a prepared data directory"),
    "a forced run with a config file that is not there": Case(
        lambda w: ["train", "--data", w.data, "--out", w.run, "--force", "--config",
                   w.work / "missing.toml", *TINY], "config file not found"),
    "a forced run with a width its heads do not divide": Case(
        lambda w: ["train", "--data", w.data, "--out", w.run, "--force", *TINY,
                   "--n-embd", "30", "--n-head", "4"], "d_model=30 is not divisible"),
    "a forced run starting from itself": Case(
        lambda w: ["train", "--data", w.data, "--out", w.run, "--force", "--init-from", w.run,
                   "--max-iters", "1"], "--init-from and --out both name"),
    "a fresh --out holding a dangling metrics.jsonl link": Case(
        lambda w: ["train", "--data", w.data, "--out", w.run.parent / "fresh", *TINY],
        "metrics.jsonl is a symbolic link", damage=fresh_out_with_a_dangling_metrics_link),
}


# These rows also go through a fresh `python -m glassgpt` process, a few at a time; the others
# call the same entry point, `glassgpt.cli.main`, in-process (where any exception escaping `main`
# would be the traceback) because a fresh interpreter costs seconds.
THROUGH_A_PROCESS = ("binary text", "unknown flag", "huge model", "resume past the position table",
                     "prompt outside the vocabulary", "prompt longer than the context",
                     "pickle inside model.safetensors", "config.json asking for 10**12 tokens",
                     "journal that points outside the run",
                     "an AdamW moment of the wrong shape (it segfaulted)")


def around(case_dir: Path, setup: Setup) -> Snapshot:
    """Everything a row must leave alone: its run, the directories beside it (a planted link's
    target), and the shared data directories; the scratch directory work/ aside."""
    return snapshot(case_dir, skip=("work",)) | snapshot(setup.data, setup.bpe_data)


@dataclass
class Outcome:
    returncode: int
    stderr: str
    before: Snapshot  # every entry around the row's run, before and after
    after: Snapshot


@dataclass
class Setup:
    template: Path  # the tiny run, trained once
    data: Path
    bpe_data: Path
    text: Path
    env: dict[str, str]


def prepare_row(name: str, setup: Setup, case_dir: Path) -> tuple[Where, list[str]]:
    """Copy the run into `case_dir/run`, damage it, and build the row's command line."""
    where = Where(case_dir / "run", setup.data, setup.bpe_data, setup.text, case_dir / "work")
    shutil.copytree(setup.template, where.run)
    where.work.mkdir()
    if CASES[name].damage is not None:
        CASES[name].damage(where.run)
    return where, [str(a) for a in CASES[name].argv(where)]


def run_in_a_process(name: str, setup: Setup, case_dir: Path) -> tuple[Outcome, Where]:
    where, argv = prepare_row(name, setup, case_dir)
    before = around(case_dir, setup)
    result = subprocess.run([sys.executable, "-m", "glassgpt", *argv], capture_output=True,
                            text=True, env=setup.env, cwd=where.work, timeout=300)
    return Outcome(result.returncode, result.stderr, before, around(case_dir, setup)), where


@pytest.fixture(scope="module")
def setup(shakespeare_path, trained_run, tmp_path_factory) -> Setup:
    """The session's trained run (3 iterations of TINY), copied per row; its data and text."""
    root = tmp_path_factory.mktemp("bad_inputs")
    env = cli_environment(shakespeare_path, root / "cache")
    prepare(root / "bpe_data", trained_run.text, tokenizer="bpe", vocab_size=300)
    return Setup(trained_run.run, trained_run.data, root / "bpe_data", trained_run.text, env)


@pytest.fixture(scope="module")
def process_outcomes(setup, tmp_path_factory) -> dict[str, tuple[Outcome, Where]]:
    root = tmp_path_factory.mktemp("rows")
    with ThreadPoolExecutor(PARALLEL_PROCESSES) as pool:
        futures = {name: pool.submit(run_in_a_process, name, setup, root / f"row{i}")
                   for i, name in enumerate(THROUGH_A_PROCESS)}
        return {name: future.result() for name, future in futures.items()}


def run_in_process(name: str, setup: Setup, case_dir: Path, capsys, monkeypatch
                   ) -> tuple[Outcome, Where]:
    case_dir.mkdir()
    where, argv = prepare_row(name, setup, case_dir)
    monkeypatch.setenv("GLASSGPT_TINYSHAKESPEARE", setup.env["GLASSGPT_TINYSHAKESPEARE"])
    monkeypatch.setenv("XDG_CACHE_HOME", setup.env["XDG_CACHE_HOME"])
    monkeypatch.chdir(where.work)
    before = around(case_dir, setup)
    capsys.readouterr()
    code = main(argv)  # an exception escaping here would be a traceback: the test fails
    return Outcome(code, capsys.readouterr().err, before, around(case_dir, setup)), where


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow)
                                  if name in THROUGH_A_PROCESS else name for name in CASES])
def test_bad_input(name, setup, tmp_path, capsys, monkeypatch, request):
    case = CASES[name]
    if name in THROUGH_A_PROCESS:  # the processes run together, once, for the first such row
        outcome, where = request.getfixturevalue("process_outcomes")[name]
    else:
        outcome, where = run_in_process(name, setup, tmp_path / "row", capsys, monkeypatch)
    message = case.message.replace("{work}", str(where.work))
    assert "Traceback" not in outcome.stderr, outcome.stderr
    if case.succeeds:
        assert outcome.returncode == 0, outcome.stderr
        assert message in outcome.stderr
    else:
        assert outcome.returncode == 2
        lines = outcome.stderr.strip().splitlines()
        assert len(lines) == 1, outcome.stderr
        assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert_unchanged(outcome.before, outcome.after)


def test_the_table_is_large_and_mostly_failing():
    """The figures the robustness section quotes."""
    assert len(CASES) >= 110 and sum(not c.succeeds for c in CASES.values()) == len(CASES) - 1


@pytest.mark.slow
def test_debug_shows_the_traceback(tmp_path):
    """`--debug` is the one way to see where an error came from."""
    result = subprocess.run([sys.executable, "-m", "glassgpt", "--debug", "sample",
                             str(tmp_path / "nope")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0 and "Traceback" in result.stderr
    assert "CheckpointError" in result.stderr


def test_loading_a_run_never_unpickles(setup, tmp_path, monkeypatch):
    """Loading, resuming and refusing a pickle all happen with every unpickler disabled."""
    def refuse(*args, **kwargs):
        raise AssertionError("glassgpt tried to unpickle")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                         (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    load_model(setup.template)
    load_train_state(setup.template)
    run = shutil.copytree(setup.template, tmp_path / "run")
    pickle_as_weights(run)
    with pytest.raises(GlassGPTError, match="not a valid safetensors file"):
        load_model(run, checkpoint="last")
