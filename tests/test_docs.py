"""The README and the docs/ pages: short road, links that resolve, commands that exist, and
every code block of docs/ run as pasted.

Every `glassgpt ...` line a page shows in a shell block is parsed by the real command-line
parser (its command, flags and values must exist and type-check), unless the line says it needs
a network or a GPU. Every `python -m MODULE` a page names must import.

Each page of docs/ then runs as a reader would follow it: its ```bash and ```python blocks in
page order, in one fresh working directory, the Python blocks in one namespace (a notebook's).
Blocks of other languages (```text, an unnamed fence) are output and are not run. Before the
first block the test writes what the page takes as the reader's own (`GIVENS`: `my.txt`, ...);
everything else a block reads, an earlier block of the same page made. In a shell block:
  * a line that says it needs a network or a GPU, or launches torchrun (`NEEDS_ELSEWHERE`), is
    only parsed, and a Python block whose first line says so is not run;
  * `glassgpt demo`, `view` and `bench` are only parsed (`SHOWN_NOT_RUN`: minutes each or a
    server; their own tests run them);
  * any other `glassgpt` line runs in this process with `TINY_FLAGS` for its command appended
    (the last flag wins: fewer steps, tokens and dictionary latents, never another model
    shape), and must exit 0;
  * any other line runs in bash (the venv's `python` and `glassgpt` first on PATH).
Offline: Hugging Face is told so, and the cache is the test's own. A page that uses an optional
extra (`EXTRAS_NEEDED`: transformers, gguf, nnsight) is skipped where it is not installed, as
the tests of those extras are.
"""

