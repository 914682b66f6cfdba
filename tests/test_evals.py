"""Task evaluations (glassgpt.evals, `glassgpt eval RUN --task`): the same choices, scores and
generations as lm-eval's HFLM on the same model exported to Hugging Face, offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from glassgpt import GPT, GPTConfig
from glassgpt.cli import main
from glassgpt.errors import InputError
from glassgpt.evals import (
    ChoiceResult,
    GenerationResult,
    builtin_tasks,
    evaluate_task,
    load_task,
    parse_task,
)
from glassgpt.evals.tasks import MultipleChoice, Task
from glassgpt.formats.convert import export_run
from glassgpt.rundir.checkpoint import save_model
from glassgpt.tokenizers import BPETokenizer, CharTokenizer
from helpers_cli import glassgpt, one_error_line

LOGLIKELIHOOD_TOLERANCE = 1e-4
BLOCK_SIZE = 64
# Weights this large make a random model's choices decisive (no near ties between choices)
# and its greedy text varied.
WEIGHT_SCALE = 0.3

# Items where lm-eval's splitting matters: spaces and a newline ending the context (moved to the
# continuation), choices of other lengths (acc_norm), an empty context (the end-of-text token
# read instead) and a context longer than the window (its start cut off).
TRICKY_CHOICES = [
    {"context": "The cat sat on the ", "choices": ["mat", " mat", "moon and the stars"],
     "gold": 0},
    {"context": "Question: which is larger?\n", "choices": ["19", "7", "one hundred"],
     "gold": 2},
    {"context": "", "choices": ["the sun", "rain fell"], "gold": 1},
    {"context": "we went to the market " * 12 + "and", "choices": ["back", "home again"],
     "gold": 1},
    {"context": "Ünïcode café,", "choices": ["naïve", "plain", "ok"], "gold": 0},
]


def randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * WEIGHT_SCALE)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny random run with a BPE tokenizer, and its Hugging Face export."""
    base = tmp_path_factory.mktemp("evals")
    text = "".join(f"{a} + {b} = {a + b}\nQ: the cat sat on the mat, we went home.\n"
                   for a in range(20) for b in range(20))
    tokenizer = BPETokenizer.train(text + "Ünïcode café naïve", 400)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=BLOCK_SIZE, n_layer=2,
                          n_head=2, n_embd=32))
    randomize(model, seed=0)
    save_model(base / "run", model, tokenizer)
    export_run(base / "run", base / "hf")
    return {"base": base, "run": base / "run", "hf": base / "hf", "model": model.eval(),
            "tokenizer": tokenizer}


# --- lm-eval, offline -------------------------------------------------------------------------

def lm_eval_yaml(name: str, data: Path, cache: Path, kind: str, extra: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {json.dumps(str(data))}\n  cache_dir: {json.dumps(str(cache))}\n"
            f"test_split: test\noutput_type: {kind}\ndoc_to_text: context\n{extra}")


