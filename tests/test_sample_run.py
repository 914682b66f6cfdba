"""`glassgpt sample` as one library call (glassgpt.decoding.session.sample_run), and the one
function that makes a model ready to decode in a dtype (glassgpt.decoding.prepare), which the
command and the decoding benchmarks share."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_gpt
from glassgpt.cli import main
from glassgpt.config import sampling_defaults
from glassgpt.decoding.blocks import has_blocks
from glassgpt.decoding.generate import generate
from glassgpt.decoding.prepare import decoding_model
from glassgpt.decoding.session import sample_run
from glassgpt.errors import ConfigError
from glassgpt.rundir.checkpoint import Run

SHORT = dataclasses.replace(sampling_defaults("sample"), max_new_tokens=6)


def test_sample_run_returns_what_glassgpt_sample_prints(trained_run, capsys) -> None:
    assert main(["sample", str(trained_run.run), "--max-new-tokens", "6", "--num-samples", "2",
                 "--device", "cpu", "--threads", "1"]) == 0
    printed = capsys.readouterr()
    done = sample_run(trained_run.run, sampling=SHORT, num_samples=2, device="cpu", threads=1)
    assert printed.out == "\n" + done.texts[0] + "\n" + "\n" + "-" * 40 + "\n" + "\n" \
        + done.texts[1] + "\n"
    assert printed.err.splitlines() == done.notes
    assert done.notes[0].startswith("sampling from the best weights") and done.threads == 1


def test_each_sample_is_heard_as_it_is_sampled_and_kept_whole(trained_run) -> None:
    heard: list[tuple[int, str]] = []

    def first_piece_only(index, pieces) -> None:
        heard.append((index, next(pieces)))  # the rest is read by sample_run itself

    done = sample_run(trained_run.run, "To be", sampling=SHORT, num_samples=2, device="cpu",
                      threads=1, on_sample=first_piece_only)
    assert [index for index, _ in heard] == [0, 1]
    assert all(text.startswith(piece) and len(text) > len(piece)
               for (_, piece), text in zip(heard, done.texts, strict=True))


def test_steering_hooks_run_at_every_step_and_are_noted(trained_run) -> None:
    calls: list[str] = []

    def steering(model):
        def watch(tensor, name):
            calls.append(name)
        return [("blocks.0.hook_resid_post", watch)], ["steering: watching"]

    done = sample_run(trained_run.run, sampling=SHORT, device="cpu", threads=1,
                      steering=steering)
    assert "steering: watching" in done.notes
    assert calls == ["blocks.0.hook_resid_post"] * 6  # the prefill, then five cached steps


def test_its_messages_name_arguments_as_python_does_or_as_flags(trained_run) -> None:
    with pytest.raises(ConfigError, match="num_samples must be positive, got 0"):
        sample_run(trained_run.run, num_samples=0)
    with pytest.raises(ConfigError, match="^system goes with chat"):
        sample_run(trained_run.run, system="Be brief.")
    with pytest.raises(ConfigError, match="continue text with --prompt instead"):
        sample_run(trained_run.run, chat="hi", wording="cli")


def test_one_function_makes_a_model_ready_in_each_dtype() -> None:
    model = tiny_gpt().eval()
    weight = model.lm_head.weight.clone()
    assert decoding_model(model).model is model  # float32: the model itself
    half = decoding_model(model, "bfloat16")
    assert half.model is not model and half.model.lm_head.weight.dtype == torch.bfloat16
    int8 = decoding_model(model, "int8")
    assert has_blocks(int8.model) and not int8.compiled  # the block kernel: nothing compiled
    assert has_blocks(decoding_model(model, "int4").model)
    assert decoding_model(model, "int8", compiled=True).compiled
    assert torch.equal(model.lm_head.weight, weight)  # left as it was
    with pytest.raises(ConfigError, match="float16"):
        decoding_model(model, "float16")


def test_a_ready_model_decodes_the_tokens_generate_gives() -> None:
    model = tiny_gpt().eval()
    prompt = torch.tensor([[1, 2, 3]])
    ready = decoding_model(model, "int8")
    assert torch.equal(ready.greedy(prompt, 5),
                       generate(ready.model, prompt, max_new_tokens=5, temperature=0.0))


def test_a_run_is_read_straight_into_its_dtype(trained_run) -> None:
    ready = decoding_model(Run(trained_run.run), "bfloat16", device="cpu")
    assert ready.model.lm_head.weight.dtype == torch.bfloat16 and ready.tokenizer is not None
