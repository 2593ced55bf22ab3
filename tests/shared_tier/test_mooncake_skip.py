"""On a machine without libibverbs1 the Mooncake tier tests skip and print why, instead of erroring on a master that
exits 127 (issue 41: `make test` on a fresh Debian machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import stores
from support.stores import HIDE_LIBRARIES_ENV, mooncake_binaries, mooncake_start_problem

ROOT = Path(__file__).resolve().parents[2]
LOADER_127 = ("#!/bin/sh\necho \"$0: error while loading shared libraries: libibverbs.so.1: cannot open shared "
              "object file: No such file or directory\" >&2\nexit 127\n")


def test_a_master_the_loader_refuses_is_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ldd the check starts the binary once: exit 127 and the loader's message name the library."""
    for name in ("mooncake_master", "mooncake_client"):
        (tmp_path / name).write_text(LOADER_127)
        (tmp_path / name).chmod(0o755)
    monkeypatch.setattr(stores.shutil, "which", lambda _name: None)
    problem = mooncake_start_problem(tmp_path)
    assert problem is not None and problem.startswith("mooncake_master cannot start: libibverbs.so.1 is missing")
    assert "apt-get install libibverbs1" in problem


def test_tier_tests_skip_with_the_reason_when_libibverbs_is_missing() -> None:
    """The contract tests themselves, in a pytest of their own, with libibverbs.so.1 hidden from the check."""
    mooncake_binaries()  # skips when Mooncake is not installed
    env = {**os.environ, HIDE_LIBRARIES_ENV: "libibverbs.so.1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "mooncake",
                          "tests/shared_tier/test_store_contract.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "error" not in run.stdout.splitlines()[-1] and " skipped" in run.stdout.splitlines()[-1]
    assert "mooncake_master cannot start: libibverbs.so.1 is missing" in run.stdout
