"""Fine-tuning, its conversations, task files and the eval of a tuned run, from a new user's
side and a hostile one (issue 51): one error line for each mistake with nothing written, lines
split as JSON Lines are, `eval RUN2` of a fine-tuned run, and what the messages and the model
card say about a LoRA tune."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_TRAIN_FLAGS
from glassgpt.adapters.lora import add_lora
from glassgpt.adapters.settings import LoraSettings
from glassgpt.cli import main
from glassgpt.data import prepare
from glassgpt.data.sft import read_conversations
from glassgpt.errors import InputError
from glassgpt.evals import parse_task
from glassgpt.formats.peft import ADAPTER_CONFIG_FILE, save_adapter
from glassgpt.rundir.checkpoint import Run
from helpers_cli import glassgpt, one_error_line

TUNE = ["--max-iters", "2", "--eval-interval", "2", "--eval-iters", "1", "--batch-size", "2",
        "--threads", "1", "--device", "cpu"]


def conversation(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"add {a} {b}"},
                         {"role": "assistant", "content": str(a + b)}]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny char-level run whose vocabulary holds the simple template's characters, its
    conversations, and a LoRA tune of it with one held-out conversation of its own."""
    root = tmp_path_factory.mktemp("hostile_finetune")
    text = "".join(f"<|system|>\nTo be or not to be.\n<|user|>\nadd {i % 10} {i % 7}\n"
                   f"<|assistant|>\n{i % 10 + i % 7}<|end|>\n" for i in range(60))
    (root / "text.txt").write_text(text, encoding="utf-8")
    prepare(root / "data", root / "text.txt")
    flags = [*TINY_TRAIN_FLAGS]
    flags[flags.index("--block-size") + 1] = "48"  # a whole conversation in one window
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"),
                 "--max-iters", "1", "--eval-interval", "1", *flags]) == 0
    (root / "chats.jsonl").write_text("".join(json.dumps(conversation(a, a % 7)) + "\n"
                                              for a in range(10)), encoding="utf-8")
    (root / "val.jsonl").write_text(json.dumps(conversation(2, 2)) + "\n", encoding="utf-8")
    assert main(["finetune", str(root / "run"), "--sft", str(root / "chats.jsonl"), "--val-sft",
                 str(root / "val.jsonl"), "--out", str(root / "lora"), "--lora-rank", "2",
                 "--lora-alpha", "3", *TUNE]) == 0
    return {"root": root, "run": root / "run", "sft": root / "chats.jsonl",
            "lora": root / "lora", "data": root / "data"}


# --- reading JSON Lines ---------------------------------------------------------------------

SEPARATORS = "\u2028\u2029\u0085"  # line breaks to str.splitlines(), characters to JSON


def test_a_raw_line_separator_inside_a_string_is_content_not_a_line_end(tmp_path: Path
                                                                        ) -> None:
    """Valid JSON Lines, CRLF line ends and all: U+2028, U+2029 and U+0085 may stand unescaped
    inside a JSON string, where str.splitlines() would cut the line."""
    reply = f"one{SEPARATORS}two"
    line = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": reply}]},
                      ensure_ascii=False)
    path = tmp_path / "chats.jsonl"
    path.write_bytes(f"{line}\r\n\r\n{line}\r\n".encode())
    conversations = read_conversations(path)
    assert [c.line for c in conversations] == [1, 3]
    assert conversations[0].messages[1]["content"] == reply
    item = json.dumps({"kind": "generate_until", "context": f"a{SEPARATORS}b", "answer": " c"},
                      ensure_ascii=False)
    task = parse_task(f"{item}\r\n{item}\n", "task.jsonl")
    assert len(task.items) == 2 and task.items[0].context == f"a{SEPARATORS}b"


def test_an_integer_of_thousands_of_digits_is_one_line_naming_it(tiny, tmp_path: Path,
                                                                   capsys) -> None:
    bad = tmp_path / "huge.jsonl"
    bad.write_text(json.dumps(conversation(1, 2)) + '\n{"messages": ' + "7" * 5000 + "}\n",
                   encoding="utf-8")
    with pytest.raises(InputError, match=r"huge.jsonl:2 is not valid JSON: .*5000 digits"):
        read_conversations(bad)
    code, err = glassgpt("finetune", tiny["run"], "--sft", bad, "--out", tmp_path / "x",
                         capsys=capsys)
    assert code == 2 and "huge.jsonl:2 is not valid JSON" in one_error_line(err)
    task = tmp_path / "task.jsonl"
    task.write_text('{"kind": "multiple_choice", "context": "a", "choices": ["b"], "gold": '
                    + "1" * 5000 + "}\n", encoding="utf-8")
    code, err = glassgpt("eval", tiny["run"], "--task", task, capsys=capsys)
    assert code == 2 and "task.jsonl line 1 is not valid JSON" in one_error_line(err)
    assert not (tmp_path / "x").exists()


