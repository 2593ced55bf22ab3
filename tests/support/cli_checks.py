"""The error contract every CLI keeps, as one assertion the CLI tests of every component share."""

from __future__ import annotations

import re
import subprocess

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
USER_ERROR = 2  # cli_common.EXIT_USER_ERROR; 3 would mean an internal error dressed as one line


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The error contract of every CLI; returns the line for further checks."""
    stderr = ANSI.sub("", proc.stderr)
    assert "Traceback" not in stderr and "Traceback" not in proc.stdout, stderr
    assert proc.returncode == USER_ERROR, f"exit {proc.returncode}: {stderr}"
    lines = stderr.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"expected one stderr line, got {lines!r}"
    line = lines[0]
    assert line.startswith("error:"), line
    assert "internal error" not in line, line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line
