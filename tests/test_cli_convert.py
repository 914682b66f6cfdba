"""`glassgpt convert`: a Hugging Face GPT-2 directory into a run and back, through the real CLI."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glassgpt import GPT, GPTConfig
from glassgpt.cli import main
from glassgpt.rundir.checkpoint import load_model, save_model
from glassgpt.tokenizers import BPETokenizer, CharTokenizer

transformers = pytest.importorskip("transformers")


def run_glassgpt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # HF_HUB_OFFLINE keeps every test off the network; a hub name fails at once instead of
    # retrying.
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "glassgpt", *args], capture_output=True,
                          text=True, env=full_env, timeout=120)


def logits_of(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out[0]


@pytest.fixture()
def hf_dir(tmp_path: Path, small_text: Path) -> Path:
    """A tiny random GPT-2 with a byte-level BPE tokenizer, as save_pretrained writes it."""
    tokenizer = BPETokenizer.train(small_text.read_text(encoding="utf-8"), 300)
    config = transformers.GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=24, n_embd=32,
                                     n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for param in model.parameters():  # LayerNorms too: a swapped one would show
            param.normal_(0.0, 0.2)
    path = tmp_path / "hf-source"
    model.save_pretrained(path)
    tokenizer.save(path / "tokenizer.json")
    return path


def test_convert_round_trip_through_a_run_directory(tmp_path: Path, hf_dir: Path) -> None:
    source = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    run = tmp_path / "run"
    result = run_glassgpt("convert", "--from-hf", str(hf_dir), "--out", str(run))
    assert result.returncode == 0, result.stderr
    assert "2 layers" in result.stdout

    model, tokenizer = load_model(run)
    assert tokenizer.kind == "bpe" and tokenizer.vocab_size == source.config.vocab_size
    idx = torch.randint(0, source.config.vocab_size, (2, 24))
    torch.testing.assert_close(logits_of(model, idx), logits_of(source, idx), atol=1e-5, rtol=0)

    sampled = run_glassgpt("sample", str(run), "--prompt", "To be", "--max-new-tokens", "8",
                           "--seed", "0")
    assert sampled.returncode == 0, sampled.stderr
    assert "To be" in sampled.stdout

    out = tmp_path / "hf-export"
    result = run_glassgpt("convert", str(run), "--to-hf", str(out))
    assert result.returncode == 0, result.stderr
    exported = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    torch.testing.assert_close(logits_of(exported, idx), logits_of(source, idx), atol=1e-5,
                               rtol=0)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "To be or not to be, that is the question."
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text)


def test_char_run_exports_the_model_only(tmp_path: Path, capsys) -> None:
    config = GPTConfig(vocab_size=30, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config).eval()
    run = tmp_path / "run"
    save_model(run, model, CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .,\n"))
    out = tmp_path / "hf"
    assert main(["convert", str(run), "--to-hf", str(out)]) == 0  # in-process: one less start-up
    assert "model only" in capsys.readouterr().out
    assert not (out / "tokenizer.json").exists()
    idx = torch.randint(0, 30, (2, 16))
    exported = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    torch.testing.assert_close(logits_of(exported, idx), logits_of(model, idx), atol=1e-5,
                               rtol=0)


def test_offline_hub_name_is_one_clear_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    empty_cache = {"HF_HOME": str(tmp_path / "hf-home")}  # no cached copy to fall back on
    result = run_glassgpt("convert", "--from-hf", "gpt2", "--out", str(run), env=empty_cache)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: cannot load 'gpt2' from the Hugging Face hub (offline")
    assert not run.exists()


def test_post_ln_run_cannot_be_exported(tmp_path: Path, capsys) -> None:
    config = GPTConfig(vocab_size=30, block_size=8, n_layer=1, n_head=2, n_embd=16, pre_ln=False)
    run = tmp_path / "run"
    save_model(run, GPT(config), CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .,\n"))
    assert main(["convert", str(run), "--to-hf", str(tmp_path / "hf")]) == 2
    assert "pre_ln=False (Post-LN) cannot be exported" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("args", [
    ["convert"],
    ["convert", "--from-hf", "gpt2"],
    ["convert", "RUN"],
    ["convert", "RUN", "--to-hf", "OUT", "--from-hf", "gpt2"],
    ["convert", "RUN", "--to-hf", "OUT", "--dropout", "0.1"],
])
def test_convert_needs_one_whole_direction(args: list[str], capsys) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: convert:") and len(err.strip().splitlines()) == 1


def test_import_never_overwrites_an_existing_run(tmp_path: Path, hf_dir: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(run)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (run / "notes.txt").read_text() == "keep me"


@pytest.fixture()
def bpe_run_and_data(tmp_path: Path, small_text: Path) -> tuple[Path, Path]:
    """A BPE data directory and a run (random weights) that uses its tokenizer."""
    from glassgpt.data import PreparedData, prepare

    prepare(tmp_path / "data", small_text, "bpe", 300)
    data = PreparedData(tmp_path / "data")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=16, n_layer=1, n_head=2,
                          n_embd=16))
    save_model(tmp_path / "run", model, data.tokenizer)
    return tmp_path / "run", tmp_path / "data"


def test_an_export_reads_like_the_users_files_and_knows_its_context(bpe_run_and_data, tmp_path,
                                                                     capsys) -> None:
    run, _ = bpe_run_and_data
    old_umask = os.umask(0o022)
    try:
        assert main(["convert", str(run), "--to-hf", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old_umask)
    out = tmp_path / "hf"
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == \
        {p.name: 0o644 for p in out.iterdir()}
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.model_max_length == 16  # block_size, not ~1e30


def test_an_export_is_replaced_only_when_asked_and_only_an_export(bpe_run_and_data, tmp_path,
                                                                 capsys) -> None:
    run, _ = bpe_run_and_data
    out = tmp_path / "hf"
    assert main(["convert", str(run), "--to-hf", str(out)]) == 0
    assert main(["convert", str(run), "--to-hf", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["convert", str(run), "--to-hf", str(out), "--force"]) == 0
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("keep")
    assert main(["convert", str(run), "--to-hf", str(notes), "--force"]) == 2
    assert "does not hold a Hugging Face export" in capsys.readouterr().err
    assert (notes / "mine.txt").read_text() == "keep"


def test_a_round_trip_through_hf_evaluates_on_the_original_data(bpe_run_and_data, tmp_path,
                                                                capsys) -> None:
    """transformers rewrites tokenizer.json (a no-op post-processor); the tokenizer still does
    what the data's does, so `eval --data ORIGINAL` accepts the imported run."""
    run, data = bpe_run_and_data
    assert main(["convert", str(run), "--to-hf", str(tmp_path / "hf")]) == 0
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "back")]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "back"), "--data", str(data), "--max-batches", "1",
                 "--batch-size", "2", "--threads", "1"]) == 0
    assert "bits per byte" in capsys.readouterr().out


