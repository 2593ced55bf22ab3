"""PagedAttentionRope reading the packed q/k/v projection (kvforge/builder/pack_qkv.py, attribute packed_qkv) against
the engines built before (a Split hands it q, k and v): one node less a layer, the same pools and logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from support.ort_support import cpu_kernel_on

import kvforge.builder.build as build_module
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.pack_qkv import pack_attention_inputs
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.plugins import ops
from kvforge.plugins.cpu_kernel import kernel_status
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.ort import OrtBackend

pytestmark = pytest.mark.skipif(not cpu_kernel_on(), reason=f"kvforge CPU kernel unavailable: {kernel_status()[1]}")

BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=2, tokens_per_page=16,
                     cpu_attention="kernel")


@pytest.fixture(scope="module")
def engines(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the attention reads the packed projection, the form built before: a Split in between)."""
    root = tmp_path_factory.mktemp("pack_qkv")
    build_engine(tiny_onnx_dir, root / "packed", BUILD)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module, "pack_attention_inputs", lambda _model: 0)
        build_engine(tiny_onnx_dir, root / "split", BUILD)
    return root / "packed", root / "split"


def _graph(engine_dir: Path) -> onnx.GraphProto:
    return onnx.load(engine_dir / "model.onnx", load_external_data=False).graph


def test_the_split_leaves_and_the_attention_reads_the_packed_tensor(engines: tuple[Path, Path]) -> None:
    packed, split = (_graph(path) for path in engines)
    layers = load_engine_dir(engines[0]).model.num_hidden_layers
    attention = [n for n in packed.node if n.op_type == ops.CPU_PAGED_ATTENTION_ROPE.name]
    assert len(attention) == layers
    for node in attention:
        assert node.input[0] == node.input[1] == node.input[2]
        assert {a.name: a.i for a in node.attribute}["packed_qkv"] == 1
    assert sum(n.op_type == "Split" for n in split.node) - sum(n.op_type == "Split" for n in packed.node) == layers
    assert len(split.node) - len(packed.node) >= layers


def test_same_pools_and_logits_as_the_split_form(engines: tuple[Path, Path]) -> None:
    packed_dir, split_dir = engines
    packed = OrtBackend(load_engine_dir(packed_dir), num_threads=2)
    split = OrtBackend(load_engine_dir(split_dir), num_threads=2)
    rng = np.random.default_rng(5)
    hidden = load_engine_dir(packed_dir).model.hidden_size
    pages, starts = [[4, 1, 7], [2, 6, 0]], np.zeros(2, dtype=np.int32)
    for lengths in ([18, 11], [5, 9], [1, 1], [1, 0]):  # prefill chunks across a page, then decode rows
        lengths = np.array(lengths, dtype=np.int32)
        step = StepInputs(inputs_embeds=rng.standard_normal((2, int(lengths.max()), hidden)).astype(np.float32),
                          context_lengths=lengths, kvcache_start_index=starts.copy(), page_ids=pages)
        got, want = packed.forward(step), split.forward(step)
        np.testing.assert_array_equal(got.logits, want.logits)
        for mine, theirs in zip(packed.kv_store.layers, split.kv_store.layers, strict=True):
            np.testing.assert_array_equal(mine, theirs)
        starts = starts + lengths
    assert any(layer.any() for layer in packed.kv_store.layers)


def test_only_the_exact_pattern_is_packed() -> None:
    """A Split whose k output something else reads too (or of other widths) stays."""
    from onnx import TensorProto, helper, numpy_helper

    def model(widths: list[int], extra_reader: bool) -> onnx.ModelProto:
        nodes = [helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1),
                 helper.make_node(ops.CPU_PAGED_ATTENTION_ROPE.name, ["q", "k", "v", "pool", "table", "start", "len",
                                                                      "rope"], ["out"], domain=ops.CPU_DOMAIN,
                                  num_q_heads=2, num_kv_heads=1, head_dim=16, tokens_per_page=16)]
        outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
        if extra_reader:
            nodes.append(helper.make_node("Identity", ["k"], ["k_copy"]))
            outputs.append(helper.make_tensor_value_info("k_copy", TensorProto.FLOAT, None))
        graph = helper.make_graph(nodes, "g", [], outputs,
                                  [numpy_helper.from_array(np.array(widths, dtype=np.int64), "sizes")])
        return helper.make_model(graph)

    assert pack_attention_inputs(exact := model([32, 16, 16], False)) == 1
    assert [n.op_type for n in exact.graph.node] == [ops.CPU_PAGED_ATTENTION_ROPE.name]
    assert not exact.graph.initializer  # the sizes went with the Split
    assert pack_attention_inputs(model([32, 16, 16], True)) == 0
    assert pack_attention_inputs(model([16, 16, 32], False)) == 0
