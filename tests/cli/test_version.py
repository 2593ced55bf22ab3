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


def test_run_app_takes_argv_so_a_cli_runs_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    """`run_app(app, argv)`: the program name and flags come from argv, not sys.argv (tests and embedders)."""
    from kvforge.builder.cli import app
    from kvforge.cli_common import run_app

    with pytest.raises(SystemExit) as done:
        run_app(app, ["llm_build", "--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"llm_build kvforge {kvforge.__version__}"
    with pytest.raises(SystemExit) as refused:
        run_app(app, ["llm_build", "--bogus"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--bogus" in err and "(see llm_build --help)" in err
    assert len(err.strip().splitlines()) == 1