def test_a_tokenizer_smaller_than_the_vocabulary_is_refused(tmp_path: Path, hf_dir: Path,
                                                            capsys) -> None:
    """sample would draw ids the tokenizer cannot decode, halfway through a sample (a
    character tokenizer cannot name them, as a BPE one a padding smaller does, below)."""
    small = tmp_path / "small-tokenizer.json"
    small.write_text(CharTokenizer.from_text("abcdefghij").to_json(), encoding="utf-8")
    vocab = transformers.GPT2Config.from_pretrained(hf_dir).vocab_size
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(run), "--tokenizer",
                 str(small)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"the tokenizer has 10 tokens but the model's vocab_size is {vocab}" in line
    assert not run.exists()


def full_disk_in_the_run(monkeypatch) -> None:
    """ENOSPC at the second file of the run (the weights are written, the disk is full)."""
    from glassgpt.storage import files

    real, opened = files.open_new_file, []

    def open_without_space(path):
        opened.append(path)
        if len(opened) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path)
    monkeypatch.setattr(files, "open_new_file", open_without_space)


def full_disk_in_the_export(monkeypatch) -> None:
    """ENOSPC after transformers wrote part of the export."""
    def save_without_space(self, directory, *args, **kwargs):
        (Path(directory) / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_without_space)


@pytest.mark.parametrize("direction", ["--from-hf", "--to-hf"])
def test_a_full_disk_leaves_no_half_made_directory(direction: str, tmp_path: Path, hf_dir: Path,
                                                   capsys, monkeypatch) -> None:
    place = tmp_path / "place"
    place.mkdir()
    if direction == "--from-hf":
        full_disk_in_the_run(monkeypatch)
        args = ["convert", "--from-hf", str(hf_dir), "--out", str(place / "new")]
    else:
        run = tmp_path / "run"
        assert main(["convert", "--from-hf", str(hf_dir), "--out", str(run)]) == 0
        full_disk_in_the_export(monkeypatch)
        args = ["convert", str(run), "--to-hf", str(place / "new")]
    capsys.readouterr()
    assert main(args) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert line == f"error: cannot write {place / 'new'} (No space left on device); nothing " \
                   f"was left there"
    assert list(place.iterdir()) == []  # no run, no export, no staging directory, no lock


def test_a_models_padding_ids_get_names_so_every_id_decodes(tmp_path: Path, small_text: Path,
                                                            capsys) -> None:
    """Qwen3's embedding has 267 rows more than its tokenizer has tokens; here 5 more."""
    tokenizer = BPETokenizer.train(small_text.read_text(encoding="utf-8"), 300)
    vocab = tokenizer.vocab_size + 5
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=8, n_embd=16, n_layer=1,
                                     n_head=2, bos_token_id=None, eos_token_id=None)
    source = tmp_path / "hf-source"
    transformers.GPT2LMHeadModel(config).save_pretrained(source)
    tokenizer.save(source / "tokenizer.json")
    assert main(["convert", "--from-hf", str(source), "--out", str(tmp_path / "run")]) == 0
    assert "the 5 ids past the tokenizer (padding) decode as <|unused:ID|>" in \
        capsys.readouterr().err
    _, imported = load_model(tmp_path / "run")
    assert imported.vocab_size == vocab
    last, first = vocab - 1, vocab - 5
    assert imported.decode([last, first]) == f"<|unused:{last}|><|unused:{first}|>"
    text = "To be or not to be"
    assert imported.encode(text) == tokenizer.encode(text)  # the real tokens are unchanged


