"""Every command's --help reads at 80 columns (a pipe, a default terminal): each flag name whole, no line past the
width, and a bounded length (llm_serve's was 634 lines with 47 names cut to "--enableContextR…")."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
from importlib.metadata import entry_points
from typing import Any

import pytest
import typer
from conftest import BIN_DIR
from typer.testing import CliRunner

WIDTH = 80
# The longest help (llm_serve: ~70 flags, several with a paragraph of help) takes ~280 lines; 634 before.
MAX_LINES = 320
MAX_LINES_PER_FLAG = 5  # the options' panels, borders aside: a flag and its help take five lines at most on average

SCRIPTS = sorted(ep.name for ep in entry_points(group="console_scripts") if ep.value.startswith("kvforge."))
TYPER_SCRIPTS = {ep.name: ep.value.split(":")[0] for ep in entry_points(group="console_scripts")
                 if ep.value.startswith("kvforge.") and ep.name != "kvforge"}


def _flags(command: Any) -> list[str]:
    # typer vendors click: its classes are not click's, so options are told by their kind
    return sorted({opt for param in command.params if param.param_type_name == "option" and not param.hidden
                   for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")})


def _commands(script: str) -> list[tuple[list[str], Any]]:
    """(argv after the script, click command) for the script and each of its subcommands."""
    command = typer.main.get_command(importlib.import_module(TYPER_SCRIPTS[script]).app)
    found = [([], command)]
    if hasattr(command, "commands"):  # a group
        found += [([name], sub) for name, sub in command.commands.items() if not sub.hidden]
    return found


def _check(text: str, flags: list[str], where: str, subcommands: int = 0) -> None:
    lines = text.splitlines()
    too_wide = [line for line in lines if len(line) > WIDTH]
    assert not too_wide, f"{where}: {len(too_wide)} lines wider than {WIDTH}, e.g. {too_wide[0]!r}"
    assert "…" not in text, f"{where}: something is cut short: {next(ln for ln in lines if '…' in ln)!r}"
    cut = [flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    assert not cut, f"{where}: flags missing or cut: {cut}"
    assert len(lines) <= MAX_LINES, f"{where}: {len(lines)} lines"
    panels = [i for i, line in enumerate(lines) if line.startswith("╭")]
    options = len(lines) - panels[0] if panels else 0  # the usage and the command's own prose come first
    bound = 2 * len(panels) + MAX_LINES_PER_FLAG * len(flags) + 2 * subcommands  # a command's line may wrap once
    assert options <= bound, f"{where}: {options} lines of options and commands"


def test_every_console_script_is_checked() -> None:
    assert {"llm_serve", "llm_inference", "llm_build", "llm_export", "llm_profile", "llm_test", "llm_bench",
            "kvforge"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_help_at_80_columns(script: str) -> None:
    """The installed script, as a user runs it through a pipe with an 80-column terminal."""
    env = {k: v for k, v in os.environ.items() if k not in ("TERMINAL_WIDTH", "KVFORGE_DEBUG")}
    env.update(COLUMNS=str(WIDTH), PYTHONIOENCODING="utf-8")
    proc = subprocess.run([str(BIN_DIR / script), "--help"], capture_output=True, text=True, encoding="utf-8",
                          timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    commands = _commands(script) if script in TYPER_SCRIPTS else []
    flags = _flags(commands[0][1]) if commands else []
    _check(proc.stdout, flags, script, subcommands=max(len(commands) - 1, 0))


@pytest.mark.parametrize("script", sorted(TYPER_SCRIPTS))
def test_subcommand_help_at_80_columns(script: str) -> None:
    """Each subcommand's help (llm_export lora, llm_profile compare, ...), in process: the same renderer."""
    app = importlib.import_module(TYPER_SCRIPTS[script]).app
    for argv, command in _commands(script)[1:]:
        result = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": None})
        assert result.exit_code == 0, result.output
        _check(result.output, _flags(command), f"{script} {' '.join(argv)}")
        for param in command.params:  # an argument by the name its help gives it (A.json), not its variable's
            if param.param_type_name == "argument" and param.metavar:
                assert param.metavar in result.output, f"{script} {' '.join(argv)}: {param.metavar} not shown"


def test_engine_flags_are_grouped() -> None:
    """llm_serve and llm_inference list the engine options under their panels, not in one 70-row table."""
    from kvforge.runtime.engine.config import ENGINE_OPTION_PANELS, engine_options

    named = [name for names in ENGINE_OPTION_PANELS.values() for name in names]
    assert len(named) == len(set(named)), "an engine option is in two panels"
    assert set(named) <= set(engine_options()), set(named) - set(engine_options())
    result = CliRunner().invoke(importlib.import_module("kvforge.server.cli").app, ["--help"], env={"COLUMNS": "80"})
    titles = re.findall(r"╭─ (.+?) ─", result.output)
    assert {"Options", "Context reuse", "Speculative decoding", "Limits"} <= set(titles), titles


def test_help_panels_refuse_an_unknown_flag() -> None:
    from kvforge.cli_common import set_help_panels

    app = typer.Typer()

    @app.command()
    def run(port: int = typer.Option(1, "--port")) -> None:  # pragma: no cover - never run
        pass

    with pytest.raises(ValueError, match="--nope"):
        set_help_panels(app, {"Network": ("--port", "--nope")})
