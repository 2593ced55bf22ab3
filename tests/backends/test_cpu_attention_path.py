"""The attention path an engine is built with (kvforge's CPU kernel or the pure-ONNX fallback): chosen by
llm_build, recorded in the engine dir and the profile, refused in one line where it cannot run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import onnx
import pytest
from support.cli_checks import assert_one_line_error
from support.ort_support import cpu_kernel_on

from kvforge.builder.build import BuildOptions, build_engine, resolve_cpu_attention
from kvforge.contract.engine_dir import ATTENTION_CPU_KERNEL, ATTENTION_ONNX_OPS, load_engine_dir
from kvforge.contract.errors import InvalidConfig
from kvforge.plugins import cpu_kernel, ops
from kvforge.plugins.cpu_kernel import kernel_status

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=2, tokens_per_page=16)


def _attention_nodes(engine_dir: Path) -> set[str]:
    graph = onnx.load(engine_dir / "model.onnx", load_external_data=False).graph
    return {f"{n.domain}.{n.op_type}" for n in graph.node if n.op_type in ("PagedAttention", "PagedAttentionRope",
                                                                              "GroupQueryAttention")}


def test_onnx_choice_lowers_stock_ops_and_records_it(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    build_engine(tiny_onnx_dir, tmp_path / "engine", _options("onnx"))
    assert load_engine_dir(tmp_path / "engine").build.attention == ATTENTION_ONNX_OPS
    assert _attention_nodes(tmp_path / "engine") == {"com.microsoft.GroupQueryAttention"}


def _options(choice: str) -> BuildOptions:
    return replace(BUILD, cpu_attention=choice)


def test_auto_follows_the_kernel_switch(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    """auto = the kernel where it builds (this run's switch decides), recorded and lowered alike."""
    build_engine(tiny_onnx_dir, tmp_path / "engine", _options("auto"))
    expected = ATTENTION_CPU_KERNEL if cpu_kernel_on() else ATTENTION_ONNX_OPS
    assert load_engine_dir(tmp_path / "engine").build.attention == expected
    nodes = _attention_nodes(tmp_path / "engine")
    kernel = {f"{ops.CPU_DOMAIN}.{ops.CPU_PAGED_ATTENTION_ROPE.name}"}  # RoPE and the K/V write in the kernel
    assert nodes == (kernel if cpu_kernel_on() else {"com.microsoft.GroupQueryAttention"})


def test_kernel_choice_without_the_kernel_is_one_line(tiny_onnx_dir: Path, tmp_path: Path, run_cli,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFORGE_CPU_KERNEL", "off")
    with pytest.raises(InvalidConfig) as info:
        resolve_cpu_attention("kernel", head_dim=64)
    assert info.value.field == "cpu_attention" and "KVFORGE_CPU_KERNEL" in info.value.message
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "engine", "--cpuAttention",
                    "kernel"])
    assert_one_line_error(proc, "--cpuAttention")
    assert not (tmp_path / "engine").exists()  # refused before anything was written
    assert_one_line_error(run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "e2",
                                   "--cpuAttention", "fast"]), "--cpuAttention", "auto")


def test_build_cli_prints_the_path(tiny_onnx_dir: Path, tmp_path: Path, run_cli) -> None:
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "engine", "--cpuAttention",
                    "onnx", "--maxInputLen", "64", "--maxKVCacheCapacity", "256"])
    assert proc.returncode == 0, proc.stderr
    assert f"attention {ATTENTION_ONNX_OPS}" in " ".join((proc.stdout + proc.stderr).split())
    assert "kernel target" not in proc.stdout + proc.stderr  # no kernel in this engine: no kernel line


