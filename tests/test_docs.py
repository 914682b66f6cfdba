"""The README and the docs/ pages: short road, links that resolve, commands that exist.

Every `glassgpt ...` line a page shows in a shell block is parsed by the real command-line
parser (its command, flags and values must exist and type-check), unless the line says it needs
a network or a GPU; what each command does is the business of that command's own tests. Every
`python -m MODULE` a page names must import, and the Python examples run.
"""

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from glassgpt.cli import build_parser

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
