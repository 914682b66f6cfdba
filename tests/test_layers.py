"""docs/reading-the-code.md is true to the tree: the modules it names exist, and the layer
table it draws is the one the imports draw.

The imports are read with `ast` (every `import glassgpt...`, also those inside functions and
under `TYPE_CHECKING`), one node per top-level module or folder of the package.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "glassgpt"
PAGE = ROOT / "docs" / "reading-the-code.md"
OUTSIDE = {"__init__.py", "__main__.py"}  # the package's face: the public names, `python -m`
GLASS = {"hooks.py", "rotary.py", "norms.py", "attention.py", "block.py", "inputs.py", "model.py"}
TICKED = re.compile(r"`([^`]+)`")


def section(title: str) -> str:
    text = PAGE.read_text("utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


@cache
def layer_rows() -> list[tuple[list[str], str]]:
    """(the nodes of a row, what the row says lives there), bottom row first."""
    rows = []
    for line in section("The layers").splitlines():
        if line.startswith("| `"):
            first, rest = line[1:].split(" | ", 1)
            rows.append((TICKED.findall(first), rest))
    return rows


def layer_of() -> dict[str, int]:
    return {node: rank for rank, (nodes, _) in enumerate(layer_rows()) for node in nodes}


def node_of(module: str) -> str | None:
    """`glassgpt.view.lens` -> "view/", `glassgpt.model` -> "model.py"; None for the package."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def node_of_file(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return f"{rel.parts[0]}/" if len(rel.parts) > 1 else rel.name


