"""`glassgpt finetune RUN --sft DATA.jsonl --out RUN2`: a tiny run fine-tuned on conversations
through the command line, its loss on the assistant's replies falling, resumed, shown, and
tuned with LoRA adapters that leave the base weights as they were."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import TINY_TRAIN_FLAGS
from glassgpt.cli import main
from glassgpt.data import prepare
from glassgpt.errors import ConfigError
from glassgpt.rundir.checkpoint import Run
from glassgpt.storage.layout import CHAT_TEMPLATE_FILE, MODEL_FILE
from helpers_cli import glassgpt, one_error_line

# Sums of two digits: a reply the model can learn in a few dozen steps.
TUNE = ["--max-iters", "40", "--eval-interval", "20", "--eval-iters", "4", "--lr", "1e-2",
        "--warmup-iters", "0", "--lr-decay-iters", "40", "--batch-size", "8", "--threads", "1",
        "--device", "cpu"]


def conversation(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"add {a} {b}"},
                         {"role": "assistant", "content": str(a + b)}]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny char-level run whose vocabulary holds the simple template's characters, and a
    file of conversations (one without a reply, to be skipped)."""
    root = tmp_path_factory.mktemp("finetune")
    text = "".join(f"<|system|>\nTo be or not to be.\n<|user|>\nadd {i % 10} {i % 7}\n"
                   f"<|assistant|>\n{i % 10 + i % 7}<|end|>\n" for i in range(200))
    (root / "text.txt").write_text(text, encoding="utf-8")
    prepare(root / "data", root / "text.txt")
    flags = [*TINY_TRAIN_FLAGS]
    flags[flags.index("--block-size") + 1] = "48"  # a whole conversation in one window
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"),
                 "--max-iters", "3", "--eval-interval", "3", *flags]) == 0
    rng = random.Random(0)
    lines = [json.dumps(conversation(rng.randrange(10), rng.randrange(10))) for _ in range(60)]
    lines.insert(5, json.dumps({"messages": [{"role": "user", "content": "add 1 1"}]}))
    (root / "chats.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"run": root / "run", "sft": root / "chats.jsonl", "root": root}


def reply_loss(run_dir: Path, pairs: list[tuple[int, int]]) -> float:
    """Mean cross-entropy of the run's model on the replies' characters (the sum and <|end|>)
    of `pairs`, each conversation scored alone: the positions found here from the text, not
    from glassgpt.data.sft's mask."""
    model, tokenizer = Run(run_dir).load_model()
    losses = []
    for a, b in pairs:
        prompt = f"<|user|>\nadd {a} {b}\n<|assistant|>\n"
        reply = f"{a + b}<|end|>"
        ids = torch.tensor([tokenizer.encode(prompt + reply)])
        with torch.no_grad():
            logits, _ = model(ids[:, :-1])
        first = len(prompt) - 1  # the logit that predicts the reply's first character
        losses.append(F.cross_entropy(logits[0, first:], ids[0, first + 1:]))
    return torch.stack(losses).mean().item()


HELD_OUT = [(3, 4), (9, 9), (0, 5), (7, 2)]


def test_finetune_trains_the_replies_and_keeps_the_template(tiny, tmp_path: Path,
                                                            capsys) -> None:
    out = tmp_path / "tuned"
    assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--out", str(out),
                 *TUNE]) == 0
    summary = capsys.readouterr().out
    assert "1 conversation without an assistant reply skipped (lines 6)" in summary
    assert "glassgpt's simple chat template" in summary
    before, after = reply_loss(tiny["run"], HELD_OUT), reply_loss(out, HELD_OUT)
    assert after < before - 0.5, (before, after)
    evaluations = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                   if "val_loss" in r]
    assert evaluations[-1]["val_loss"] < evaluations[0]["val_loss"] - 0.5
    run = Run(out)
    assert run.chat_template().end_of_turn == "<|end|>"  # what it was tuned with
    assert run.extra["init_from"] == str(tiny["run"]) and run.extra["sft"] == str(tiny["sft"])
    assert run.model_config == Run(tiny["run"]).model_config
    # `sample --chat` replies through the simple template and stops at its <|end|>, which a
    # character vocabulary writes in five tokens.
    assert main(["sample", str(out), "--chat", "add 3 4", "--temperature", "0",
                 "--max-new-tokens", "20"]) == 0
    reply = capsys.readouterr().out
    assert "<|end|>" not in reply and len(reply.strip()) <= 20