MC_YAML = ("doc_to_choice: choices\ndoc_to_target: gold\n"
           "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
GEN_YAML = ("doc_to_target: answer\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4\n"
            "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")


def run_lm_eval(hf_dir: Path, folder: Path, tasks: dict[str, tuple[str, list[dict]]],
                monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """lm-eval's results for each task name -> (output type, docs), read from local JSONL
    files through local YAML configs; nothing reaches the network."""
    for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    evaluator = pytest.importorskip("lm_eval.evaluator")
    # huggingface_hub and datasets read those variables once, when first imported (maybe by
    # an earlier test of this worker): their settings are set too.
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    folder.mkdir()
    for name, (kind, docs) in tasks.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
        extra = MC_YAML if kind == "multiple_choice" else GEN_YAML
        (folder / f"{name}.yaml").write_text(
            lm_eval_yaml(name, data, folder / "datasets", kind, extra), encoding="utf-8")
    # Only these tasks are indexed (lm-eval's own thousands are not read); lm_eval.evaluator's
    # evaluate, not simple_evaluate, which also collects the environment (seconds).
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    model = HFLM(pretrained=str(hf_dir), batch_size=1, device="cpu")
    return evaluator.evaluate(model, manager.load(list(tasks)), log_samples=True,
                              bootstrap_iters=0)


def samples_by_doc(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return sorted(results["samples"][name], key=lambda sample: sample["doc_id"])


def mc_docs(task: Task) -> list[dict]:
    return [{"context": item.context, "choices": list(item.choices), "gold": item.gold}
            for item in task.items if isinstance(item, MultipleChoice)]


def test_scores_equal_lm_evals(exported: dict[str, Any], tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = exported["model"], exported["tokenizer"]
    builtin = load_task("builtin:arithmetic")
    tricky = parse_task("".join(json.dumps({"kind": "multiple_choice", **item}) + "\n"
                                for item in TRICKY_CHOICES), "tricky")
    choices = Task("choices", tuple(i for task in (builtin, tricky) for i in task.items
                                    if isinstance(i, MultipleChoice)), "both")
    ours = evaluate_task(model, tokenizer, choices)
    # Half the generate-until answers are the model's own text, so exact_match is 1 there and
    # 0 where the answer is that text plus a space (no stripping) or the builtin's answer.
    generations = generation_docs(model, tokenizer, builtin)
    ours_gen = evaluate_task(model, tokenizer, parse_task(
        "".join(json.dumps({"kind": "generate_until", "until": ["\n"], "max_tokens": 4, **doc})
                + "\n" for doc in generations), "generations"))
    theirs = run_lm_eval(exported["hf"], tmp_path / "lm_eval",
                         {"glass_mc": ("multiple_choice", mc_docs(choices)),
                          "glass_gen": ("generate_until", generations)}, monkeypatch)

    for example, sample in zip(ours.examples, samples_by_doc(theirs, "glass_mc"), strict=True):
        assert isinstance(example, ChoiceResult)
        lls = [ll for ll, _ in sample["filtered_resps"]]
        torch.testing.assert_close(torch.tensor(example.loglikelihoods, dtype=torch.float64),
                                   torch.tensor(lls, dtype=torch.float64),
                                   atol=LOGLIKELIHOOD_TOLERANCE, rtol=0)
        assert (example.correct, example.correct_norm) == (sample["acc"], sample["acc_norm"])
        assert example.chosen == max(range(len(lls)), key=lls.__getitem__)
    mc = theirs["results"]["glass_mc"]
    assert ours.metrics == {"acc": mc["acc,none"], "acc_norm": mc["acc_norm,none"]}
    assert 0 < ours.metrics["acc"] < 1
    assert any(e.chosen != e.chosen_norm for e in ours.examples)  # acc_norm is not acc here

    for example, sample in zip(ours_gen.examples, samples_by_doc(theirs, "glass_gen"),
                               strict=True):
        assert isinstance(example, GenerationResult)
        assert example.generated == sample["filtered_resps"][0]
        assert float(example.exact_match) == sample["exact_match"]
    assert ours_gen.metrics["exact_match"] == theirs["results"]["glass_gen"]["exact_match,none"]
    assert ours_gen.metrics["exact_match"] == pytest.approx(1 / 3, abs=0.05)


def generation_docs(model: GPT, tokenizer: BPETokenizer, builtin: Task) -> list[dict]:
    """The builtin's generate-until items, every third answered with the model's own text and
    every third with it and a space more."""
    from glassgpt.evals.scoring import generate_until

    docs = []
    for i, item in enumerate(i for i in builtin.items if not isinstance(i, MultipleChoice)):
        own = generate_until(model, tokenizer, item.context, ("\n",), 4)
        answer = [own, own + " ", item.answer][i % 3]
        docs.append({"context": item.context, "answer": answer})
    return docs


# --- the task files ---------------------------------------------------------------------------

def test_builtin_tasks_ship_with_the_package() -> None:
    assert builtin_tasks() == ["arithmetic", "word_order"]
    arithmetic = load_task("builtin:arithmetic")
    kinds = {type(item).__name__ for item in arithmetic.items}
    assert arithmetic.name == "arithmetic" and kinds == {"MultipleChoice", "GenerateUntil"}
    assert len(load_task("builtin:word_order").items) == 20


@pytest.mark.parametrize(("line", "named"), [
    ('{"kind": "multiple_choice", "context": "a", "choices": ["b"], "gold": 0', "line 2 is not "
     "valid JSON"),
    ('{"kind": "multiple_choice", "context": "a", "choices": ["b", "c"], "gold": 2}',
     "line 2: \"gold\" must be the index of the right choice, 0 to 1, got 2"),
    ('{"kind": "multiple_choice", "context": "a", "choices": [], "gold": 0}',
     "line 2: \"choices\" must be a non-empty list of strings, got []"),
    ('{"kind": "multiple_choice", "context": "a", "choices": ["b"], "gold": true}',
     "got true"),
    ('{"context": "a", "choices": ["b"], "gold": 0}', "line 2: no kind"),
    ('{"kind": "ranking", "context": "a"}', "kind must be one of"),
    ('{"kind": "generate_until", "context": "a", "answer": "b", "until": "x", "max_tokens": 0}',
     "\"max_tokens\" must be a positive integer, got 0"),
    ('{"kind": "generate_until", "context": "a", "anwser": "b"}', "unknown keys ['anwser']"),
    # An empty stop string cut every answer to "": exact_match 0 for every model, unsaid.
    ('{"kind": "generate_until", "context": "a", "answer": "b", "until": ["\\n", ""]}',
     "\"until\" holds an empty string"),
    ('["a", "b"]', "line 2: expected a JSON object, got list"),
])
def test_bad_task_lines_are_named(tmp_path: Path, line: str, named: str) -> None:
    path = tmp_path / "task.jsonl"
    good = '{"kind": "generate_until", "context": "a", "answer": "b"}'
    path.write_text(f"{good}\n{line}\n", encoding="utf-8")
    with pytest.raises(InputError, match="task.jsonl") as caught:
        load_task(path)
    assert named in str(caught.value)


def test_a_file_without_items_and_an_unknown_builtin_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text('{"task": {"name": "x", "kind": "multiple_choice"}}\n\n', encoding="utf-8")
    with pytest.raises(InputError, match="holds no items"):
        load_task(path)
    with pytest.raises(InputError, match="there are: arithmetic, word_order"):
        load_task("builtin:nope")


def test_a_context_longer_than_the_window_allows_is_refused(exported: dict[str, Any]) -> None:
    task = parse_task(json.dumps({"kind": "generate_until", "context": "a", "answer": "b",
                                  "max_tokens": BLOCK_SIZE}), "long")
    with pytest.raises(InputError, match="long line 1: max_tokens 64 leaves no room"):
        evaluate_task(exported["model"], exported["tokenizer"], task)


def test_a_character_run_is_scored_and_unknown_characters_are_named() -> None:
    tokenizer = CharTokenizer.from_text("abc xyz\n")
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=1, n_head=1,
                          n_embd=8)).eval()
    task = parse_task('{"task": {"name": "chars", "kind": "multiple_choice"}}\n'
                      '{"context": "abc", "choices": ["x", "yz"], "gold": 1}\n'
                      '{"kind": "generate_until", "context": "ab", "answer": "c", '
                      '"max_tokens": 3}\n', "chars.jsonl")
    result = evaluate_task(model, tokenizer, task)
    assert [type(e) for e in result.examples] == [ChoiceResult, GenerationResult]
    assert len(result.examples[1].generated) <= 3 and set(result.metrics) == {
        "acc", "acc_norm", "exact_match"}
    unknown = parse_task('{"kind": "multiple_choice", "context": "abc", "choices": ["q"], '
                         '"gold": 0}', "unknown.jsonl")
    with pytest.raises(InputError, match="unknown.jsonl line 1: 1 character not in"):
        evaluate_task(model, tokenizer, unknown)


# --- the command ------------------------------------------------------------------------------

def test_eval_task_prints_metrics_and_examples(exported: dict[str, Any],
                                               capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["eval", str(exported["run"]), "--task", "builtin:word_order", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    expected = evaluate_task(exported["model"], exported["tokenizer"],
                             load_task("builtin:word_order"))
    assert shown["metrics"] == expected.metrics
    assert shown["examples"][0] == expected.examples[0].to_json()
    assert set(shown["examples"][0]) >= {"chosen", "loglikelihoods", "gold", "acc_norm"}


def test_eval_task_refuses_a_bad_file_in_one_line(exported: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind": "multiple_choice", "context": "a", "choices": ["b"], '
                    '"gold": 3}\n', encoding="utf-8")
    code, err = glassgpt("eval", exported["run"], "--task", path, capsys=capsys)
    assert code == 2 and "bad.jsonl line 1: \"gold\"" in one_error_line(err)
    code, err = glassgpt("eval", exported["run"], "--task", path, "--context", "8",
                         capsys=capsys)
    assert code == 2 and "--context goes with" in one_error_line(err)

