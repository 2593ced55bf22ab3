"""kvforge.cpu.SwiGLU (kvforge/plugins/cpu/swiglu.cc) and its lowering (kvforge/builder/lower_swiglu.py): a gated
MLP's Split,
Sigmoid, Mul and Mul as one node on kernel engines, against the float64 reference and against the unfused engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.builder import build as build_module
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.lower_swiglu import lower_swiglu
from kvforge.contract.lora import LORA_TARGETS
from kvforge.plugins import reference
from kvforge.plugins.ops import CPU_DOMAIN, CPU_SWIGLU
from kvforge.runtime.api import LLM
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.quantize_model import quantize_linears
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid(CPU_DOMAIN, 1)]
BUILD = {"max_input_len": 64, "max_kv_cache_capacity": 256, "max_batch_size": 1, "tokens_per_page": 16}


def _session(width: int, library: Path) -> ort.InferenceSession:
    node = helper.make_node(CPU_SWIGLU.name, ["x"], ["y"], domain=CPU_DOMAIN)
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, 2 * width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, width])])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(helper.make_model(graph, opset_imports=OPSETS).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _inputs(rng: np.random.Generator, batch: int, rows: int, width: int) -> np.ndarray:
    x = (rng.standard_normal((batch, rows, 2 * width)) * 6).astype(np.float32)
    x[..., 0], x[..., 1] = 95.0, -95.0  # where exp over- and underflows: sigmoid 1 and 0
    return x


@pytest.mark.parametrize("width", [8, 24, 1536])
@pytest.mark.parametrize(("batch", "rows"), [(1, 1), (1, 5), (2, 40)])
def test_it_matches_the_float64_reference(library: Path, width: int, batch: int, rows: int) -> None:
    x = _inputs(np.random.default_rng(width + rows), batch, rows, width)
    y = _session(width, library).run(None, {"x": x})[0]
    assert y.shape == (batch, rows, width)
    expected = reference.swiglu(x)
    np.testing.assert_allclose(y, expected, rtol=2e-6, atol=1e-30)
    assert np.all(np.isfinite(y)) and np.abs(y[..., 1]).max() < 1e-30  # gate -95: sigmoid ~ 0
    np.testing.assert_array_equal(y[..., 0], np.float32(95.0) * x[..., width])  # gate 95: sigmoid exactly 1


def test_a_row_is_the_same_bits_whatever_the_row_count(library: Path) -> None:
    x = _inputs(np.random.default_rng(3), 1, 33, 1536)
    session = _session(1536, library)
    many = session.run(None, {"x": x})[0]
    for row in (0, 17, 32):
        assert np.array_equal(session.run(None, {"x": x[:, row:row + 1]})[0][0, 0], many[0, row])


def test_every_runnable_target_agrees_with_the_reference(library: Path, each_target) -> None:
    """Each compiled target this CPU runs, forced in turn: the reference, and a row alone equals it among many."""
    x = _inputs(np.random.default_rng(4), 1, 6, 40)
    for target in each_target():
        session = _session(40, library)
        got = session.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, reference.swiglu(x), rtol=2e-6, atol=1e-30, err_msg=target)
        assert np.array_equal(session.run(None, {"x": x[:, 3:4]})[0][0, 0], got[0, 3]), target


def _gated_graph(output_silu: bool = False) -> onnx.ModelProto:
    """x @ W -> Split -> silu(gate) * up, as the export writes it; `output_silu` also makes silu(gate) an output."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Split", ["h", "sizes"], ["gate", "up"], axis=-1),
             helper.make_node("Sigmoid", ["gate"], ["s"]),
             helper.make_node("Mul", ["gate", "s"], ["silu"]),
             helper.make_node("Mul", ["silu", "up"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if output_silu:
        outputs.append(helper.make_tensor_value_info("silu", TensorProto.FLOAT, None))
    w = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])], outputs,
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([6, 6]), "sizes")])
    return helper.make_model(graph, opset_imports=OPSETS)


def test_the_lowering_replaces_the_pattern_and_keeps_the_values(library: Path) -> None:
    model = _gated_graph()
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert lower_swiglu(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMul", CPU_SWIGLU.name]
    assert [t.name for t in model.graph.initializer] == ["w"]  # the Split's sizes went with it
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    after = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


def test_an_intermediate_read_elsewhere_keeps_the_layer_as_it_is() -> None:
    model = _gated_graph(output_silu=True)
    assert lower_swiglu(model) == 0
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Split", "Sigmoid", "Mul", "Mul"]
    assert [t.name for t in model.graph.initializer] == ["w", "sizes"]


def _tiny_onnx(tmp_path: Path, lora: bool = False) -> tuple[Path, int]:
    loaded = synthetic_model("tiny-llama")
    if lora:
        loaded.config.lora_targets = list(LORA_TARGETS)
    quantize_linears(loaded, "int4", 32)
    write_onnx_dir(loaded, tmp_path / "onnx")
    return tmp_path / "onnx", loaded.config.eos_token_ids[0]


def _op_count(engine_dir: Path, op_type: str) -> int:
    return [n.op_type for n in onnx.load(engine_dir / "model.onnx", load_external_data=False).graph.node].count(op_type)


def test_the_engine_answers_as_the_unfused_one(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    del library  # the kernel engine needs it
    onnx_dir, eos = _tiny_onnx(tmp_path)
    params = SamplingParams(temperature=0.0, top_k=1, max_generate_length=12, num_logprobs=1, logit_bias={eos: -100.0})
    prompt = [5, 17, 33, 2, 81, 40, 12, 9, 77, 64]
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(build_module, "lower_swiglu", lambda model: 0)
        engine_dir = tmp_path / f"engine-{fused}"
        build_engine(onnx_dir, engine_dir, BuildOptions(**BUILD))
        layers = _op_count(engine_dir, "PagedAttentionRope")
        assert _op_count(engine_dir, CPU_SWIGLU.name) == (layers if fused else 0)
        assert _op_count(engine_dir, "Sigmoid") == (0 if fused else layers)
        out = LLM(engine_dir).generate([prompt], params)[0]
        runs[fused] = (out.token_ids, [[lp.logprob for lp in step] for step in out.logprobs])
    assert runs[True][0] == runs[False][0]
    np.testing.assert_allclose(runs[True][1], runs[False][1], atol=1e-4)


def test_a_lora_engine_keeps_the_graph_form_where_gate_and_up_take_deltas(library: Path, tmp_path: Path) -> None:
    """With LoRA inputs on gate and up, a delta Add sits between the Split and the activation: not the pattern."""
    del library
    onnx_dir, _ = _tiny_onnx(tmp_path, lora=True)
    engine_dir = tmp_path / "engine"
    build_engine(onnx_dir, engine_dir, BuildOptions(**BUILD, max_lora_rank=4))
    assert _op_count(engine_dir, CPU_SWIGLU.name) == 0
    assert _op_count(engine_dir, "Sigmoid") == _op_count(engine_dir, "PagedAttentionRope") > 0