def test_resume_continues_to_the_same_weights(tiny, tmp_path: Path, capsys) -> None:
    """20 iterations then a resume to 40 end where 40 in one go end (and keep the template)."""
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--out", str(whole),
                 *TUNE]) == 0
    first = [*TUNE]
    first[first.index("--max-iters") + 1] = "20"
    assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--out",
                 str(halves), *first]) == 0
    assert main(["finetune", "--resume", "--out", str(halves), "--max-iters", "40",
                 "--threads", "1"]) == 0
    assert "(20 -> 40)" in capsys.readouterr().out
    a, b = load_file(whole / MODEL_FILE), load_file(halves / MODEL_FILE)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert (halves / CHAT_TEMPLATE_FILE).read_text() == (whole / CHAT_TEMPLATE_FILE).read_text()


def test_show_mask_prints_the_trained_tokens_and_exits(tiny, tmp_path: Path, capsys) -> None:
    assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--show-mask"]) == 0
    first = json.loads(tiny["sft"].read_text().splitlines()[0])["messages"]
    a, b = first[0]["content"].split()[1:]
    assert capsys.readouterr().out == (f"<|user|>\nadd {a} {b}\n<|assistant|>\n"
                                       f"[[{int(a) + int(b)}<|end|>]]\n\n")
    assert not (tmp_path / "tuned").exists()


def test_bad_input_is_one_line_and_writes_nothing(tiny, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(conversation(1, 2)) + '\n{"messages": [{"role": "bot", '
                   '"content": "x"}]}\n', encoding="utf-8")
    code, err = glassgpt("finetune", tiny["run"], "--sft", bad, "--out", tmp_path / "x",
                         capsys=capsys)
    assert code == 2 and f"{bad}:2: message 1 has role 'bot'" in one_error_line(err)
    code, err = glassgpt("finetune", tiny["run"], "--out", tmp_path / "x", capsys=capsys)
    assert code == 2 and "--sft" in one_error_line(err)
    code, err = glassgpt("finetune", tiny["run"], "--sft", tiny["sft"], "--out",
                         tmp_path / "x", "--lora-targets", "q,zz", "--lora-rank", "2",
                         capsys=capsys)
    assert code == 2 and "--lora-targets" in one_error_line(err)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("base_dtype", ["bfloat16", "float32"])
def test_lora_trains_adapters_only(tiny, tmp_path: Path, capsys, base_dtype: str) -> None:
    pytest.importorskip("glassgpt.formats.peft")
    out = tmp_path / "lora"
    assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--out", str(out),
                 "--lora-rank", "4", "--base-dtype", base_dtype, "--snapshots", "3", *TUNE]) == 0
    # Its snapshots (issue 55) are the tuned model: the last one loads as the run does.
    snapshot = Run(out).load_model(checkpoint="step:40")[0].state_dict()
    assert all(torch.equal(t, snapshot[k]) for k, t in
               Run(out).load_model(checkpoint="last")[0].state_dict().items())
    dtype = getattr(torch, base_dtype)
    # The base is frozen: stored as it was tuned (a bf16 base rounded once, nothing more).
    base = {name: t.to(dtype) for name, t in
            load_file(Run(tiny["run"]).weights_file("best")[1]).items()}
    tuned = load_file(out / MODEL_FILE)
    assert all(torch.equal(base[name], tuned[name]) for name in base)
    assert Run(out).extra["base_dtype"] == base_dtype
    assert json.loads((out / "adapter.json").read_text())["rank"] == 4
    # The run loads as its base with the adapters merged in: it has learnt the replies.
    assert reply_loss(out, HELD_OUT) < reply_loss(tiny["run"], HELD_OUT) - 0.1
    evaluations = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                   if "val_loss" in r]
    assert evaluations[-1]["val_loss"] < evaluations[0]["val_loss"] - 0.1
    # Resumed: the base read back with its adapters, unmerged, trained on.
    assert main(["finetune", "--resume", "--out", str(out), "--max-iters", "50",
                 "--threads", "1"]) == 0
    assert "(40 -> 50)" in capsys.readouterr().out
    assert all(torch.equal(base[name], t) for name, t in load_file(out / MODEL_FILE).items())


def test_val_conversations_are_held_out_or_given(tiny, tmp_path: Path) -> None:
    from glassgpt.training.finetune import sft_data

    source = Run(tiny["run"])
    held = sft_data(source, tiny["sft"]).splits  # 60 with a reply: the last 6 held out
    assert [len(held[s].examples) for s in ("train", "val")] == [54, 6]
    assert held["train"].skipped == [6]
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps(conversation(2, 2)) + "\n", encoding="utf-8")
    given = sft_data(source, tiny["sft"], val).splits
    assert [len(given[s].examples) for s in ("train", "val")] == [60, 1]
    assert given["val"].trained_tokens == len("4<|end|>")


