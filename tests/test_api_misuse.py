"""Careless calls of the Python API and the command line: each is a `glassgpt.errors` exception
(one line from the CLI) naming the value, never a torch or Python error from deep inside."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from conftest import tiny_config, tiny_gpt
from glassgpt.attention import MultiHeadSelfAttention
from glassgpt.block import TransformerBlock
from glassgpt.cli import main
from glassgpt.decoding.generate import generate, sample_next_token
from glassgpt.errors import ConfigError, GlassGPTError, InputError
from glassgpt.machine.devices import resolve_device
from glassgpt.model import GPT, TransformerLM

V = 13


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return tiny_gpt(vocab_size=V, block_size=8, n_layer=1, n_embd=8).eval()


IDX = torch.tensor([[1, 2, 3]])
CALLS: dict[str, tuple[Callable[[GPT], object], type[GlassGPTError], str]] = {
    "float ids": (lambda m: m(IDX.float()), InputError, "must be integers"),
    "bool ids": (lambda m: m(IDX.bool()), InputError, "must be integers"),
    "targets of another shape": (lambda m: m(IDX, IDX[:, :2]), InputError,
                                 r"shape of the token ids \(1, 3\)"),
    "targets outside the vocabulary": (lambda m: m(IDX, IDX + V), InputError, "target 16"),
    "float targets": (lambda m: m(IDX, IDX.float()), InputError, "targets must be integers"),
    "temperature='hot'": (lambda m: generate(m, IDX, temperature="hot"), InputError,
                          "temperature must be float"),
    "temperature nan": (lambda m: generate(m, IDX, temperature=float("nan")), InputError,
                        "finite"),
    "top_k=0.5": (lambda m: generate(m, IDX, top_k=0.5), InputError, "top_k must be int"),
    "max_new_tokens=2.5": (lambda m: generate(m, IDX, max_new_tokens=2.5), InputError,
                           "max_new_tokens must be int"),
    "seed 2**64": (lambda m: generate(m, IDX, seed=2**64), InputError, "too large"),
    "an unknown setting": (lambda m: generate(m, IDX, temprature=0.5), InputError,
                           r"unknown sampling settings \['temprature'\]"),
    "a positional max_new_tokens": (lambda m: generate(m, IDX, 5), InputError,
                                    "give settings by name"),
    "an unknown engine": (lambda m: generate(m, IDX, engine="warp"), InputError,
                          "unknown decoding engine 'warp'"),
}


CALLS |= {
    "a nested list of ids": (lambda m: m([[1, 2]]), InputError, "torch tensor of integers"),
    "a numpy array of ids": (lambda m: m(IDX.numpy()), InputError, "got ndarray"),
    "uint8 ids": (lambda m: m(IDX.to(torch.uint8)), InputError, "dtype torch.uint8"),
    "ids on the meta device": (lambda m: m(IDX.to("meta")), InputError, "meta device"),
    "int16 ids": (lambda m: m(IDX.to(torch.int16)), InputError, "dtype torch.int16"),
    "uint8 targets": (lambda m: m(IDX, IDX.to(torch.uint8)), InputError,
                      "targets must be integers"),
    "int32 targets": (lambda m: m(IDX, IDX.int()), InputError, "targets must be integers"),
}


@pytest.mark.parametrize("case", CALLS)
def test_a_careless_call_is_a_glassgpt_error(model, case):
    call, error, message = CALLS[case]
    with pytest.raises(error, match=message):
        call(model)


def test_a_tiny_temperature_samples_the_top_token_instead_of_failing():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    for temperature in (1e-45, 1e-30, 1e-8):
        assert sample_next_token(logits, temperature=temperature).item() == 1


@pytest.mark.parametrize(("name", "message"), [
    ("meta", "cannot train or sample here"), ("xla", "unknown device|cannot train"),
    ("banana", "unknown device 'banana'"), ("cuda:7", "CUDA|cuda"),
])
def test_a_device_this_machine_lacks_is_a_config_error(name, message):
    if name == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.fail("this test expects fewer than 8 GPUs")
    with pytest.raises(ConfigError, match=message):
        resolve_device(name)


@pytest.mark.parametrize("argv", [
    ["train", "--n-embd", str(2**70)],
    ["train", "--batch-size", str(2**64)],
    ["train", "--seed", str(2**64)],
    ["sample", "nowhere", "--seed", str(2**64)],
    ["train", "--device", "meta"],
    ["train", "--lr", "nan"],
    ["demo", "shapes", "--seed", str(2**64)],
    ["demo", "shapes", "--seq-len", "100000"],
    ["demo", "shapes", "--d-model", str(10**23)],
])
def test_numbers_out_of_reach_on_the_command_line_are_one_line(argv, capsys, tmp_path,
                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


# --- the glass's own modules (issue 19's API rows) ----------------------------------------

@pytest.mark.parametrize("module", [
    lambda: MultiHeadSelfAttention(8, 2), lambda: TransformerBlock(8, 2)])
@pytest.mark.parametrize(("x", "message"), [
    (torch.randn(2, 3, 6), r"shape \(B, T, C=8\), got \(2, 3, 6\)"),  # width
    (torch.randn(3, 8), r"shape \(B, T, C=8\), got \(3, 8\)"),  # rank
    (torch.randn(2, 3, 8, dtype=torch.float64), "x is torch.float64 but its weights are "
     "torch.float32"),
    (torch.ones(2, 3, 8, dtype=torch.long), "floating-point x, got dtype torch.int64"),
    ([[0.0] * 8], "takes a tensor"),
])
def test_a_wrong_input_to_attention_or_a_block_is_an_input_error_naming_it(module, x, message):
    with pytest.raises(InputError, match=message):
        module()(x)


X = torch.randn(2, 3, 8)
PAD = torch.zeros(2, 3, dtype=torch.bool)


@pytest.mark.parametrize("module", [
    lambda: MultiHeadSelfAttention(8, 2), lambda: TransformerBlock(8, 2)])
@pytest.mark.parametrize("return_attn", [False, True], ids=["fused", "weights"])
@pytest.mark.parametrize(("x", "pad_mask", "message"), [
    (torch.randn(2, 0, 8), None, r"one position \(T\), got shape \(2, 0, 8\)"),
    (torch.randn(0, 3, 8), None, r"one sequence \(B\).*\(0, 3, 8\)"),
    (X, PAD[0], r"pad_mask must be of shape \(B=2, S\).*got \(3,\)"),
    (X, PAD[:, None].expand(2, 3, 3), r"got \(2, 3, 3\)"),
    (X, torch.zeros(3, 3, dtype=torch.bool), r"\(B=2, S\).*got \(3, 3\)"),
    (X, torch.tensor(False), r"got \(\)"),
    (X, PAD.long(), "bool tensor.*got dtype torch.int64.*attention_mask == 0"),
    (X, PAD.float(), "got dtype torch.float32"),
    (X, [[False] * 3] * 2, "bool tensor .*got list"),
    (X, PAD.to("meta"), "pad_mask is on meta but x is on cpu"),
], ids=["T=0", "B=0", "mask 1-D", "mask 3-D", "mask of 3 rows", "mask 0-D", "int mask",
        "float mask", "list mask", "meta mask"])
def test_an_empty_stream_or_a_pad_mask_that_does_not_fit_is_an_input_error(
        module, return_attn, x, pad_mask, message):
    """They were torch's RuntimeError or IndexError from inside the mask, or, an integer
    attention_mask of 1 on real tokens (Hugging Face's), every key hidden without a word."""
    with pytest.raises(InputError, match=message):
        module()(x, pad_mask, return_attn=return_attn)


def test_a_pad_mask_of_one_row_still_covers_every_sequence():
    attn = MultiHeadSelfAttention(8, 2).eval()
    one_row = torch.tensor([[False, False, True]])
    y, weights = attn(X, one_row, return_attn=True)
    assert torch.equal(weights[:, :, 2, 2], torch.zeros(2, 2))  # key 2 hidden from both rows
    assert torch.allclose(y, attn(X, one_row.expand(2, 3)), atol=1e-6)


def test_an_empty_prompt_is_an_input_error_naming_its_shape(model):
    with pytest.raises(InputError, match=r"at least one sequence of one token, got shape "
                                         r"\(1, 0\)"):
        model(IDX[:, :0])


def test_a_block_under_autocast_takes_the_precision_autocast_chose():
    block = TransformerBlock(8, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert block(torch.randn(1, 3, 8).to(torch.bfloat16)).shape == (1, 3, 8)


@pytest.mark.parametrize("d_model", [8.0, True, "8", 2**40])
@pytest.mark.parametrize("build", [
    lambda d: MultiHeadSelfAttention(d, 2), lambda d: TransformerBlock(d, 2),
    lambda d: TransformerLM(11, d, 2, 1, 8)])
def test_a_width_that_is_not_a_sane_int_is_a_config_error(d_model, build):
    with pytest.raises(ConfigError, match="d_model|n_embd"):
        build(d_model)


@pytest.mark.parametrize("config", [{"n_layer": 1}, None])
def test_gpt_takes_a_gptconfig_only(config):
    with pytest.raises(ConfigError, match="GPT takes a GPTConfig"):
        GPT(config)


def test_a_config_field_changed_after_construction_is_checked():
    config = tiny_config(vocab_size=V, block_size=8, n_layer=1, n_embd=8)
    with pytest.raises(ConfigError, match="n_layer must be positive, got -3"):
        config.n_layer = -3
    assert config.n_layer == 1


def test_targets_that_are_all_minus_one_give_loss_zero_not_nan(model):
    logits, loss = model(IDX, torch.full_like(IDX, -1))
    assert loss.item() == 0.0 and logits.shape == (1, 3, V)