def imported(tree: ast.AST) -> set[str]:
    """Every glassgpt module a module's source imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("glassgpt.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "glassgpt":  # `from glassgpt import bench` or `__version__`
                names |= {f"glassgpt.{a.name}" for a in node.names
                          if (PACKAGE / a.name).is_dir() or (PACKAGE / f"{a.name}.py").exists()}
            elif node.module.startswith("glassgpt."):
                names.add(node.module)
    return names


@cache
def import_edges() -> dict[str, set[str]]:
    """node -> the other nodes it imports from."""
    edges: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = node_of_file(path)
        targets = {node_of(m) for m in imported(ast.parse(path.read_text("utf-8")))}
        edges.setdefault(source, set()).update(targets - {None, source})
    return edges


def test_every_module_of_the_package_sits_in_one_layer():
    named = [node for nodes, _ in layer_rows() for node in nodes]
    assert len(named) == len(set(named)), "a module is named in two rows"
    assert set(import_edges()) - OUTSIDE == set(named)


def test_the_imports_point_one_way_down_the_table():
    rank = layer_of()
    upward = [f"{src} imports {dst}" for src, dsts in import_edges().items() if src not in OUTSIDE
              for dst in dsts if dst in OUTSIDE or rank[dst] > rank[src]]
    assert upward == []


def test_machine_sits_below_the_model():
    rank = layer_of()
    assert rank["machine/"] < rank["model.py"]
    assert import_edges()["machine/"] & GLASS == set()


def test_bench_sits_beside_experiments_not_above_them():
    assert layer_of()["bench/"] == layer_of()["experiments/"]
    assert "experiments/" not in import_edges()["bench/"]
    assert "bench/" not in import_edges()["experiments/"]


def test_the_layers_the_issue_names_are_where_the_page_says():
    rank = layer_of()
    assert rank["model.py"] < rank["interp/"] < rank["view/"] < rank["bench/"]
    assert rank["figures/"] < rank["experiments/"]
    cli = next(text for nodes, text in layer_rows() if nodes == ["cli/"])
    assert "`glassgpt.formats.convert`" in cli
    assert "formats.convert" in "".join(
        imported(ast.parse((PACKAGE / "cli/convert.py").read_text())))


def exists(name: str) -> bool:
    """A file, folder or dotted module the page names, looked for where a reader would."""
    name = name.split("(")[0].rstrip("/")
    if name.startswith("glassgpt."):
        parts = name.split(".")
        for cut in range(len(parts), 1, -1):  # the longest importable prefix, then attributes
            try:
                thing = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attribute in parts[cut:]:
                if not hasattr(thing, attribute):
                    return False
                thing = getattr(thing, attribute)
            return True
        return False
    if "/" in name or "." in name:
        return any((base / name).exists() for base in (PACKAGE, ROOT))
    return (PACKAGE / name).is_dir()


def named_paths() -> list[str]:
    found = set()
    for name in TICKED.findall(PAGE.read_text("utf-8")):
        if re.fullmatch(r"glassgpt(\.\w+)+|[\w/]+\.py|\w+/|[\w/]+/\w+\.\w+", name):
            found.add(name)
    return sorted(found)


@pytest.mark.parametrize("name", named_paths())
def test_every_module_the_page_names_exists(name):
    assert exists(name) or list(PACKAGE.rglob(name)), f"{PAGE.name} names {name}"


def test_each_layer_rows_files_are_in_its_folders():
    for nodes, text in layer_rows():
        folders = [PACKAGE, *(PACKAGE / n for n in nodes if n.endswith("/"))]
        for name in TICKED.findall(text):
            if re.fullmatch(r"\w+\.py", name):
                assert any((f / name).exists() for f in folders), f"{name} not in {nodes}"


def concept_rows() -> list[tuple[list[str], list[Path]]]:
    """(the names a row of the glass's table gives, the files it says they are in)."""
    rows = []
    for line in section("The glass").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 3 and cells[2].startswith("`"):
            rows.append((TICKED.findall(cells[1]), [PACKAGE / f for f in TICKED.findall(cells[2])]))
    return rows


def test_the_glass_table_names_what_its_files_define():
    assert len(concept_rows()) > 20
    for names, files in concept_rows():
        source = "".join(f.read_text("utf-8") for f in files)
        for name in names:
            if name.startswith("glassgpt.") or not re.fullmatch(r"[\w.]+(\(.*\))?", name):
                continue  # a module (named above) or a piece of code, as `is_causal=True`
            for word in name.split("(")[0].split("."):
                assert re.search(rf"\b{word}\b", source), f"{name} is not in {files}"


# --- the rooms of interp (docs/reading-the-code.md, "The rooms of interp") ----------------------

INTERP = PACKAGE / "interp"
INTERP_FACE = "__init__.py"  # interp's public names, outside its rooms


@cache
def room_rows() -> list[tuple[list[str], list[str], str]]:
    """(the rooms of a row, the rooms of interp they may import, what lives there), read as
    layer_rows reads the layers."""
    rows = []
    for line in section("The rooms of interp").splitlines():
        if line.startswith("| `"):
            rooms, allowed, text = line[1:].split(" | ", 2)
            rows.append((TICKED.findall(rooms), TICKED.findall(allowed), text))
    return rows


def room_of(module: str) -> str | None:
    """`glassgpt.interp.core.cache` -> "core/", `glassgpt.interp` -> its face; None outside."""
    parts = module.split(".")
    if parts[:2] != ["glassgpt", "interp"]:
        return None
    if len(parts) == 2:
        return INTERP_FACE
    return f"{parts[2]}/" if (INTERP / parts[2]).is_dir() else f"{parts[2]}.py"


@cache
def room_edges() -> dict[str, set[str]]:
    """room of interp -> the other rooms (or the face) it imports from."""
    edges: dict[str, set[str]] = {}
    for path in sorted(INTERP.rglob("*.py")):
        rel = path.relative_to(INTERP)
        source = f"{rel.parts[0]}/" if len(rel.parts) > 1 else rel.name
        targets = {room_of(m) for m in imported(ast.parse(path.read_text("utf-8")))}
        edges.setdefault(source, set()).update(targets - {None, source})
    return edges


def test_every_module_of_interp_sits_in_one_room():
    named = [room for rooms, _, _ in room_rows() for room in rooms]
    assert len(named) == len(set(named)), "a room is named in two rows"
    assert set(room_edges()) - {INTERP_FACE} == set(named)


def test_each_room_of_interp_imports_only_the_rooms_its_row_names():
    allowed = {room: set(may) for rooms, may, _ in room_rows() for room in rooms}
    beyond = [f"{src} imports {dst}" for src, dsts in room_edges().items() if src != INTERP_FACE
              for dst in sorted(dsts - allowed[src])]
    assert beyond == []


def test_the_rooms_of_interp_are_as_the_issue_draws_them():
    """The core imports no other room; the face, the dictionaries and the graphs stand on the
    core (the graphs on the dictionaries too); the methods on the core and the dictionaries."""
    allowed = {room: set(may) for rooms, may, _ in room_rows() for room in rooms}
    assert allowed == {"core/": set(), "hooked_gpt/": {"core/"}, "sae/": {"core/"},
                       "graph/": {"core/", "sae/"}, "methods/": {"core/", "sae/"},
                       "timeline/": {"core/", "sae/", "methods/"}}


def test_each_room_rows_files_are_in_its_rooms():
    for rooms, _, text in room_rows():
        folders = [PACKAGE, *(INTERP / room for room in rooms)]
        for name in TICKED.findall(text):
            if re.fullmatch(r"\w+\.py", name):
                assert any((f / name).exists() for f in folders), f"{name} not in {rooms}"


# --- the house (docs/reading-the-code.md, "The house") -----------------------------------------

GLASS_LINES = 400  # a glass file past this holds two concerns (STYLE.md, 11)
TOP_LEVEL_MODULES = 12  # every .py file directly in src/glassgpt/, __init__ and __main__ included
CLI_TRAIN_LINES = 150  # `glassgpt train` parses, calls train_run and prints: no more
MODULE_LINES = 500  # any module past this holds two concerns
FUNCTION_LINES = 60  # a function past this does two things: read it at a glance


def lines_of(path: Path) -> int:
    return len(path.read_text("utf-8").splitlines())


def test_each_glass_file_and_the_config_fit_the_house():
    long = {name: lines_of(PACKAGE / name) for name in GLASS | {"config.py"}}
    assert {name: n for name, n in long.items() if n > GLASS_LINES} == {}


def test_the_top_level_holds_at_most_twelve_modules():
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MODULES, modules
    assert GLASS.issubset(modules)  # the glass sits at the top, where a reader finds it first


def test_glassgpt_train_stays_a_thin_command():
    assert lines_of(PACKAGE / "cli" / "train.py") <= CLI_TRAIN_LINES


def test_no_module_of_the_package_passes_500_lines():
    long = {str(path.relative_to(PACKAGE)): lines_of(path)
            for path in sorted(PACKAGE.rglob("*.py"))}
    assert {name: n for name, n in long.items() if n > MODULE_LINES} == {}


def test_no_function_of_the_package_passes_60_lines():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = length
    assert long == {}


def names_used(tree: ast.AST) -> set[str]:
    """Every name a module reads (`x`, the `x` of `x.y`), annotations included."""
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def reexports(path: Path) -> list[str]:
    """The glassgpt names `path` imports at its top only to name them again: never used there,
    or listed in its `__all__` though defined elsewhere."""
    tree = ast.parse(path.read_text("utf-8"))
    imported = {alias.asname or alias.name for node in tree.body
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("glassgpt")
                for alias in node.names}
    unused = imported - names_used(tree)
    listed = {element.value for node in tree.body if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
              for element in ast.walk(node.value) if isinstance(element, ast.Constant)}
    return sorted(unused | (listed & imported))


def modules_in(folder: str) -> list[Path]:
    """The modules of one folder of the package (its subfolders too); "." is the top level."""
    if folder == ".":
        return sorted(PACKAGE.glob("*.py"))
    return sorted((PACKAGE / folder).rglob("*.py"))


FOLDERS = [".", *sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())]


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_keeps_an_old_import_path(folder):
    """One import path a name: only a package's `__init__.py` names what lives elsewhere
    (per folder, so that a folder still keeping one is seen by itself)."""
    found = {str(path.relative_to(PACKAGE)): names for path in modules_in(folder)
             if path.name != "__init__.py" and (names := reexports(path))}
    assert found == {}