import argparse
import importlib
import json
import linecache
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glassgpt.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MOST_LINES = 300
SHELL_BLOCK = re.compile(r"```(?:bash|sh|console)\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
NEEDS_ELSEWHERE = ("needs network", "needs a network", "needs a GPU", "needs GPUs",
                   "torchrun", "needs the network")


def shell_lines(page: Path) -> list[str]:
    """The commands of a page's shell blocks, continuation lines joined."""
    lines = []
    for block in SHELL_BLOCK.findall(page.read_text("utf-8")):
        joined = block.replace("\\\n", " ")
        lines += [line.strip() for line in joined.splitlines() if line.strip()]
    return lines


def glassgpt_commands() -> list[tuple[str, str]]:
    """(page name, the arguments after `glassgpt`) of every documented glassgpt command."""
    found = []
    for page in PAGES:
        for line in shell_lines(page):
            if line.startswith("#") or any(mark in line for mark in NEEDS_ELSEWHERE):
                continue
            for part in re.split(r"&&|\|\||;|\|", line.split(" #")[0]):
                words = part.strip()
                if words.startswith("glassgpt "):
                    found.append((page.name, words.removeprefix("glassgpt ")))
    return found


def test_the_readme_is_a_short_road():
    lines = (ROOT / "README.md").read_text("utf-8").splitlines()
    assert len(lines) <= README_MOST_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_of_a_page_resolves(page):
    for target in LINK.findall(page.read_text("utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"


class _ParseOnly(argparse.Namespace):
    pass


@pytest.mark.parametrize("where,args", glassgpt_commands(), ids=lambda v: str(v)[:60])
def test_every_documented_command_parses(where, args):
    words = [w for w in shlex.split(args) if w != "--debug"]
    try:
        parsed = build_parser().parse_args(words, namespace=_ParseOnly())
    except SystemExit as stop:  # --help, --version
        assert stop.code == 0, f"{where}: glassgpt {args}"
        return
    assert getattr(parsed, "handler", None) is not None, f"{where}: glassgpt {args}"


def documented_modules() -> list[str]:
    text = "\n".join(page.read_text("utf-8") for page in PAGES)
    return sorted(set(re.findall(r"python3? -m (glassgpt[\w.]*)", text)))


@pytest.mark.parametrize("module", documented_modules())
def test_every_documented_python_module_imports(module):
    importlib.import_module(module)


# --- every block of a docs page, run as a reader follows it ------------------------------------

DOCS_PAGES = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)
SHOWN_NOT_RUN = {"demo", "view", "bench"}
SHELL_OPERATORS = {"|", "||", "&&", "&", ";", ">", ">>", "<"}
TINY_TRAIN = ["--max-iters", "2", "--eval-interval", "2", "--eval-iters", "1", "--batch-size", "2",
              "--device", "cpu", "--threads", "1"]
TINY_FLAGS = {"train": TINY_TRAIN, "finetune": TINY_TRAIN,
              "sample": ["--max-new-tokens", "3", "--device", "cpu", "--threads", "1"],
              "eval": ["--max-batches", "1", "--batch-size", "2", "--device", "cpu",
                       "--threads", "1"],
              # an untrained dictionary fires half its latents, and a graph's matrix grows
              # with the square of the features it keeps: fewer latents too
              "sae": ["--tokens", "512", "--batch-tokens", "128", "--d-sae", "64"],
              "attention": ["--threads", "1"]}
MY_TEXT = "".join(f"ROMEO: To be or not to be, line {i}: that is the question.\n"
                  for i in range(300))


# Each maker writes in the working directory, `where`.

def hf_model_as_interop_makes_it(where: Path) -> None:
    """`my-llama/`, made by docs/interop.md's own recipe (a tiny random Llama with a tokenizer
    trained offline and a chat template), which reads `my.txt`."""
    page = (ROOT / "docs" / "interop.md").read_text("utf-8")
    recipe = page.split("<!-- section: tiny hf model -->", 1)[1]
    code = recipe.split("```python\n", 1)[1].split("```", 1)[0]
    run_python(code, "docs/interop.md (the recipe)", {"__name__": "__main__"})


def repeats_run_as_interpretability_makes_it(where: Path) -> None:
    """`runs/repeats` and `runs/repeats-transcoders`: docs/interpretability.md's shell lines
    (the corpus, the run, its transcoders, and the page's commands on them)."""
    for kind, line, said_at in runnable_pieces(ROOT / "docs" / "interpretability.md"):
        if kind == "shell":
            run_shell_line(line, said_at)


def llama_run_as_interop_makes_it(where: Path) -> None:
    """`runs/llama`: interop.md's tiny Llama (made by its recipe), imported."""
    hf_model_as_interop_makes_it(where)
    assert main(["convert", "--from-hf", "my-llama/", "--out", "runs/llama"]) == 0


def steering_vector(where: Path) -> None:
    """`love.safetensors`: a direction of cpu-small's width (128), `train`'s default shape."""
    save_file({"direction": torch.randn(128)}, str(where / "love.safetensors"))


def successor_demo_files(where: Path) -> None:
    """`data/template`, `successor.jsonl`, `successor_chats.jsonl` as tests/test_finetune.py
    makes them: sums of digit pairs in the simple chat template, `add a 1` items, and
    conversations teaching `add a 1` -> a + 1."""
    from glassgpt.data import prepare
    from glassgpt.data.sft import simple_template
    from glassgpt.tokenizers.chat import chat_messages

    text = "".join(f"<|system|>\nTo be or not to be.\n<|user|>\nadd {i % 10} {i % 7}\n"
                   f"<|assistant|>\n{i % 10 + i % 7}<|end|>\n" for i in range(200))
    (where / "template.txt").write_text(text, encoding="utf-8")
    prepare(where / "data" / "template", where / "template.txt")
    items = [{"kind": "generate_until", "answer": str(a + 1), "until": ["<|end|>"],
              "max_tokens": 8,
              "context": simple_template().render(chat_messages(f"add {a} 1", None))}
             for a in range(9)]
    chats = [{"messages": [{"role": "user", "content": f"add {a % 9} 1"},
                           {"role": "assistant", "content": str(a % 9 + 1)}]} for a in range(80)]
    for name, rows in (("successor.jsonl", items), ("successor_chats.jsonl", chats)):
        (where / name).write_text("".join(json.dumps(row) + "\n" for row in rows), "utf-8")


def induction_demo_output(where: Path) -> None:
    """`pictures/induction.json` and `pictures/induction_run/` as `glassgpt demo induction --out
    pictures --json pictures/induction.json` writes them, at the demo's --quick size (seed 0):
    the session's quick run, shared with tests/test_induction.py."""
    from conftest import quick_experiment
    from glassgpt.cli.demos import write_json

    result = quick_experiment("induction", where / "pictures", seed=0)
    shutil.copytree(result.numbers["run"], where / "pictures" / "induction_run")
    write_json(where / "pictures" / "induction.json", {"induction": result}, seed=0, quick=True)


# What a page takes as the reader's own (or as made on another page), made before its first
# block, in this order.
GIVEN_MAKERS: dict[str, Callable[[Path], None]] = {
    "my.txt": lambda where: (where / "my.txt").write_text(MY_TEXT, encoding="utf-8"),
    "my-llama/": hf_model_as_interop_makes_it,
    "runs/llama/": llama_run_as_interop_makes_it,
    "love.safetensors": steering_vector,
    "runs/repeats/ and its transcoders": repeats_run_as_interpretability_makes_it,
    "the successor demo's files": successor_demo_files,
    "the induction demo's pictures/": induction_demo_output,
}
EXTRAS_NEEDED = {"api.md": ["transformers"], "cli.md": ["transformers", "gguf"],
                 "interop.md": ["transformers", "gguf"], "interpretability.md": ["nnsight"]}
GIVENS = {"api.md": ["my.txt", "my-llama/"], "interop.md": ["my.txt"],
          "cli.md": ["my.txt", "runs/llama/", "love.safetensors",
                     "runs/repeats/ and its transcoders"],
          "finetune.md": ["the successor demo's files"],
          "interpretability.md": ["the induction demo's pictures/"]}


def page_blocks(page: Path) -> list[tuple[str, str, str]]:
    """(language, code, where: `docs/PAGE:LINE`) of each fenced block, in page order."""
    text = page.read_text("utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((match.group(1), match.group(2), f"docs/{page.name}:{line}"))
    return blocks


def runnable_pieces(page: Path) -> list[tuple[str, str, str]]:
    """("python", a block, where) and ("shell", a line, where) of the page that run, in order:
    what the module docstring does not leave out."""
    pieces = []
    for language, code, where in page_blocks(page):
        first = code.lstrip().split("\n", 1)[0]
        if language == "python" and not (first.startswith("#") and said_elsewhere(first)):
            pieces.append(("python", code, where))
        elif language in ("bash", "sh"):
            pieces += [("shell", line, where) for line in code.replace("\\\n", " ").splitlines()
                       if runs_here(line)]
    return pieces


def said_elsewhere(line: str) -> bool:
    return any(mark in line for mark in NEEDS_ELSEWHERE)


def runs_here(line: str) -> bool:
    words = shlex.split(line, comments=True)
    return bool(words) and not said_elsewhere(line) \
        and not (words[0] == "glassgpt" and words[1:2] and words[1] in SHOWN_NOT_RUN)


def run_python(code: str, where: str, namespace: dict) -> None:
    """`code` in `namespace`, its source registered where tracebacks and nnsight (which compiles
    a `with` block from its source) read it."""
    linecache.cache[where] = (len(code), None, code.splitlines(True), where)
    exec(compile(code, where, "exec"), namespace)


def run_shell_line(line: str, where: str) -> None:
    """A `glassgpt` line in this process with its tiny flags, any other line in bash."""
    words = shlex.split(line, comments=True)
    if words[0] != "glassgpt" or SHELL_OPERATORS & set(words):
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{where}: {line}\n{done.stderr[-3000:]}"
        return
    tiny = tiny_flags(words[1:])
    assert main([*words[1:], *tiny]) == 0, f"{where}: {line} (with {' '.join(tiny)})"


def tiny_flags(args: list[str]) -> list[str]:
    """`TINY_FLAGS` of the command, fitted to its line: a resume goes 2 steps further, and a
    task eval takes no batch flags (it reads no data split)."""
    if args[0] == "eval" and "--task" in args:
        return ["--device", "cpu", "--threads", "1"]
    return [*TINY_FLAGS.get(args[0], []), *(["--max-iters", "4"] if "--resume" in args else [])]


def run_page(page: Path) -> None:
    namespace: dict = {"__name__": "__main__"}
    for kind, text, where in runnable_pieces(page):
        if kind == "python":
            run_python(text, where, namespace)
        else:
            run_shell_line(text, where)


@pytest.fixture
def reader_s_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory, offline, with the venv's commands first on PATH."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ".cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / ".cache" / "huggingface"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page in DOCS_PAGES if runnable_pieces(page)],
                         ids=lambda p: p.name)
def test_every_code_block_of_a_docs_page_runs(page, reader_s_directory):
    for extra in EXTRAS_NEEDED.get(page.name, []):
        pytest.importorskip(extra)  # an optional extra (pyproject.toml) that this page uses
    for given in GIVENS.get(page.name, []):
        GIVEN_MAKERS[given](reader_s_directory)
    run_page(page)