def test_an_imported_instruct_model_is_tuned_through_its_own_template(tmp_path: Path,
                                                                      capsys) -> None:
    """A tiny random Qwen3 (test_chat's): its template renders the conversations, RUN2 keeps
    it, and `sample --chat` of RUN2 replies through it, stopping at <|im_end|>."""
    pytest.importorskip("transformers")
    from test_chat import QWEN3_TEMPLATE
    from test_chat import qwen3_source as make_source

    source = make_source.__wrapped__(tmp_path, _small_text(tmp_path))
    run, out = tmp_path / "run", tmp_path / "tuned"
    assert main(["convert", "--from-hf", str(source), "--out", str(run)]) == 0
    sft = tmp_path / "chats.jsonl"
    sft.write_text("".join(json.dumps(conversation(a, b)) + "\n" for a in range(4)
                           for b in range(4)), encoding="utf-8")
    capsys.readouterr()
    assert main(["finetune", str(run), "--sft", str(sft), "--show-mask"]) == 0
    assert capsys.readouterr().out == ("<|im_start|>user\nadd 0 0<|im_end|>\n<|im_start|>"
                                       "assistant\n[[<think>\n\n</think>\n\n0<|im_end|>]]"
                                       "\n\n")
    assert main(["finetune", str(run), "--sft", str(sft), "--out", str(out),
                 "--max-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                 "--batch-size", "2", "--threads", "1", "--device", "cpu"]) == 0
    assert "the run's chat template" in capsys.readouterr().out
    assert Run(out).chat_template().template == QWEN3_TEMPLATE
    assert main(["sample", str(out), "--chat", "add 1 2", "--temperature", "0",
                 "--max-new-tokens", "20", "--device", "cpu"]) == 0


def _small_text(tmp_path: Path) -> Path:
    path = tmp_path / "small.txt"
    path.write_text("".join(f"To be or not to be, line {i}: that is the question.\n"
                            for i in range(200)), encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_task_the_run_cannot_do_is_learned_eval_from_near_0_to_near_1(tiny, tmp_path: Path,
                                                                        capsys) -> None:
    """The demo of docs/finetune.md at a reduced size: "add a 1" answered with a + 1, scored by
    `glassgpt eval --task` (generate-until, exact match) on the prompts the simple template
    renders, before the tune and after it. Rotary positions: the answer reads a digit a fixed
    distance back, which relative positions find in hundreds of steps, not thousands."""
    from glassgpt.data.sft import simple_template
    from glassgpt.tokenizers.chat import chat_messages

    base = tmp_path / "base"
    flags = [*TINY_TRAIN_FLAGS]
    for flag, value in (("--n-layer", "2"), ("--n-embd", "32"), ("--block-size", "48")):
        flags[flags.index(flag) + 1] = value
    assert main(["train", "--data", str(tiny["root"] / "data"), "--out", str(base),
                 "--max-iters", "3", "--eval-interval", "3", "--position", "rope",
                 *flags]) == 0
    template = simple_template()
    task = tmp_path / "successor.jsonl"
    items = [{"kind": "generate_until", "answer": str(a + 1), "until": ["<|end|>"],
              "max_tokens": 8, "context": template.render(chat_messages(f"add {a} 1", None))}
             for a in range(9)]
    task.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    chats = tmp_path / "successor_chats.jsonl"
    rng = random.Random(1)
    chats.write_text("".join(json.dumps(conversation(a, 1)) + "\n"
                             for a in (rng.randrange(9) for _ in range(80))), encoding="utf-8")
    capsys.readouterr()

    def exact_match(run: Path) -> float:
        assert main(["eval", str(run), "--task", str(task), "--json"]) == 0
        return json.loads(capsys.readouterr().out)["metrics"]["exact_match"]

    before = exact_match(base)
    out = tmp_path / "tuned"
    # The answer appears suddenly (a head must find the digit's offset), at a step that moves
    # with the CPU's float rounding as with the seed. These settings were chosen for their
    # margin: over seeds 0-7 (AVX-512 kernels, and seeds 0-3 on the AVX2 ones) every tune had
    # exact match 1.0 at 1000 steps, and 6 of 8 at 700 already; TUNE's batch of 8 at lr 1e-2
    # reached 1.0 only by chance (0.11-1.0 over seeds 0-5 at 1000 steps).
    tune = [*TUNE, "--batch-size", "16", "--lr", "5e-3", "--weight-decay", "0",
            "--warmup-iters", "50"]
    tune[tune.index("--max-iters") + 1] = tune[tune.index("--lr-decay-iters") + 1] = "1000"
    tune[tune.index("--eval-interval") + 1] = "1000"
    assert main(["finetune", str(base), "--sft", str(chats), "--out", str(out), *tune]) == 0
    capsys.readouterr()
    after = exact_match(out)
    assert before <= 0.2 and after >= 0.7, (before, after)


def test_a_tune_starts_from_a_peft_adapter(tiny, tmp_path: Path, capsys) -> None:
    """`finetune --adapter DIR` starts from the adapters peft's files hold: tuned, exported in
    peft's format, and read back as a new tune's starting point (at an lr of 1e-12 they come
    out as they went in)."""
    first = tmp_path / "first"
    assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--out", str(first),
                 "--lora-rank", "4", *TUNE]) == 0
    assert main(["convert", str(first), "--to-hf", str(tmp_path / "hf"), "--adapter"]) == 0
    again = tmp_path / "again"
    tune = [*TUNE]
    tune[tune.index("--lr") + 1] = "1e-12"
    tune[tune.index("--max-iters") + 1] = tune[tune.index("--eval-interval") + 1] = "1"
    tune[tune.index("--lr-decay-iters") + 1] = "1"
    assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--out", str(again),
                 "--adapter", str(tmp_path / "hf" / "adapter"), *tune]) == 0
    before = load_file(first / "adapter.safetensors")
    after = load_file(again / "adapter.safetensors")
    assert set(before) == set(after) and any(t.abs().sum() > 0 for t in before.values())
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, atol=1e-6, rtol=0)
    capsys.readouterr()
    assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--out",
                 str(tmp_path / "x"), "--adapter", str(tmp_path / "hf" / "adapter"),
                 "--lora-rank", "2"]) == 2
    assert "brings its own LoRA settings" in capsys.readouterr().err


