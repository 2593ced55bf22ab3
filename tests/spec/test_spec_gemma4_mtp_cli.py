"""Gemma4 MTP from the command line: export and build an assistant through the CLIs, llm_inference answering as
the plain engine does with the mtp_generation profile block, and refusals in one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli_checks import answers, assert_one_line_error, build_kernel_draft, write_spec_requests
from support.ort_support import cpu_kernel_on

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

TINY = ["--maxInputLen", "64", "--maxKVCacheCapacity", "256", "--tokensPerPage", "16"]


def test_export_build_and_run_a_gemma4_assistant(run_cli, tiny_gemma4_mtp_engines: dict[str, Path],
                                                 tmp_path: Path) -> None:
    base_onnx, base = tiny_gemma4_mtp_engines["base_onnx"], tiny_gemma4_mtp_engines["base"]
    bad = run_cli(["llm_export", "random-gemma4-assistant", "--baseOnnxDir", base_onnx, "--outputDir",
                   tmp_path / "bad", "--numCentroids", "5"])
    assert_one_line_error(bad, "--numCentroids", "must divide")
    made = run_cli(["llm_export", "random-gemma4-assistant", "--baseOnnxDir", base_onnx, "--outputDir",
                    tmp_path / "hf", "--numCentroids", "7", "--numLayers", "1"])
    assert made.returncode == 0, made.stderr
    exported = run_cli(["llm_export", "gemma4-assistant", "--draftDir", tmp_path / "hf", "--baseOnnxDir", base_onnx,
                        "--outputDir", tmp_path / "onnx"])
    assert exported.returncode == 0 and "7 centroids" in exported.stdout + exported.stderr, exported.stderr
    build_kernel_draft(run_cli, tmp_path / "onnx", tmp_path / "e", TINY)

    request_file = write_spec_requests(tmp_path / "in.json", 16)
    args = ["llm_inference", "--engineDir", base, "--inputFile", request_file, "--numThreads", "2"]
    plain = run_cli([*args, "--outputFile", tmp_path / "plain.json"])
    spec = run_cli([*args, "--outputFile", tmp_path / "spec.json", "--specDecode", "gemma4_mtp",
                    "--specDraftEngineDir", tmp_path / "e", "--specDraftStep", "3", "--enableContextReuse",
                    "--profileOutputFile", tmp_path / "profile.json"])
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert answers(tmp_path / "plain.json") == answers(tmp_path / "spec.json")
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["mtp_generation"]["total_iterations"] > 0
    assert profile["context_cache"]["resource_pools"]["draft_kv_pages"]["capacity"] == 0
    assert_one_line_error(run_cli([*args, "--outputFile", tmp_path / "x.json", "--specDecode", "mtp"]),
                          "--specDecode", "attention-only base")


def test_a_gemma4_assistant_over_a_gemma4_base_from_the_command_line(run_cli, tmp_path: Path) -> None:
    """The same commands over `--synthetic tiny-gemma4` (sliding and global layers): the assistant exports against
    the Gemma 4 base, and llm_inference with --specDecode gemma4_mtp and reuse answers as plain decoding."""
    if not cpu_kernel_on():
        pytest.skip("Gemma4 assistants need the kvforge CPU kernel")
    steps = [["llm_export", "--synthetic", "tiny-gemma4", "--hiddenStateLayers", "5", "--outputDir",
              tmp_path / "base_onnx"],
             ["llm_build", "--onnxDir", tmp_path / "base_onnx", "--engineDir", tmp_path / "base", "--specBase", *TINY],
             ["llm_export", "random-gemma4-assistant", "--baseOnnxDir", tmp_path / "base_onnx", "--outputDir",
              tmp_path / "hf", "--numLayers", "2"],
             ["llm_export", "gemma4-assistant", "--draftDir", tmp_path / "hf", "--baseOnnxDir", tmp_path / "base_onnx",
              "--outputDir", tmp_path / "onnx"],
             ["llm_build", "--onnxDir", tmp_path / "onnx", "--engineDir", tmp_path / "base" / "draft", "--specDraft",
              "--cpuAttention", "kernel", *TINY]]
    for step in steps:
        done = run_cli(step)
        assert done.returncode == 0, (step, done.stderr)
    request_file = write_spec_requests(tmp_path / "in.json", 40)  # past the 32-token window
    args = ["llm_inference", "--engineDir", tmp_path / "base", "--inputFile", request_file, "--numThreads", "2"]
    plain = run_cli([*args, "--outputFile", tmp_path / "plain.json"])
    spec = run_cli([*args, "--outputFile", tmp_path / "spec.json", "--specDecode", "gemma4_mtp", "--specDraftStep",
                    "3", "--enableContextReuse", "--profileOutputFile", tmp_path / "profile.json"])
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert answers(tmp_path / "plain.json") == answers(tmp_path / "spec.json")
    assert json.loads((tmp_path / "profile.json").read_text())["mtp_generation"]["total_iterations"] > 0
