"""kvforge/builder/fuse_ort.py: residual Add + RMSNorm as ONNX Runtime's SkipSimplifiedLayerNormalization, same
results."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from kvforge.builder.fuse_ort import SKIP_RMS_NORM, fuse_for_onnxruntime
from kvforge.graph.onnx_graph import FLOAT, GraphWriter, value_info

HIDDEN = 32
OPSET = 18  # ReduceMean takes its axes as an input, as the exporter writes it


def _model(bias: bool = False, leak: bool = False) -> onnx.ModelProto:
    """Two residual blocks as the exporter writes them: h = a + b; x = rms_norm(h) @ W; h2 = h + x; out = norm(h2).
    `bias`: the first Add adds an initializer (not a residual); `leak`: the norm's variance is also an output."""
    rng = np.random.default_rng(0)
    g = GraphWriter()
    other = g.weight("bias", rng.standard_normal(HIDDEN).astype(np.float32)) if bias else "b"
    hidden = g.add("a", other)
    x = g.rms_norm(hidden, g.weight("w1", rng.standard_normal(HIDDEN).astype(np.float32)), 1e-6)
    x = g.matmul(x, g.weight("proj", rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)))
    hidden2 = g.add(hidden, x)
    out = g.rms_norm(hidden2, g.weight("w2", rng.standard_normal(HIDDEN).astype(np.float32)), 1e-5)
    g.op("Identity", [out], outputs=["out"])
    g.op("Identity", [hidden2], outputs=["residual"])
    outputs = [value_info("out", FLOAT, ["B", "S", HIDDEN]), value_info("residual", FLOAT, ["B", "S", HIDDEN])]
    if leak:
        variance = next(n for n in g.nodes if n.op_type == "ReduceMean").output[0]
        g.op("Identity", [variance], outputs=["variance"])
        outputs.append(value_info("variance", FLOAT, ["B", "S", 1]))
    inputs = [value_info(name, FLOAT, ["B", "S", HIDDEN]) for name in (["a"] if bias else ["a", "b"])]
    graph = helper.make_graph(g.nodes, "blocks", inputs, outputs, g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # only what the graph says
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _feeds(bias: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {"a": rng.standard_normal((2, 5, HIDDEN)).astype(np.float32)}
    if not bias:
        feeds["b"] = rng.standard_normal((2, 5, HIDDEN)).astype(np.float32)
    return feeds


def test_residual_norms_fuse_and_agree() -> None:
    reference = _model()
    fused = _model()
    assert fuse_for_onnxruntime(fused) == 2
    onnx.checker.check_model(fused)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count(SKIP_RMS_NORM) == 2 and not {"Pow", "ReduceMean", "Sqrt", "Div", "Add"} & set(ops)
    assert len(ops) < len(reference.graph.node)
    # The sum leaves as the fused node's fourth output: the next residual and the graph output still read it.
    for got, want in zip(_run(fused, _feeds()), _run(reference, _feeds()), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_bias_add_is_not_a_residual() -> None:
    model = _model(bias=True)
    assert fuse_for_onnxruntime(model) == 1  # only the second block's residual
    np.testing.assert_allclose(_run(model, _feeds(True))[0], _run(_model(bias=True), _feeds(True))[0], rtol=1e-5,
                               atol=1e-5)


def test_a_norm_whose_intermediate_is_read_elsewhere_stays() -> None:
    model = _model(leak=True)
    assert fuse_for_onnxruntime(model) == 1
    assert any(n.op_type == "ReduceMean" for n in model.graph.node)
    np.testing.assert_allclose(_run(model, _feeds())[2], _run(_model(leak=True), _feeds())[2], rtol=1e-6)


def test_nothing_to_fuse_leaves_the_graph_alone() -> None:
    g = GraphWriter()
    g.op("Relu", ["a"], outputs=["out"])
    graph = helper.make_graph(g.nodes, "plain", [value_info("a", FLOAT, [2])], [value_info("out", FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    before = model.SerializeToString()
    assert fuse_for_onnxruntime(model) == 0
    assert model.SerializeToString() == before
