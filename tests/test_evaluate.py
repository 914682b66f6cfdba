"""Evaluation: loss, perplexity and bits per byte, in the library and through `glassgpt eval`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import tiny_gpt
from glassgpt.cli import main
from glassgpt.data import PreparedData, prepare
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.model import GPT
from glassgpt.rundir.checkpoint import save_model
from glassgpt.training.evaluate import bits_per_byte, evaluate

TEXT = "".join(f"To be or not to be, line {i}: that is the question.\n" for i in range(120))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, PreparedData]:
    root = tmp_path_factory.mktemp("eval")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    prepare(root / "char", root / "text.txt")
    prepare(root / "bpe", root / "text.txt", "bpe", 300)
    return {kind: PreparedData(root / kind) for kind in ("char", "bpe")}


def tiny_model(vocab_size: int) -> GPT:
    torch.manual_seed(0)
    return tiny_gpt(vocab_size=vocab_size, n_layer=1).eval()


def test_bits_per_byte_formula():
    assert bits_per_byte(math.log(2), 10, 10) == pytest.approx(1.0)
    assert bits_per_byte(2.0, 100, 400) == pytest.approx(2.0 * 100 / (math.log(2) * 400))
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 10, 0)


def test_a_char_model_on_ascii_scores_loss_over_ln2(datasets):
    data = datasets["char"]
    result = evaluate(tiny_model(data.vocab_size), data.splits["val"], data.tokenizer, 4, 3)
    assert result.tokens == result.text_bytes == 3 * 4 * 16  # one byte per character
    assert result.bits_per_byte == pytest.approx(result.loss / math.log(2), rel=1e-12)
    assert result.perplexity == pytest.approx(math.exp(result.loss))


def test_bpe_bytes_are_those_of_the_target_text(datasets):
    data = datasets["bpe"]
    ids = data.splits["val"]
    result = evaluate(tiny_model(data.vocab_size), ids, data.tokenizer, 2, 2)
    targets = ids[1:result.tokens + 1].tolist()  # non-overlapping windows: one stretch
    assert result.text_bytes == len(data.tokenizer.decode(targets).encode("utf-8"))
    assert result.text_bytes > result.tokens  # BPE tokens hold several bytes
    assert result.bits_per_byte == pytest.approx(
        result.loss * result.tokens / (math.log(2) * result.text_bytes))


def test_a_model_with_nan_weights_is_an_error_not_a_number(datasets):
    data = datasets["char"]
    model = tiny_model(data.vocab_size)
    with torch.no_grad():
        model.tok_emb.weight.fill_(float("nan"))
    with pytest.raises(CheckpointError, match="not a usable number"):
        evaluate(model, data.splits["val"], data.tokenizer, 2, 1)


@pytest.fixture(scope="module")
def run_dirs(datasets, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("runs")
    data = datasets["char"]
    save_model(root / "good", tiny_model(data.vocab_size), data.tokenizer)
    broken = tiny_model(data.vocab_size)
    with torch.no_grad():  # finite weights (loading refuses others) whose logits overflow
        broken.tok_emb.weight.mul_(100.0)
        broken.ln_f.weight.fill_(3e38)
    save_model(root / "broken", broken, data.tokenizer)
    return {"good": root / "good", "broken": root / "broken", "data": data.dir}


def refuse_constants(name: str) -> None:
    raise AssertionError(f"eval printed {name}, which is not JSON")


def test_eval_prints_bits_per_byte_beside_loss_and_perplexity(run_dirs, capsys):
    args = ["eval", str(run_dirs["good"]), "--data", str(run_dirs["data"]), "--device", "cpu",
            "--batch-size", "4", "--max-batches", "2"]
    capsys.readouterr()
    assert main(args) == 0
    line = capsys.readouterr().out
    assert "val loss" in line and "perplexity" in line and "bits per byte" in line
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out, parse_constant=refuse_constants)
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / math.log(2))
    assert result["tokens"] == result["bytes"] == 2 * 4 * 16


def test_eval_of_a_model_that_gives_no_finite_loss_is_one_error(run_dirs, capsys):
    capsys.readouterr()
    assert main(["eval", str(run_dirs["broken"]), "--data", str(run_dirs["data"]), "--json",
                 "--device", "cpu", "--max-batches", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "not a usable number" in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_eval_windows_cover_the_split_without_overlap(datasets):
    """The byte count uses exactly the targets the loss uses: ids[1 : tokens + 1]."""
    data = datasets["char"]
    ids = np.asarray(data.splits["val"])
    result = evaluate(tiny_model(data.vocab_size), ids, data.tokenizer, 64, 100)
    assert result.tokens == (len(ids) - 1) // 16 * 16


def test_eval_windows_take_the_context_asked_and_say_so(run_dirs, capsys):
    args = ["eval", str(run_dirs["good"]), "--data", str(run_dirs["data"]), "--device", "cpu",
            "--batch-size", "4", "--max-batches", "2", "--json"]
    capsys.readouterr()
    assert main([*args, "--context", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["context"] == 8 and result["tokens"] == 2 * 4 * 8
    assert main([*args[:-1], "--context", "8"]) == 0
    assert "windows of 8 tokens" in capsys.readouterr().out
    assert main([*args, "--context", "17"]) == 2  # the model holds 16
    assert "context=17 is longer than the model's block_size=16" in capsys.readouterr().err


def test_a_long_context_and_a_large_vocabulary_make_smaller_default_windows_and_batches():
    from glassgpt.training.evaluate import eval_batch_size, eval_context
    assert eval_context(64) == 64 and eval_context(40_960) == 2048  # Qwen3-0.6B's context
    assert eval_context(40_960, 512) == 512
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ConfigError, match="positive number of tokens"):
            eval_context(64, bad)
    assert eval_batch_size(64, 65) == 32  # a char model: the old default
    assert eval_batch_size(1024, 50_257) == 5  # GPT-2: five windows' logits within 1 GiB
    assert eval_batch_size(2048, 151_936) == 1  # one window of Qwen3's, never none
