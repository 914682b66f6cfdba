"""The in-process command line as the error tests drive it: exit code and stderr of one call,
and the one `error:` line a user mistake must produce."""

from __future__ import annotations

import pytest

from glassgpt.cli import main


def glassgpt(*args: object, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """`glassgpt ARGS` in this process: (exit code, what it wrote on stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def one_error_line(err: str) -> str:
    """The single non-empty line of `err`, which must start with "error: "."""
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]