def test_convert_is_two_library_calls_that_the_command_prints_around(tmp_path: Path,
                                                                     hf_dir: Path) -> None:
    """glassgpt.formats.convert does the work and returns what the command prints; cli/convert.py
    holds no conversion of its own (it reads, checks and writes no directory itself)."""
    from glassgpt.formats.convert import ExportedRun, ImportedRun, export_run, import_run

    imported = import_run(hf_dir, tmp_path / "run")
    assert isinstance(imported, ImportedRun) and imported.run_dir == tmp_path / "run"
    assert (imported.config.n_layer, imported.tokenizer_kind) == (2, "bpe")
    assert imported.tokenizer_size == imported.config.vocab_size and imported.notes == ()
    exported = export_run(tmp_path / "run", tmp_path / "hf")
    assert isinstance(exported, ExportedRun) and exported.with_tokenizer
    assert "last weights" in exported.weights
    source = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    back = transformers.GPT2LMHeadModel.from_pretrained(exported.out).eval()
    idx = torch.randint(0, source.config.vocab_size, (2, 24))
    torch.testing.assert_close(logits_of(back, idx), logits_of(source, idx), atol=1e-5, rtol=0)
    cli = (Path(__file__).resolve().parents[1] / "src/glassgpt/cli/convert.py").read_text()
    for work in ("glassgpt.formats.interop", "glassgpt.formats.files", "glassgpt.rundir",
                 "glassgpt.storage"):
        assert work not in cli


def test_a_tokenizer_file_a_padding_smaller_than_the_model_is_taken(tmp_path: Path,
                                                                    small_text: Path,
                                                                    capsys) -> None:
    """An embedding padded to a multiple of 64 rows takes its BPE tokenizer (issue 38,
    item 8): the ids past it are named; a tokenizer larger than the model is still refused."""
    tokenizer = BPETokenizer.train(small_text.read_text(encoding="utf-8"), 300)
    tokenizer.save(tmp_path / "tokenizer.json")
    vocab = (tokenizer.vocab_size // 64 + 1) * 64
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=8, n_embd=16, n_layer=1,
                                     n_head=2, bos_token_id=None, eos_token_id=None)
    source = tmp_path / "hf-source"
    transformers.GPT2LMHeadModel(config).save_pretrained(source)  # no tokenizer of its own
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(source), "--out", str(run), "--tokenizer",
                 str(tmp_path / "tokenizer.json")]) == 0
    padding = vocab - tokenizer.vocab_size
    assert f"the {padding} ids past the tokenizer (padding) decode as <|unused:ID|>" in \
        capsys.readouterr().err
    _, imported = load_model(run)
    assert imported.vocab_size == vocab
    assert imported.decode([vocab - 1]) == f"<|unused:{vocab - 1}|>"
    assert imported.encode("To be or not") == tokenizer.encode("To be or not")

    smaller = transformers.GPT2Config(**{**config.to_dict(), "vocab_size": tokenizer.vocab_size
                                         - 10})
    transformers.GPT2LMHeadModel(smaller).save_pretrained(tmp_path / "smaller")
    assert main(["convert", "--from-hf", str(tmp_path / "smaller"), "--out",
                 str(tmp_path / "run2"), "--tokenizer", str(tmp_path / "tokenizer.json")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "the model could never emit the other 10" in line
    assert not (tmp_path / "run2").exists()


NO_LIMIT = "1000000000000000019884624838656"  # int(1e30), as transformers writes it


def test_the_tokenizer_config_transformers_writes_is_read(tmp_path: Path, hf_dir: Path,
                                                         capsys) -> None:
    """transformers writes model_max_length 10**30 ("no limit") in tokenizer_config.json, past
    64 bits (issue 38, item 8): read there, and still refused anywhere else."""
    tokenizer = BPETokenizer.from_json((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer,
                                         eos_token="<|endoftext|>").save_pretrained(hf_dir)
    config_path = hf_dir / "tokenizer_config.json"
    written = config_path.read_text(encoding="utf-8")
    assert f'"model_max_length": {NO_LIMIT}' in written
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "run")]) == 0

    config_path.write_text(written.replace("{", f'{{"padding": {NO_LIMIT},', 1),
                           encoding="utf-8")
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "b")]) == 2
    assert f"integer {NO_LIMIT} does not fit in 64 bits" in capsys.readouterr().err
    config_path.write_text(written, encoding="utf-8")
    hf_config = hf_dir / "config.json"  # a model's settings keep the 64-bit bound
    hf_config.write_text(hf_config.read_text().replace('"n_embd": 32', f'"n_embd": {NO_LIMIT}'))
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "c")]) == 2
    assert "does not fit in 64 bits" in capsys.readouterr().err
