"""DFlash and DSpark from the command line: export and build through the CLIs, llm_inference answering as the plain
engine does, and bad block-draft flags refused in one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli_checks import answers, assert_one_line_error, build_kernel_draft, write_spec_requests

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

TINY = ["--maxInputLen", "64", "--maxKVCacheCapacity", "256", "--tokensPerPage", "16"]


def test_export_build_and_run_a_dspark_draft(run_cli, tiny_block_draft_engines: dict[str, Path],
                                             tmp_path: Path) -> None:
    base_onnx, base = tiny_block_draft_engines["base_onnx"], tiny_block_draft_engines["base"]
    made = run_cli(["llm_export", "random-block-draft", "--kind", "dspark", "--baseOnnxDir", base_onnx,
                    "--outputDir", tmp_path / "hf", "--blockSize", "4"])
    assert made.returncode == 0, made.stderr
    exported = run_cli(["llm_export", "block-draft", "--draftDir", tmp_path / "hf", "--baseOnnxDir", base_onnx,
                        "--outputDir", tmp_path / "onnx"])
    assert exported.returncode == 0 and "dspark draft" in exported.stdout + exported.stderr, exported.stderr
    build_kernel_draft(run_cli, tmp_path / "onnx", tmp_path / "e", TINY)

    request_file = write_spec_requests(tmp_path / "in.json", 16)
    args = ["llm_inference", "--engineDir", base, "--inputFile", request_file, "--numThreads", "2"]
    plain = run_cli([*args, "--outputFile", tmp_path / "plain.json"])
    spec = run_cli([*args, "--outputFile", tmp_path / "spec.json", "--specDecode", "dspark", "--specDraftEngineDir",
                    tmp_path / "e", "--dsparkScheduler", "threshold", "--dsparkConfidenceThreshold", "0.3",
                    "--enableContextReuse", "--profileOutputFile", tmp_path / "profile.json"])
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert answers(tmp_path / "plain.json") == answers(tmp_path / "spec.json")
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["spec_decode_generation"]["total_iterations"] > 0
    assert "block_diffusion_denoise" in {stage["stage_id"] for stage in profile["stages"]}
    for flags, flag in ((["--specDecode", "dflash", "--dflashBlockSize", "99"], "--dflashBlockSize"),
                        (["--specDecode", "dspark", "--specDraftEngineDir", str(tmp_path / "e"), "--dsparkScheduler",
                          "always"], "--dsparkScheduler"),
                        (["--dsparkMaxProposalLen", "3"], "--dsparkMaxProposalLen"),
                        (["--specDecode", "dspark"], "--specDraftEngineDir")):
        assert_one_line_error(run_cli([*args, "--outputFile", tmp_path / "x.json", *flags]), flag)
