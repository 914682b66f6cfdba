"""What a fine-tune derives from its conversations when not told (issue 53, goal 6): the
training window from the longest conversation, the number of steps from the conversations'
size, and under LoRA a higher learning rate; anything given explicitly wins. These test the
derivation, not how well a tune learns (docs/finetune.md says what was measured)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_TRAIN_FLAGS
from glassgpt.cli import main
from glassgpt.data import prepare
from glassgpt.data.sft import simple_template
from glassgpt.rundir.checkpoint import Run
from glassgpt.training import finetune
from glassgpt.training.finetune import (
    LORA_LR_FACTOR,
    MAX_TUNE_ITERS,
    MIN_TUNE_ITERS,
    TUNE_EPOCHS,
    default_iterations,
    default_window,
    sft_data,
    tune_config,
)
from glassgpt.training.lifecycle import FINETUNE_LR_FACTOR, FINETUNE_WARMUP_FRACTION

BASE_LR = 2e-3


def chat(user: str, reply: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": [*messages, {"role": "user", "content": user},
                         {"role": "assistant", "content": reply}]}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny character-level run (context 64) whose vocabulary holds the simple template, and
    conversations of which one (with a system line) is the longest."""
    root = tmp_path_factory.mktemp("tune_defaults")
    text = "".join(f"<|system|>\nTo be.\n<|user|>\nadd {i % 10} {i % 7}\n<|assistant|>\n"
                   f"{i % 10 + i % 7}<|end|>\n" for i in range(100))
    (root / "text.txt").write_text(text, encoding="utf-8")
    prepare(root / "data", root / "text.txt")
    flags = [*TINY_TRAIN_FLAGS]
    flags[flags.index("--block-size") + 1] = "64"
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"),
                 "--max-iters", "3", "--eval-interval", "3", "--lr", str(BASE_LR),
                 *flags]) == 0
    chats = [chat(f"add {i % 10} {i % 7}", str(i % 10 + i % 7)) for i in range(30)]
    chats.insert(4, chat("add 1 2", "3", system="To be."))
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats), "utf-8")
    longest = max(len(simple_template().render(c["messages"], add_generation_prompt=False))
                  for c in chats)  # a token a character
    return {"run": root / "run", "sft": root / "chats.jsonl", "longest": longest}


def test_the_window_is_the_longest_conversation_within_the_context(base, monkeypatch) -> None:
    data = sft_data(Run(base["run"]), base["sft"])
    assert data.longest == base["longest"]
    assert default_window(data, 64) == base["longest"] < 64
    assert default_window(data, 16) == 16  # the model's context bounds it
    monkeypatch.setattr(finetune, "DEFAULT_SEQ_LEN", 8)
    assert default_window(data, 64) == 8  # and so does DEFAULT_SEQ_LEN


def test_the_steps_are_passes_over_the_conversations_within_bounds() -> None:
    per_step = 8 * 40
    middle = (MIN_TUNE_ITERS + MAX_TUNE_ITERS) // 2 * per_step // TUNE_EPOCHS
    assert default_iterations(middle, per_step) == -(-TUNE_EPOCHS * middle // per_step)
    assert MIN_TUNE_ITERS < default_iterations(middle, per_step) < MAX_TUNE_ITERS
    assert default_iterations(100, per_step) == MIN_TUNE_ITERS  # a small set: many passes
    assert default_iterations(10**9, per_step) == MAX_TUNE_ITERS  # a large one: capped


def test_lora_tunes_at_a_higher_lr_and_given_settings_win(base) -> None:
    run, tokens, window = Run(base["run"]), 5_000, 40
    steps = default_iterations(tokens, run.train_settings["batch_size"] * window)
    whole = tune_config(run, {}, tokens, window, adapted=False)
    assert whole.lr == pytest.approx(BASE_LR * FINETUNE_LR_FACTOR)
    assert (whole.max_iters, whole.lr_decay_iters) == (steps, 0)  # decays over the tune
    assert whole.warmup_iters == int(steps * FINETUNE_WARMUP_FRACTION)
    lora = tune_config(run, {}, tokens, window, adapted=True)
    assert lora.lr == pytest.approx(BASE_LR * FINETUNE_LR_FACTOR * LORA_LR_FACTOR)
    assert lora.min_lr == pytest.approx(whole.min_lr * LORA_LR_FACTOR)
    given = tune_config(run, {"lr": 1e-4, "max_iters": 7, "lr_decay_iters": 5}, tokens, window,
                        adapted=True)
    assert (given.lr, given.max_iters, given.lr_decay_iters) == (1e-4, 7, 5)
    assert given.min_lr == whole.min_lr  # the lr given: nothing scaled


def test_a_lora_tune_says_its_plan_and_trains_the_derived_window(base, tmp_path: Path,
                                                                 capsys) -> None:
    out = tmp_path / "tuned"
    capsys.readouterr()
    assert main(["finetune", str(base["run"]), "--sft", str(base["sft"]), "--out", str(out),
                 "--lora-rank", "2", "--max-iters", "2", "--eval-iters", "1", "--threads", "1",
                 "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    lr = BASE_LR * FINETUNE_LR_FACTOR * LORA_LR_FACTOR
    assert (f"; 2 steps of 4 windows of {base['longest']} tokens (" in err
            and f"tokens of 28 conversations), peak lr {lr:.3g}\n" in err), err
    run = Run(out)
    assert run.extra["seq_len"] == base["longest"]
    assert run.train_settings["lr"] == pytest.approx(lr)