def test_recomputing_the_blocks_trains_the_same_weights(tiny, tmp_path: Path) -> None:
    """`--recompute` trades memory for a second forward of each block: the tune is the same,
    and a resume keeps recomputing."""
    tune = [*TUNE]
    tune[tune.index("--max-iters") + 1] = tune[tune.index("--lr-decay-iters") + 1] = "8"
    tune[tune.index("--eval-interval") + 1] = "4"
    for name, extra in (("kept", []), ("recomputed", ["--recompute"])):
        assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--out",
                     str(tmp_path / name), *tune, *extra]) == 0
    kept = load_file(tmp_path / "kept" / "model.safetensors")
    recomputed = load_file(tmp_path / "recomputed" / "model.safetensors")
    for name, tensor in kept.items():
        torch.testing.assert_close(recomputed[name], tensor, atol=1e-6, rtol=0)
    assert Run(tmp_path / "recomputed").extra["recompute"] is True
    tune[tune.index("--max-iters") + 1] = "10"
    assert main(["finetune", "--resume", "--out", str(tmp_path / "recomputed"), *tune]) == 0


def test_base_dtype_is_bf16_under_lora_where_the_cpu_has_it() -> None:
    from glassgpt.machine.devices import cpu_bf16_support
    from glassgpt.training.finetune import frozen_base_dtype

    cpu = torch.device("cpu")
    expected = torch.bfloat16 if cpu_bf16_support() else torch.float32
    assert frozen_base_dtype("auto", True, cpu) == expected
    assert frozen_base_dtype("float32", True, cpu) == torch.float32
    assert frozen_base_dtype("auto", False, cpu) == torch.float32  # all weights train
    with pytest.raises(ConfigError, match="base_dtype bfloat16 needs LoRA"):
        frozen_base_dtype("bfloat16", False, cpu)


def test_training_windows_are_seq_len_tokens(tiny, tmp_path: Path, capsys,
                                            monkeypatch) -> None:
    from glassgpt.data import sft
    from glassgpt.training.finetune import finetune_run

    windows = []
    real = sft.ConversationSampler.__init__

    def recording(self, ids, trained, block_size, *args, **kwargs) -> None:
        windows.append(block_size)
        real(self, ids, trained, block_size, *args, **kwargs)
    monkeypatch.setattr(sft.ConversationSampler, "__init__", recording)
    out = finetune_run(tiny["run"], tiny["sft"], tmp_path / "short", seq_len=16,
                       train={"max_iters": 2, "eval_interval": 2, "eval_iters": 1,
                              "device": "cpu"}, threads=1)
    assert Run(out.run_dir).extra["seq_len"] == 16 and windows and set(windows) == {16}
    code, err = glassgpt("finetune", tiny["run"], "--sft", tiny["sft"], "--out",
                         tmp_path / "long", "--seq-len", "49", capsys=capsys)
    assert code == 2 and "--seq-len 49 is more than the model's context (48)" in \
        one_error_line(err)
