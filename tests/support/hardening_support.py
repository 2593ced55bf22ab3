"""Helpers of the hardening tests: run a CLI in-process, snapshot directories, edit an engine dir consistently."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from kvforge.cli_common import run_app
from kvforge.contract.manifest import ENGINE_KIND, write_manifest

HI = {"role": "user", "content": "hi"}


@dataclass(frozen=True, slots=True)
class Result:
    code: int
    stdout: str
    stderr: str

    def one_line_error(self, *needles: str) -> str:
        """The CLI contract: exit 2 and exactly one `error:` line on stderr naming the field or flag."""
        assert "Traceback" not in self.stderr, self.stderr
        assert self.code == 2, f"exit {self.code}: {self.stderr}"
        lines = self.stderr.strip("\n").splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), lines
        assert "internal error" not in lines[0], lines[0]
        for needle in needles:
            assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
        return lines[0]


def invoke(app: typer.Typer, *args: Any) -> Result:
    """Run a kvforge typer app in this process exactly as its console script would (run_app → run_guarded)."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["kvforge-test", *map(str, args)]
    debug = os.environ.pop("KVFORGE_DEBUG", None)
    code: Any = 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            run_app(app)
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = argv
        if debug is not None:
            os.environ["KVFORGE_DEBUG"] = debug
    return Result(int(code or 0), out.getvalue(), err.getvalue())


def snapshot(*paths: Path) -> dict[str, str]:
    """Digest of every file under `paths` (and of the paths themselves when they are files)."""
    digests = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        for path in files:
            digests[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def copy_engine(engine_dir: Path, target: Path) -> Path:
    shutil.copytree(engine_dir, target)
    return target


def edit_engine(engine: Path, *, config: dict[str, Any] | None = None, text: dict[str, str | bytes] | None = None,
                refresh_manifest: bool = True) -> Path:
    """Change files of an engine dir copy; with refresh_manifest the manifest is rewritten, as if the dir had
    been built that way (what a hostile or buggy builder would produce), so the checks behind it are reached."""
    if config is not None:
        (engine / "config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, content in (text or {}).items():
        path = engine / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    if refresh_manifest:
        write_manifest(engine, ENGINE_KIND)
    return engine


def request_file(path: Path, *requests: dict[str, Any], **top: Any) -> Path:
    data = {"temperature": 0, "max_generate_length": 2, **top, "requests": list(requests) or [{"messages": [HI]}]}
    path.write_text(json.dumps(data), encoding="utf-8")
    return path