@pytest.mark.skipif(not cpu_kernel_on(), reason=f"kvforge CPU kernel unavailable: {kernel_status()[1]}")
def test_build_cli_names_the_cpu_and_kernel_target(tiny_onnx_dir: Path, tmp_path: Path, run_cli,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernel.TARGET_ENV, "sse4")  # every x86-64 CPU kvforge runs on has SSE4
    proc = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "engine", "--cpuAttention",
                    "kernel", "--maxInputLen", "64", "--maxKVCacheCapacity", "256"])
    assert proc.returncode == 0, proc.stderr
    assert "; kernel target sse4" in " ".join((proc.stdout + proc.stderr).split())


def test_profile_names_the_path(tiny_engine_dir: Path, tmp_path: Path, run_cli) -> None:
    request = tmp_path / "in.json"
    request.write_text(json.dumps({"requests": [{"messages": [{"role": "user", "content": "hi"}],
                                                 "max_generate_length": 2}], "temperature": 0}))
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", request, "--outputFile",
                    tmp_path / "out.json", "--profileOutputFile", tmp_path / "profile.json", "--dumpProfile"])
    assert proc.returncode == 0, proc.stderr
    profile = json.loads((tmp_path / "profile.json").read_text())
    attention = load_engine_dir(tiny_engine_dir).build.attention
    cpu = profile["engine"].pop("cpu")
    assert profile["engine"] == {"backend": "onnxruntime", "attention": attention}
    # The CPU the figures came from: its model, SIMD features and the kernel target that ran (issue 50).
    assert cpu["cpu_model"] and isinstance(cpu["simd"], list)
    if attention == ATTENTION_CPU_KERNEL:
        library = kernel_status()[0]
        assert library is not None and cpu["kernel_target"] == cpu_kernel.runnable_targets(library)[0]
        assert f"kernel target {cpu['kernel_target']}" in " ".join((proc.stdout + proc.stderr).split())


@pytest.mark.skipif(not cpu_kernel_on(), reason=f"kvforge CPU kernel unavailable: {kernel_status()[1]}")
def test_kernel_engine_where_the_kernel_is_off_is_one_line(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    build_engine(tiny_onnx_dir, tmp_path / "engine", _options("kernel"))
    request = tmp_path / "in.json"
    request.write_text(json.dumps({"requests": [{"messages": [{"role": "user", "content": "hi"}]}]}))
    env = {**os.environ, "KVFORGE_CPU_KERNEL": "off"}
    proc = subprocess.run([str(Path(sys.executable).parent / "llm_inference"), "--engineDir", str(tmp_path / "engine"),
                           "--inputFile", str(request), "--outputFile", str(tmp_path / "out.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert_one_line_error(proc, "--engineDir", "--cpuAttention onnx")
    assert not (tmp_path / "out.json").exists()


def test_old_engine_dirs_read_as_the_fallback(tiny_engine_dir: Path, tmp_path: Path) -> None:
    """Engine dirs written before the kernel have no builder_config.attention: they were lowered to stock ops."""
    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["builder_config"].pop("attention")
    (copy / "config.json").write_text(json.dumps(config))
    from kvforge.contract.manifest import ENGINE_KIND, write_manifest
    write_manifest(copy, ENGINE_KIND)
    assert load_engine_dir(copy).build.attention == ATTENTION_ONNX_OPS
    config["builder_config"]["attention"] = "turbo"
    (copy / "config.json").write_text(json.dumps(config))
    write_manifest(copy, ENGINE_KIND)
    with pytest.raises(InvalidConfig) as info:
        load_engine_dir(copy)
    assert info.value.field == "builder_config.attention"


def test_head_widths_the_kernel_lacks_take_the_fallback() -> None:
    """auto lowers a model whose heads the kernel cannot take (not a multiple of 16) to stock ops; kernel refuses."""
    assert resolve_cpu_attention("auto", head_dim=8) == ATTENTION_ONNX_OPS
    with pytest.raises(InvalidConfig) as info:
        resolve_cpu_attention("kernel", head_dim=72)
    assert info.value.field == "cpu_attention" and "72" in info.value.message
