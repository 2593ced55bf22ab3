"""Engines whose CPU kernel rotates Q/K and writes the K/V pool itself (PagedAttentionRope) against the engines built
before (the graph rotates, returns new_key_values_* and the runtime scatters them): same pools, same logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.ort_support import cpu_kernel_on

import kvforge.builder.build as build_module
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import ATTENTION_CPU_KERNEL, load_engine_dir
from kvforge.contract.manifest import ENGINE_KIND, write_manifest
from kvforge.plugins import ops
from kvforge.plugins.cpu_kernel import kernel_status
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.ort import OrtBackend

pytestmark = [pytest.mark.skipif(not cpu_kernel_on(), reason=f"kvforge CPU kernel unavailable: {kernel_status()[1]}"),
              pytest.mark.in_process]  # run_cli in this process: the process is not the point here

BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=2, tokens_per_page=16,
                     cpu_attention="kernel")


@pytest.fixture(scope="module")
def engines(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(kernel writes K/V, the variant built before: the lowering without kernel_rope)."""
    root = tmp_path_factory.mktemp("kv_write")
    build_engine(tiny_onnx_dir, root / "new", BUILD)
    lower = build_module.lower_for_onnxruntime
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module, "lower_for_onnxruntime", lambda *a, **k: lower(*a, **{**k, "kernel_rope": False}))
        build_engine(tiny_onnx_dir, root / "old", BUILD)
    return root / "new", root / "old"


def _graph(engine_dir: Path) -> onnx.GraphProto:
    return onnx.load(engine_dir / "model.onnx", load_external_data=False).graph


def test_the_variant_is_recorded_and_lowered(engines: tuple[Path, Path]) -> None:
    new, old = engines
    assert load_engine_dir(new).build.kernel_kv_write and not load_engine_dir(old).build.kernel_kv_write
    assert load_engine_dir(new).build.attention == ATTENTION_CPU_KERNEL
    new_graph, old_graph = _graph(new), _graph(old)
    attention_ops = {n.op_type for n in new_graph.node if n.domain == ops.CPU_DOMAIN} - {ops.CPU_SWIGLU.name}
    assert attention_ops == {ops.CPU_PAGED_ATTENTION_ROPE.name}
    assert not [o.name for o in new_graph.output if o.name.startswith("new_key_values_")]
    assert [o.name for o in old_graph.output if o.name.startswith("new_key_values_")]
    # RoPE went into the kernel: no rotate-half subgraph (and no table Gather) is left in the graph.
    assert not [n for n in new_graph.node if n.op_type == "Gather" and n.input[0] == "rope_rotary_cos_sin"]
    assert len(new_graph.node) < len(old_graph.node)


def test_engine_dirs_without_the_key_read_as_the_scatter_variant(engines: tuple[Path, Path], tmp_path: Path) -> None:
    copy = tmp_path / "engine"
    shutil.copytree(engines[1], copy)
    config = json.loads((copy / "config.json").read_text())
    config["builder_config"].pop("kernel_kv_write")
    (copy / "config.json").write_text(json.dumps(config))
    write_manifest(copy, ENGINE_KIND)
    assert load_engine_dir(copy).build.kernel_kv_write is False


def _calls(hidden: int) -> list[StepInputs]:
    """Two rows: a prefill chunk, a second chunk across a page boundary, then three decode steps."""
    rng = np.random.default_rng(3)
    pages = [[4, 1, 7], [2, 6, 0]]
    calls, starts = [], np.array([0, 0], dtype=np.int32)
    for lengths in ([18, 11], [5, 9], [1, 1], [1, 1], [1, 0]):
        lengths = np.array(lengths, dtype=np.int32)
        width = int(lengths.max())
        calls.append(StepInputs(inputs_embeds=rng.standard_normal((2, width, hidden)).astype(np.float32),
                                context_lengths=lengths, kvcache_start_index=starts.copy(), page_ids=pages))
        starts = starts + lengths
    return calls


def test_same_pools_and_logits_as_the_scatter_variant(engines: tuple[Path, Path]) -> None:
    new_dir, old_dir = engines
    new, old = OrtBackend(load_engine_dir(new_dir), num_threads=2), OrtBackend(load_engine_dir(old_dir), num_threads=2)
    for step in _calls(load_engine_dir(new_dir).model.hidden_size):
        got, want = new.forward(step), old.forward(step)
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        assert (got.logits.argmax(-1) == want.logits.argmax(-1)).all()
        for mine, theirs in zip(new.kv_store.layers, old.kv_store.layers, strict=True):
            np.testing.assert_array_equal(mine, theirs)
    assert any(layer.any() for layer in new.kv_store.layers)  # the kernel did write


def test_greedy_generation_is_unchanged(engines: tuple[Path, Path], tmp_path: Path, run_cli) -> None:
    request = tmp_path / "in.json"
    request.write_text(json.dumps({"requests": [{"messages": [{"role": "user", "content": "tell me a story"}],
                                                 "max_generate_length": 12, "temperature": 0.0}]}))
    answers = []
    for engine_dir in engines:
        out = tmp_path / f"{engine_dir.name}.json"
        proc = run_cli(["llm_inference", "--engineDir", engine_dir, "--inputFile", request, "--outputFile", out])
        assert proc.returncode == 0, proc.stderr
        answers.append([(r["output_text"], r["usage"]) for r in json.loads(out.read_text())["responses"]])
    assert answers[0] == answers[1]