# --- LoRA settings and adapters from the command line ----------------------------------------

@pytest.mark.parametrize("alpha", ["1e30", "-4", "0", "nan", "inf"])
def test_a_lora_alpha_that_cannot_train_is_one_line(tiny, tmp_path: Path, capsys,
                                                    alpha: str) -> None:
    code, err = glassgpt("finetune", tiny["run"], "--sft", tiny["sft"], "--out",
                         tmp_path / "x", "--lora-rank", "2", "--lora-alpha", alpha,
                         capsys=capsys)
    assert code == 2 and "LoRA alpha" in one_error_line(err)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("edit", "named"), [
    ({"rank_pattern": [6]}, "rank_pattern must be an object"),
    ({"lora_dropout": "x"}, "dropout must be a number"),
    ({"lora_alpha": 1e300}, "must be at most 256"),
    ({"target_modules": ["c_attn"]}, "its tensors adapt attn.c_proj, c_attn"),
])
def test_a_bad_peft_adapter_is_one_line_and_nothing_trains(tiny, tmp_path: Path, capsys,
                                                          edit: dict, named: str) -> None:
    model, _ = Run(tiny["run"]).load_model()
    add_lora(model, LoraSettings(rank=2, alpha=4.0))  # q, k, v, o: c_attn, attn.c_proj
    adapter = save_adapter(model, tmp_path / "adapter", base_model="tiny")
    config = json.loads((adapter / ADAPTER_CONFIG_FILE).read_text())
    (adapter / ADAPTER_CONFIG_FILE).write_text(json.dumps({**config, **edit}))
    code, err = glassgpt("finetune", tiny["run"], "--sft", tiny["sft"], "--out",
                         tmp_path / "x", "--adapter", adapter, *TUNE, capsys=capsys)
    assert code == 2 and named in one_error_line(err)
    assert not (tmp_path / "x").exists()


# --- where a run may be written --------------------------------------------------------------

@pytest.mark.parametrize("names", [("cfg.json", "sae_weights.safetensors"),
                                   ("adapter_config.json", "adapter_model.safetensors")])
def test_force_never_writes_a_run_into_a_dictionary_or_an_adapter(tiny, tmp_path: Path, capsys,
                                                                  names: tuple[str, str]
                                                                  ) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for name in names:
        (other / name).write_text("{}", encoding="utf-8")
    for force in ([], ["--force"]):
        code, err = glassgpt("finetune", tiny["run"], "--sft", tiny["sft"], "--out", other,
                             *TUNE, *force, capsys=capsys)
        assert code == 2 and f"({', '.join(names)}), not a run" in one_error_line(err)
        code, err = glassgpt("train", "--data", tiny["data"], "--out", other, *TINY_TRAIN_FLAGS,
                             *force, capsys=capsys)
        assert code == 2 and "not a run" in one_error_line(err)
    assert sorted(p.name for p in other.iterdir()) == sorted(names)


def test_a_resume_checks_its_run_against_the_source_from_any_directory(tiny, tmp_path: Path,
                                                                      capsys, monkeypatch
                                                                      ) -> None:
    """The source was recorded as given ("run"): from another directory, `--resume` with
    another run of that name was taken for the one the tune started from."""
    for place in ("a", "b"):
        shutil.copytree(tiny["run"], tmp_path / place / "run")
    monkeypatch.chdir(tmp_path / "a")
    tuned = tmp_path / "tuned"
    code, _ = glassgpt("finetune", "run", "--sft", tiny["sft"], "--out", tuned, *TUNE,
                       capsys=capsys)
    assert code == 0 and Run(tuned).extra["init_from"] == str(tmp_path / "a" / "run")
    monkeypatch.chdir(tmp_path / "b")
    code, err = glassgpt("finetune", "run", "--resume", "--out", tuned, "--max-iters", "3",
                         capsys=capsys)
    assert code == 2 and "differs from the run's" in one_error_line(err)


# --- eval of a fine-tuned run ----------------------------------------------------------------

