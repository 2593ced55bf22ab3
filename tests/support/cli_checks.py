"""The error contract every CLI keeps, as one assertion the CLI tests of every component share, and the request
file two speculative runs are compared on."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

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


def write_spec_requests(path: Path, max_generate_length: int) -> Path:
    """A greedy request file for speculative runs: one request with repeats to draft from, one that opts out."""
    path.write_text(json.dumps({
        "temperature": 0, "max_generate_length": max_generate_length, "apply_chat_template": False,
        "requests": [{"messages": [{"role": "user", "content": "the cat sat on the mat, the cat"}]},
                     {"messages": [{"role": "user", "content": "abc abc"}], "disable_spec_decode": True}]}))
    return path


def answers(path: Path) -> list[dict]:
    """An output file's responses without their timings (what two runs of the same requests must share)."""
    data = json.loads(path.read_text())
    return [{k: v for k, v in r.items() if "ms" not in k and k != "timing"} for r in data["responses"]]


def build_kernel_draft(run_cli, onnx_dir: Path, engine_dir: Path, geometry: list[str]) -> None:
    """`llm_build --specDraft` of a draft that needs the CPU kernel: refused in one line with --cpuAttention onnx,
    built with --cpuAttention kernel."""
    args = ["llm_build", "--onnxDir", onnx_dir, "--engineDir", engine_dir, "--specDraft", *geometry]
    assert_one_line_error(run_cli([*args, "--cpuAttention", "onnx"]), "--cpuAttention", "--cpuAttention kernel")
    built = run_cli([*args, "--cpuAttention", "kernel"])
    assert built.returncode == 0, built.stderr
