"""The command line answers at once: `--help` and flag mistakes import no torch."""

import json
import subprocess
import sys

import pytest

from glassgpt.bench.startup import STARTUP_COMMANDS, measure_startup

HEAVY = ("torch", "matplotlib", "numpy", "transformers", "tokenizers", "safetensors")
PROBE = """
import sys
from glassgpt.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:  # argparse's --help
    code = stop.code or 0
heavy = sorted(name for name in {heavy!r} if name in sys.modules)
print("HEAVY:" + ",".join(heavy))
sys.exit(code)
"""


def imported_by(*args: str) -> tuple[list[str], int]:
    """The heavy modules a fresh process imported to answer `glassgpt ARGS`, and its exit."""
    probe = PROBE.format(heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                          timeout=60)
    marker = [line for line in done.stdout.splitlines() if line.startswith("HEAVY:")]
    assert marker, done.stderr
    names = marker[-1].removeprefix("HEAVY:")
    return (names.split(",") if names else []), done.returncode


@pytest.mark.parametrize("args", [
    ("--help",), ("train", "--help"), ("sample", "--help"), ("prepare", "--help"),
    ("bench", "--help"), ("demo", "--help"), ("convert", "--help"), ("view", "--help"),
    ("eval", "--help"), ("attention", "--help"), ("timeline", "--help"),
], ids=" ".join)
def test_help_imports_no_torch(args):
    heavy, _ = imported_by(*args)
    assert heavy == []


def test_a_mistyped_flag_imports_no_torch_and_fails():
    heavy, code = imported_by("train", "--n-layr", "2")
    assert heavy == []
    assert code == 2


def test_importing_the_package_imports_no_torch_until_a_model_is_asked_for():
    probe = ("import sys, glassgpt; assert 'torch' not in sys.modules; "
             "glassgpt.GPT; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)


def test_the_startup_benchmark_times_every_command_against_import_torch():
    results = measure_startup(rounds=1)
    assert [r.command for r in results] == [label for label, _ in STARTUP_COMMANDS]
    assert results[0].vs_import_torch == pytest.approx(1.0)
    assert all(r.median_s > 0 for r in results)


def test_bench_startup_prints_the_table_and_writes_json(tmp_path, capsys):
    from glassgpt.cli import main

    out = tmp_path / "startup.json"
    assert main(["bench", "startup", "--rounds", "1", "--json", str(out)]) == 0
    assert "glassgpt train --help" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [row["command"] for row in rows] == [label for label, _ in STARTUP_COMMANDS]
    assert rows[0]["vs_import_torch"] == pytest.approx(1.0)


def test_every_public_name_of_the_package_resolves_to_its_home():
    import glassgpt

    assert glassgpt.__all__ == sorted(glassgpt._HOMES)
    for name in glassgpt.__all__:
        assert getattr(glassgpt, name).__module__.startswith("glassgpt.")