def test_eval_of_a_fine_tuned_run_scores_its_held_out_replies(tiny, capsys) -> None:
    """`eval RUN2` scores the assistant's tokens of the conversations its val loss was
    measured on (here --val-sft's one), as the model predicts them after the prompt."""
    capsys.readouterr()
    assert main(["eval", str(tiny["lora"]), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    model, tokenizer = Run(tiny["lora"]).load_model()
    prompt, reply = "<|user|>\nadd 2 2\n<|assistant|>\n", "4<|end|>"
    ids = torch.tensor([tokenizer.encode(prompt + reply + "\n")])
    with torch.no_grad():
        logits, _ = model(ids[:, :-1])
    first = len(prompt) - 1  # the logit that predicts the reply's first character
    expected = F.cross_entropy(logits[0, first:first + len(reply)],
                               ids[0, first + 1:first + 1 + len(reply)]).item()
    assert shown["tokens"] == shown["bytes"] == len(reply)
    assert shown["loss"] == pytest.approx(expected, abs=1e-5)
    assert shown["bits_per_byte"] == pytest.approx(expected / math.log(2), abs=1e-5)
    assert "val.jsonl" in shown["conversations"]
    assert main(["eval", str(tiny["lora"]), "--split", "train"]) == 0
    line = capsys.readouterr().out
    assert "training conversations of" in line and "chats.jsonl" in line
    assert main(["eval", str(tiny["lora"]), "--data", str(tiny["data"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["conversations"] is None  # the corpus


def test_eval_of_a_tune_whose_conversations_are_gone_is_one_line(tiny, tmp_path: Path,
                                                                 capsys) -> None:
    sft = tmp_path / "gone.jsonl"
    sft.write_text("".join(json.dumps(conversation(a, 1)) + "\n" for a in range(4)),
                   encoding="utf-8")
    out = tmp_path / "tuned"
    assert main(["finetune", str(tiny["run"]), "--sft", str(sft), "--out", str(out),
                 *TUNE]) == 0
    sft.unlink()
    code, err = glassgpt("eval", out, capsys=capsys)
    assert code == 2 and "gone.jsonl, which is not there any more" in one_error_line(err)


def test_a_task_summary_gives_each_metric_its_own_item_count(tiny, tmp_path: Path,
                                                              capsys) -> None:
    choice = {"kind": "multiple_choice", "context": "add 1 1", "choices": ["2", "3"],
              "gold": 0}
    generation = {"kind": "generate_until", "context": "add 1 1\n", "answer": "2",
                  "max_tokens": 2}
    task = tmp_path / "mixed.jsonl"
    task.write_text("".join(json.dumps(item) + "\n" for item in
                            [choice, choice, generation, generation, generation]),
                    encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", str(tiny["run"]), "--task", str(task), "--threads", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("mixed: acc ") and "(2 multiple-choice items); exact_match " in line
    assert line.endswith("(3 generate-until items)")


# --- what the messages and the card say ------------------------------------------------------

def test_the_start_line_names_a_preset_only_when_one_was_asked_for(tiny, tmp_path: Path
                                                                   ) -> None:
    from glassgpt.training.lifecycle import start_line, train_run

    lines: list[str] = []
    sizes = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}
    train = {"max_iters": 1, "eval_interval": 1, "eval_iters": 1, "batch_size": 2,
             "device": "cpu"}
    for name, preset in (("sized", None), ("preset", "cpu-small")):
        train_run(tmp_path / name, data=tiny["data"], preset=preset, model=sizes, train=train,
                  threads=1, on_start=lambda start: lines.append(start_line(start)))
    model, _ = Run(tmp_path / "sized").load_model()
    count = f"{sum(p.numel() for p in model.parameters()):,}"  # a tiny model's: not 0.00M
    assert lines[0].startswith(f"training a model of {count} parameters, 1 layer, 2 heads, "
                               f"width 16, context 16 on cpu"), lines[0]
    assert "preset" not in lines[0]
    assert lines[1].startswith(f"training preset cpu-small ({count} parameters, 1 layer")


def test_a_lora_tune_says_its_parameters_are_the_adapters(tiny, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    assert main(["finetune", str(tiny["run"]), "--sft", str(tiny["sft"]), "--out",
                 str(tmp_path / "x"), "--lora-rank", "2", *TUNE]) == 0
    start = capsys.readouterr().err.splitlines()[0]
    model, _ = Run(tiny["run"]).load_model()
    add_lora(model, LoraSettings(rank=2, alpha=4.0))
    every = sum(p.numel() for p in model.parameters())  # the base's and the adapters'
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"({adapters:,} trainable adapter parameters of {every:,}, 1 layer" in start


def test_the_model_card_of_a_lora_run_gives_rank_alpha_and_targets(tiny) -> None:
    from glassgpt.view.inspector import RunView

    model, tokenizer = Run(tiny["lora"]).load_model()
    card = RunView(model, tokenizer, tiny["lora"]).card()
    assert card["lora"] == {"rank": 2, "alpha": 3.0, "scaling": 1.5, "dropout": 0.0,
                            "targets": ["q", "k", "v", "o"]}
    model, tokenizer = Run(tiny["run"]).load_model()
    assert RunView(model, tokenizer, tiny["run"]).card()["lora"] is None
