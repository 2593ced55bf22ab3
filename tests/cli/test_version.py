"""Every console script answers `--version` at its top level, so a bug report can name the exact release."""

from __future__ import annotations

from collections.abc import Callable
from subprocess import CompletedProcess

import pytest

import kvforge

SCRIPTS = ["llm_export", "llm_build", "llm_inference", "llm_test", "llm_profile", "llm_bench", "llm_serve", "kvforge"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_version(script: str, run_cli: Callable[..., CompletedProcess[str]]) -> None:
    result = run_cli([script, "--version"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{script} kvforge {kvforge.__version__}"


def test_kvforge_summary_names_every_command(run_cli: Callable[..., CompletedProcess[str]]) -> None:
    result = run_cli(["kvforge"])
    assert result.returncode == 0, result.stderr
    for script in SCRIPTS[:-1]:
        assert script in result.stdout
    assert len(result.stdout.splitlines()) < 25  # one screen


def test_kvforge_unknown_argument_is_one_line(run_cli: Callable[..., CompletedProcess[str]]) -> None:
    result = run_cli(["kvforge", "build"])
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
