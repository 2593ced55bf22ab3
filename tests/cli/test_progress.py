"""Progress on export and build (issue 51 item 4) outside a terminal: one line per finished stage with its seconds on
stdout, so a failed run's stderr is still its one error line; bars on a terminal (or --progress bars); none with
--progress off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.hardening_support import invoke

from kvforge.builder.cli import app as build_app
from kvforge.cli_common import progress_bar, progress_mode, set_progress_mode
from kvforge.contract.errors import KvforgeError
from kvforge.tools.export.cli import app as export_app

STAGE = re.compile(r"^kvforge-test: (loading weights|quantizing|building graph|building engine) \d+\.\d s$")


def stages(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    assert all(STAGE.match(line) for line in lines), lines
    return [STAGE.match(line)[1] for line in lines]  # type: ignore[index]


def test_an_export_outside_a_terminal_prints_a_line_per_stage(tmp_path: Path) -> None:
    result = invoke(export_app, "model", "--synthetic", "tiny-llama", "--outputDir", tmp_path / "onnx")
    assert result.code == 0, result.stderr
    assert stages(result.stdout) == ["loading weights", "quantizing", "building graph"]  # auto: stderr is no tty
    assert "exported" in result.stderr and "loading weights" not in result.stderr


def test_a_build_outside_a_terminal_prints_its_stage(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    result = invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "engine", "--maxInputLen", "64",
                    "--maxKVCacheCapacity", "128", "--progress", "lines")
    assert result.code == 0, result.stderr
    assert stages(result.stdout) == ["building engine"]


@pytest.mark.parametrize("mode, on_stdout, on_stderr", [("off", False, False), ("bars", False, True)])
def test_off_prints_nothing_and_bars_draw_on_stderr(tmp_path: Path, mode: str, on_stdout: bool,
                                                    on_stderr: bool) -> None:
    result = invoke(export_app, "model", "--synthetic", "tiny-llama", "--outputDir", tmp_path / "onnx",
                    "--progress", mode)
    assert result.code == 0, result.stderr
    assert ("loading weights" in result.stdout, "loading weights" in result.stderr) == (on_stdout, on_stderr)


def test_a_failure_after_finished_stages_is_still_the_one_stderr_line(tmp_path: Path) -> None:
    """Gemma's graph refuses int4 blocks while building the graph: loading and quantizing have finished by then."""
    result = invoke(export_app, "model", "--synthetic", "tiny-gemma3", "--quantization", "int4", "--outputDir",
                    tmp_path / "onnx")
    result.one_line_error("--quantization", "float32 weights only")
    assert stages(result.stdout) == ["loading weights", "quantizing"]  # the failed stage leaves no line


def test_a_bad_progress_value_is_one_line_naming_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    invoke(export_app, "model", "--synthetic", "tiny-llama", "--outputDir", tmp_path / "a",
           "--progress", "loud").one_line_error("--progress", "auto, bars, lines, off")
    monkeypatch.setenv("KVFORGE_PROGRESS", "loud")
    invoke(export_app, "model", "--synthetic", "tiny-llama", "--outputDir", tmp_path / "b").one_line_error(
        "KVFORGE_PROGRESS", "'loud'")


def test_the_environment_sets_the_mode_and_a_command_s_flag_ends_with_it(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVFORGE_PROGRESS", "off")
    assert progress_mode() == "off"
    set_progress_mode("lines")
    try:
        assert progress_mode() == "lines"
        with progress_bar("stage", None):
            pass
        with pytest.raises(RuntimeError), progress_bar("failing stage", None):
            raise RuntimeError
    finally:
        set_progress_mode(None)
    assert re.fullmatch(r"\S+: stage \d+\.\d s\n", capsys.readouterr().out)
    with pytest.raises(KvforgeError, match="--progress"):
        set_progress_mode("fast")
