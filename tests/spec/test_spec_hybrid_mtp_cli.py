"""Hybrid MTP from the command line: a random MTP layer exported and built through the CLIs beside a tiny Qwen3.5
base, llm_inference answering as the plain engine does (with reuse: a batch of one), and refusals in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli_checks import answers, assert_one_line_error, write_spec_requests

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

TINY = ["--maxInputLen", "64", "--maxKVCacheCapacity", "256", "--tokensPerPage", "16"]


def test_export_build_and_run_an_mtp_layer(run_cli, tmp_path: Path) -> None:
    base_onnx = tmp_path / "base_onnx"
    exported = run_cli(["llm_export", "--synthetic", "tiny-qwen3_5", "--hiddenStateLayers", "3", "--outputDir",
                        base_onnx])
    assert exported.returncode == 0, exported.stderr
    built = run_cli(["llm_build", "--onnxDir", base_onnx, "--engineDir", tmp_path / "e", "--specBase", *TINY,
                     "--maxBatchSize", "1"])
    assert built.returncode == 0, built.stderr
    assert run_cli(["llm_export", "random-mtp", "--baseOnnxDir", base_onnx, "--outputDir",
                    tmp_path / "hf"]).returncode == 0
    exported = run_cli(["llm_export", "mtp", "--draftDir", tmp_path / "hf", "--baseOnnxDir", base_onnx, "--outputDir",
                        tmp_path / "mtp_onnx"])
    assert exported.returncode == 0 and "MTP draft" in exported.stdout + exported.stderr, exported.stderr
    built = run_cli(["llm_build", "--onnxDir", tmp_path / "mtp_onnx", "--engineDir", tmp_path / "e" / "draft",
                     "--specDraft", *TINY, "--maxBatchSize", "1"])
    assert built.returncode == 0, built.stderr

    request_file = write_spec_requests(tmp_path / "in.json", 16)
    args = ["llm_inference", "--engineDir", tmp_path / "e", "--inputFile", request_file, "--numThreads", "2"]
    plain = run_cli([*args, "--outputFile", tmp_path / "plain.json"])
    reuse = ["--enableContextReuse", "--contextCacheRecurrentSnapshotPoolBytes", "10000000",
             "--contextCachePartialKVSnapshotPoolBytes", "10000000"]
    spec = run_cli([*args, "--outputFile", tmp_path / "spec.json", "--specDecode", "mtp", *reuse,
                    "--profileOutputFile", tmp_path / "profile.json"])
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert answers(tmp_path / "plain.json") == answers(tmp_path / "spec.json")
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["mtp_generation"]["total_iterations"] > 0
    assert_one_line_error(run_cli([*args, "--outputFile", tmp_path / "x.json", "--specDecode", "mtp", *reuse,
                                   "--snapshotIntervalTokens", "16"]), "--snapshotIntervalTokens", "endpoint-only")
    assert_one_line_error(run_cli(["llm_export", "mtp", "--draftDir", tmp_path / "hf", "--baseOnnxDir",
                                   tmp_path / "hf", "--outputDir", tmp_path / "bad"]), "--baseOnnxDir")
