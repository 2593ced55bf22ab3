"""llm_build --profileOps: ONNX Runtime's per-node trace summed per op type, per phase, beside Python time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli_checks import assert_one_line_error

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here


def test_profile_ops_writes_both_phases(run_cli, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "engine", "--maxInputLen",
                    "64", "--maxKVCacheCapacity", "128", "--profileOps", out, "--profilePromptTokens", "48",
                    "--profileDecodeTokens", "4", "--numThreads", "2"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    prefill, decode = report["phases"]["prefill"], report["phases"]["decode"]
    assert prefill["calls"] == 1 and prefill["tokens_per_call"] == 48
    assert decode["calls"] >= 1 and decode["tokens_per_call"] == 1
    for phase in (prefill, decode):
        ops = phase["top_ops"]
        assert ops and all(row["ms_per_call"] >= 0 and row["nodes"] >= 1 for row in ops)
        assert {"MatMul", "Softmax"} & {row["op"] for row in ops}  # the model's own kernels, not session events
        assert sum(row["share_pct"] for row in ops) <= 100.0 + 1e-6
        times = phase["ms_per_call"]
        assert times["engine_step"] >= times["onnxruntime_run"] >= times["kernels"] > 0
    printed = proc.stdout + proc.stderr
    assert "MatMul" in printed and "decode" in printed


def test_profile_ops_flags_are_checked_before_the_build(run_cli, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", engine, "--maxInputLen", "64",
                    "--maxKVCacheCapacity", "128", "--profileOps", tmp_path / "ops.json",
                    "--profilePromptTokens", "65"])
    assert_one_line_error(proc, "--profilePromptTokens")
    assert not engine.exists()
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", engine,
                    "--profileOps", tmp_path / "missing" / "ops.json"])
    assert_one_line_error(proc, "--profileOps")
    assert not engine.exists()


def test_attention_runs_as_one_fused_kernel_per_layer(tiny_engine_dir: Path) -> None:
    """Chosen from the op profile: masked softmax attention was a quarter of prefill as separate nodes. The
    numerics are covered by every parity and reuse test, which run through this lowering. One node per layer on
    either path: kvforge's CPU kernel, or GroupQueryAttention where the kernel is off (the fallback pass)."""
    import onnx

    graph = onnx.load(tiny_engine_dir / "model.onnx", load_external_data=False).graph
    config = json.loads((tiny_engine_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    kernel = "PagedAttentionRope" if config["builder_config"].get("kernel_kv_write") else "PagedAttention"
    fused = kernel if config["builder_config"]["attention"] == "kvforge-cpu-kernel" else "GroupQueryAttention"
    assert sum(n.op_type == fused for n in graph.node) == layers
    assert not any(n.op_type in ("Softmax", "Where") for n in graph.node)


def test_profile_ops_may_not_land_in_the_engine_or_onnx_dir(run_cli, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", engine,
                    "--profileOps", tiny_onnx_dir / "ops.json"])
    assert_one_line_error(proc, "--profileOps")
    assert not engine.exists() and not (tiny_onnx_dir / "ops.json").exists()
