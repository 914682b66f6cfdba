"""The suite's own shape: one tiny-model factory and one trained run (tests/conftest.py), used by
the modules that once built their own, and a registered `slow` marker for a quick loop."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from conftest import TINY_GPT, tiny_gpt

HERE = Path(__file__).parent
# The modules moved onto the shared factory and run; a module not named may still build its own.
MIGRATED = ["test_model.py", "test_block.py", "test_lens.py", "test_generate.py",
            "test_checkpoint.py", "test_train.py", "test_evaluate.py", "test_properties.py",
            "test_api_misuse.py", "test_bad_inputs.py", "test_threads_reported.py",
            "test_lifecycle.py"]
WIDEST_TINY = 64  # a model wider than this is a real shape (GPT-2's), not a test's tiny one


def tiny_models_built_by_hand(path: Path) -> list[int]:
    """Lines of `GPT(GPTConfig(..., n_embd=N))` with a small literal N."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "GPTConfig"
                and any(k.arg == "n_embd" and isinstance(k.value, ast.Constant)
                        and k.value.value <= WIDEST_TINY for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_the_migrated_modules_take_their_tiny_model_from_conftest():
    built = {name: tiny_models_built_by_hand(HERE / name) for name in MIGRATED}
    assert {name: lines for name, lines in built.items() if lines} == {}


def test_the_factory_overrides_any_field_and_keeps_the_rest():
    model = tiny_gpt(n_layer=1, vocab_size=7)
    assert model.config.n_layer == 1 and model.config.vocab_size == 7
    assert model.config.n_embd == TINY_GPT["n_embd"] and model.training


def test_the_trained_run_is_trained_once_by_the_command_line(trained_run, run_copy):
    state = json.loads((trained_run.run / "train_state.json").read_text())
    assert state["iteration"] == 3 and (trained_run.data / "meta.json").is_file()
    assert run_copy != trained_run.run and (run_copy / "model.safetensors").is_file()


def test_the_slow_marker_is_registered(pytestconfig):
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))
