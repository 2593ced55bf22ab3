"""Every command runs the same path checks before any work: outputs writable (tried, not assumed), work dirs
that are dirs, outputs that are not inputs, names that are text; each refusal is one line, exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.hardening_support import invoke, request_file, snapshot

from kvforge.builder.cli import app as build_app
from kvforge.runtime.cli import app as inference_app
from kvforge.tools.bench.cli import app as bench_app
from kvforge.tools.export.cli import app as export_app
from kvforge.tools.testcases.cli import app as cases_app

REPO = Path(__file__).resolve().parents[2]
BASIC = REPO / "test_cases" / "llm_basic.json"
NOT_UTF8 = os.fsdecode(b"\xffrequests.json")  # a name carried as a surrogate escape


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "afile"
    path.write_text("mine")
    return path


def test_bench_output_equal_to_its_input_is_refused(tiny_engine_dir: Path, tmp_path: Path) -> None:
    requests = request_file(tmp_path / "in.json")
    before = snapshot(requests)
    invoke(bench_app, "--engine", tiny_engine_dir, "--inputFile", requests, "--outputFile", requests,
           "--maxTokens", "2", "--repeats", "1").one_line_error("--outputFile", "--inputFile")
    assert snapshot(requests) == before


# Root may write anywhere os.access asks about, /proc included; only creating a file finds out.
PROC = Path("/proc/kvforge-out.json")


def test_outputs_under_proc_are_refused_by_every_command(tiny_engine_dir: Path, tiny_onnx_dir: Path,
                                                          tmp_path: Path) -> None:
    requests = request_file(tmp_path / "in.json")
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", requests, "--outputFile", PROC
           ).one_line_error("--outputFile", "/proc")
    invoke(export_app, "model", "--synthetic", "tiny-llama", "--outputDir", "/proc/kvforge-onnx").one_line_error(
        "--outputDir", "/proc")
    invoke(cases_app, str(BASIC), "--engineDir", tiny_engine_dir, "--jsonReport", PROC).one_line_error(
        "--jsonReport", "/proc")
    invoke(cases_app, str(BASIC), "--onnxDir", tiny_onnx_dir, "--config", "mxsl256-mxbs2-mxil64",
           "--cacheDir", "/proc/kvforge-cache").one_line_error("--cacheDir", "/proc")
    invoke(bench_app, "--engine", tiny_engine_dir, "--inputFile", requests, "--outputFile", PROC,
           "--maxTokens", "2", "--repeats", "1").one_line_error("--outputFile", "/proc")
    invoke(bench_app, "--onnxDir", tiny_onnx_dir, "--inputFile", requests, "--workDir", "/proc/kvforge-work",
           "--maxTokens", "2", "--repeats", "1").one_line_error("--workDir", "/proc")


def test_dirs_that_are_files_are_refused(tiny_engine_dir: Path, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    requests = request_file(tmp_path / "in.json")
    mine = a_file(tmp_path)
    invoke(cases_app, str(BASIC), "--engineDir", tiny_engine_dir, "--outputDir", mine).one_line_error(
        "--outputDir", "not a directory")
    invoke(cases_app, str(BASIC), "--onnxDir", tiny_onnx_dir, "--config", "mxsl256-mxbs2-mxil64",
           "--cacheDir", mine).one_line_error("--cacheDir", "not a directory")
    invoke(bench_app, "--onnxDir", tiny_onnx_dir, "--inputFile", requests, "--workDir", mine,
           "--maxTokens", "2", "--repeats", "1").one_line_error("--workDir", "not a directory")
    invoke(export_app, "model", "--synthetic", "tiny-llama", "--outputDir", mine / "onnx").one_line_error(
        "--outputDir", "is a file")
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", requests, "--outputFile",
           mine / "out.json").one_line_error("--outputFile")
    assert mine.read_text() == "mine"


def test_names_that_are_not_utf8_are_refused_before_any_work(tiny_engine_dir: Path, tiny_onnx_dir: Path,
                                                               tmp_path: Path) -> None:
    requests = request_file(tmp_path / NOT_UTF8)
    out = tmp_path / "out.json"
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", requests, "--outputFile", out
           ).one_line_error("--inputFile", "not valid UTF-8", "\\xff")
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", request_file(tmp_path / "in.json"),
           "--outputFile", tmp_path / NOT_UTF8.replace("requests", "out")).one_line_error("--outputFile", "UTF-8")
    invoke(bench_app, "--engine", tiny_engine_dir, "--inputFile", requests, "--maxTokens", "2", "--repeats", "1"
           ).one_line_error("--inputFile", "UTF-8")
    invoke(cases_app, str(requests), "--engineDir", tiny_engine_dir).one_line_error("FILE", "UTF-8")
    invoke(build_app, "--onnxDir", tmp_path / NOT_UTF8, "--engineDir", tmp_path / "engine").one_line_error(
        "--onnxDir", "UTF-8")
    assert not out.exists() and not (tmp_path / "engine").exists()


@pytest.mark.parametrize("where", ["file", "dir"])
def test_the_probe_leaves_nothing_behind(tmp_path: Path, where: str) -> None:
    from kvforge.contract.files import check_output_dir, check_output_file

    if where == "file":
        check_output_file(tmp_path / "o.json", "--outputFile")
    else:
        check_output_dir(tmp_path / "onnx", "--outputDir")
    assert list(tmp_path.iterdir()) == []
