"""Hostile inputs to `convert` (issue 27): each directory either imports exactly what
transformers computes or is refused in one line, and nothing a user saved is touched.

Tiny random models built here, offline, as tests/test_interop*.py build them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glassgpt import GPT, GPTConfig
from glassgpt.cli import main
from glassgpt.errors import ConfigError
from glassgpt.formats.interop import from_hf
from glassgpt.rundir.checkpoint import load_model, save_model
from glassgpt.tokenizers import BPETokenizer, CharTokenizer
from helpers_dirs import assert_unchanged, snapshot

transformers = pytest.importorskip("transformers")


def randomize(module: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)


def tiny_hf_dir(path: Path, arch: str = "gpt2", **config) -> Path:
    """A save_pretrained directory of a tiny random GPT-2 or Llama (no tokenizer)."""
    if arch == "gpt2":
        settings = dict(vocab_size=61, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=None, eos_token_id=None)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**settings, **config}))
    else:
        settings = dict(vocab_size=61, hidden_size=16, intermediate_size=24,
                        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=8,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **config}))
    randomize(model)
    model.save_pretrained(path)
    return path


def edit_config(directory: Path, **changes) -> None:
    config_file = directory / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))


def char_run(path: Path) -> Path:
    chars = "abcdefghijklmnopqrstuvwxyz .,\n"
    config = GPTConfig(vocab_size=len(chars), block_size=16, n_layer=1, n_head=2, n_embd=16)
    save_model(path, GPT(config), CharTokenizer.from_text(chars))
    return path


def tokenizer_file(path: Path, size: int = 61) -> Path:
    """A character tokenizer of `size` tokens, for a directory that comes without one."""
    path.write_text(CharTokenizer.from_text("".join(chr(48 + i) for i in range(size))).to_json())
    return path


def logits_of(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out[0]


def one_error_line(capsys) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ")
    return line


# --- 1: a tied config.json beside a head of its own -----------------------------------------

@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_tied_config_beside_an_untied_head_imports_what_transformers_computes(
        arch: str, tmp_path: Path, capsys) -> None:
    """A fine-tune that untied its head, its config.json still saying tied: transformers 5
    keeps both matrices (torch.equal decides), so the import must too."""
    source = tiny_hf_dir(tmp_path / "hf", arch, tie_word_embeddings=False)
    edit_config(source, tie_word_embeddings=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    assert main(["convert", "--from-hf", str(source), "--out", str(tmp_path / "run"),
                 "--tokenizer", str(tokenizer_file(tmp_path / "chars.json"))]) == 0
    model, _ = load_model(tmp_path / "run")
    idx = torch.randint(0, 61, (2, 8))
    torch.testing.assert_close(logits_of(model, idx), logits_of(reference, idx), atol=1e-5,
                               rtol=0)
    assert not model.config.tie_weights
    assert "imported with that head, untied" in capsys.readouterr().err  # said, not silent
    torch.testing.assert_close(logits_of(from_hf(reference), idx), logits_of(reference, idx),
                               atol=1e-5, rtol=0)  # and from the loaded model, which says tied


# --- 5, 7: --force and where an export may go ------------------------------------------------

def test_force_never_replaces_a_model_directory_glassgpt_did_not_write(tmp_path: Path,
                                                                       capsys) -> None:
    run = char_run(tmp_path / "run")
    theirs = tiny_hf_dir(tmp_path / "my-model")  # config.json with a model_type, and more
    (theirs / "README.md").write_text("my model card")
    before = snapshot(theirs)
    capsys.readouterr()  # transformers' own progress bars
    assert main(["convert", str(run), "--to-hf", str(theirs), "--force"]) == 2
    assert "glassgpt" in one_error_line(capsys)
    assert_unchanged(before, snapshot(theirs))


@pytest.mark.parametrize("direction", ["--to-hf", "--from-hf"])
def test_an_output_inside_the_directory_being_read_is_refused(direction: str, tmp_path: Path,
                                                              capsys) -> None:
    if direction == "--to-hf":
        source = char_run(tmp_path / "run")
        args = ["convert", str(source), "--to-hf", str(source / "hf")]
    else:
        source = tiny_hf_dir(tmp_path / "hf")
        args = ["convert", "--from-hf", str(source), "--out", str(source / "run"),
                "--tokenizer", str(tokenizer_file(tmp_path / "chars.json"))]
    before = snapshot(source)
    capsys.readouterr()
    assert main(args) == 2
    assert "overlaps" in one_error_line(capsys)
    assert_unchanged(before, snapshot(source))


# --- 8: a tokenizer `sample` would refuse ----------------------------------------------------

def test_import_refuses_a_tokenizer_that_sample_would_refuse(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    source = tiny_hf_dir(tmp_path / "hf")
    vocab = {f"w{i}": i for i in range(60)} | {"[UNK]": 60}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.save(str(source / "tokenizer.json"))
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(source), "--out", str(run)]) == 2
    assert "glassgpt takes byte-level BPE ones" in one_error_line(capsys)
    assert not run.exists()


# --- 12: a full disk under the export --------------------------------------------------------

def test_a_full_disk_under_the_export_is_one_line(tmp_path: Path, capsys,
                                                  monkeypatch) -> None:
    """safetensors reports a full disk as its own error, not an OSError: as on a real one."""
    import safetensors.torch
    from safetensors import SafetensorError

    def no_space(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")
    monkeypatch.setattr(safetensors.torch, "serialize_file", no_space)
    run = char_run(tmp_path / "run")
    place = tmp_path / "place"
    place.mkdir()
    assert main(["convert", str(run), "--to-hf", str(place / "hf")]) == 2
    assert one_error_line(capsys) == (f"error: cannot write {place / 'hf'} (No space left on "
                                      f"device); nothing was left there")
    assert list(place.iterdir()) == []


# --- 18: a config.json that says two things --------------------------------------------------

def test_gpt2_setting_names_that_disagree_are_refused(tmp_path: Path) -> None:
    source = tiny_hf_dir(tmp_path / "hf")  # n_embd 16
    edit_config(source, hidden_size=32)
    with pytest.raises(ConfigError, match=r"n_embd=16 and its other name hidden_size=32"):
        from_hf(source)
    edit_config(source, hidden_size=16)  # the same value twice is no contradiction
    assert from_hf(source).config.n_embd == 16


# --- 19: transformers' pipeline on an export -------------------------------------------------

def test_pipeline_on_an_exported_gpt2_stops_at_its_context(tmp_path: Path,
                                                           small_text: Path) -> None:
    tokenizer = BPETokenizer.train(small_text.read_text(encoding="utf-8"), 300)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=1, n_head=2,
                       n_embd=16)
    save_model(tmp_path / "run", GPT(config), tokenizer)
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf")]) == 0
    generator = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
    out = generator("To be or not", do_sample=False, return_tensors=True)
    ids = out[0]["generated_token_ids"]
    assert len(tokenizer.encode("To be or not")) < len(ids) <= 16  # it ran, and stopped there
