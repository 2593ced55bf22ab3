"""The profile's engine_call_python: each engine call's time outside ONNX Runtime, its own figure per call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvforge.contract.profile_schema import ENGINE_CALL_PYTHON_STAGE, GENERATION_STAGE, PREFILL_STAGE

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here


def test_each_engine_call_reports_its_python(tiny_engine_dir: Path, tmp_path: Path, run_cli) -> None:
    request = tmp_path / "in.json"
    request.write_text(json.dumps({"requests": [{"messages": [{"role": "user", "content": "hi there"}],
                                                 "max_generate_length": 6}], "temperature": 0}))
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", request, "--outputFile",
                    tmp_path / "out.json", "--profileOutputFile", tmp_path / "profile.json"])
    assert proc.returncode == 0, proc.stderr
    stages = {s["stage_id"]: s for s in json.loads((tmp_path / "profile.json").read_text())["stages"]}
    python = stages[ENGINE_CALL_PYTHON_STAGE]
    calls = stages[PREFILL_STAGE]["total_runs"] + stages[GENERATION_STAGE]["total_runs"]
    assert python["total_runs"] == calls  # one figure per engine call
    assert python["gpu_time_stats"]["min_ms"] >= 0.0
    # Part of the calls' time, never all of it: ONNX Runtime's share is taken out.
    engine_ms = stages[PREFILL_STAGE]["total_gpu_time_ms"] + stages[GENERATION_STAGE]["total_gpu_time_ms"]
    assert 0.0 < python["total_gpu_time_ms"] < engine_ms
