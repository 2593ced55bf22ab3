"""The symmetric int4 scheme (`llm_export --int4Scheme symmetric`): blocks without zero points at accuracy level 4,
so a Q4_1 checkpoint's layers lose their block-sum correction matmuls, while Q4_0/Q8_0 blocks stay exact."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kvforge.contract.errors import KvforgeError
from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.quantize import (
    LM_HEAD,
    SYMMETRIC_ACCURACY_LEVEL,
    BlockQuantized,
    concat_columns,
    from_gguf_blocks,
    linear_weight_names,
    quantize,
)
from kvforge.tools.export.quantize_model import quantize_linears
from kvforge.tools.export.sources.synthetic import synthetic_model

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here


def _matmul_nbits(x: np.ndarray, blocks: BlockQuantized, level: int) -> np.ndarray:
    """One MatMulNBits node over `blocks`, run by ONNX Runtime."""
    inputs = ["x", "w", "s"] + ([] if blocks.zero_points is None else ["z"])
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=blocks.k, N=blocks.n,
                            bits=blocks.bits, block_size=blocks.block_size, accuracy_level=level)
    initializers = [onnx.numpy_helper.from_array(blocks.packed, "w"), onnx.numpy_helper.from_array(blocks.scales, "s")]
    if blocks.zero_points is not None:
        initializers.append(onnx.numpy_helper.from_array(blocks.zero_points, "z"))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, blocks.k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, blocks.n])], initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_symmetric_blocks_have_no_zero_points_and_run_as_dequantized() -> None:
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((48, 128)).astype(np.float32)  # [out, in]
    blocks = quantize(weight, 4, 32, symmetric=True)
    assert blocks.zero_points is None and blocks.offsets is None
    assert blocks.accuracy_level == SYMMETRIC_ACCURACY_LEVEL == 4
    # A block's step is its largest magnitude / 8, signed so that value maps to -8 exactly; the opposite side
    # reaches +7 only, so the error is at most one step there and half a step elsewhere (as a GGUF's Q4_0).
    step = np.abs(blocks.scales).reshape(48, 4)
    np.testing.assert_allclose(step, np.abs(weight.reshape(48, 4, 32)).max(-1) / 8, rtol=1e-6)
    error = np.abs(blocks.dequantize().T - weight).reshape(48, 4, 32)
    assert (error.max(-1) <= step * 1.0001).all() and error.mean() <= step.mean() / 3
    x = rng.standard_normal((3, 128)).astype(np.float32)
    expected = x @ blocks.dequantize()
    np.testing.assert_allclose(_matmul_nbits(x, blocks, 0), expected, rtol=1e-5, atol=1e-4)
    # int8 activations: close to, not equal to, the float product
    np.testing.assert_allclose(_matmul_nbits(x, blocks, 4), expected, rtol=0.02, atol=0.02 * np.abs(expected).max())
    with pytest.raises(KvforgeError) as info:
        quantize(weight, 8, 32, symmetric=True)
    assert info.value.field == "--int4Scheme"


def test_fusion_keeps_the_level_and_refuses_to_mix_levels() -> None:
    rng = np.random.default_rng(4)
    weights = [rng.standard_normal((16, 64)).astype(np.float32) for _ in range(2)]
    symmetric = [quantize(w, 4, 32, symmetric=True) for w in weights]
    joined = concat_columns(symmetric)
    assert joined is not None and joined.accuracy_level == 4 and joined.zero_points is None
    np.testing.assert_array_equal(joined.dequantize(), np.concatenate([b.dequantize() for b in symmetric], axis=1))
    raw = gguf.quants.quantize(weights[1], gguf.GGMLQuantizationType.Q4_0)
    q4_0 = from_gguf_blocks("Q4_0", raw, 64)  # exact, at the family's level-0 default
    assert concat_columns([symmetric[0], q4_0]) is None  # one projection per MatMulNBits instead


def _gguf_loaded(kinds: dict[str, str]):
    """tiny-llama whose linears hold a GGUF's blocks: `kinds` maps a module suffix to its block type."""
    loaded = synthetic_model("tiny-llama", kv_cache_dtype="fp32")
    for name in linear_weight_names(loaded.config)[:-1]:
        kind = next(k for suffix, k in kinds.items() if suffix in name)
        weight = loaded.weights[name]
        raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind])
        loaded.weights[name] = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(weight.shape)
        loaded.exact_blocks[name] = from_gguf_blocks(kind, raw, weight.shape[1])
    return loaded


def test_symmetric_scheme_requantizes_q4_1_and_keeps_q4_0_and_q8_0_exact() -> None:
    loaded = _gguf_loaded({"self_attn": "Q4_1", "mlp.gate": "Q4_0", "mlp.up": "Q4_0", "mlp.down": "Q8_0"})
    exact = dict(loaded.exact_blocks)
    quantize_linears(loaded, "int4", 32, lm_head="int4", lm_head_candidates=0, int4_scheme="symmetric")
    assert loaded.config.int4_scheme == "symmetric"
    for name, blocks in loaded.quantized.items():
        if "self_attn" in name or name == LM_HEAD:  # Q4_1 and float: quantized again, symmetric
            assert blocks is not exact.get(name)
            assert blocks.zero_points is None and blocks.offsets is None and blocks.accuracy_level == 4
        else:
            assert blocks is exact[name]  # Q4_0 / Q8_0: no second rounding


def test_asymmetric_scheme_keeps_q4_1_exact() -> None:
    loaded = _gguf_loaded({"": "Q4_1"})
    exact = dict(loaded.exact_blocks)
    quantize_linears(loaded, "int4", 32, int4_scheme="asymmetric")
    assert loaded.config.int4_scheme == "asymmetric"
    assert all(loaded.quantized[name] is blocks for name, blocks in exact.items())
    with pytest.raises(KvforgeError) as info:
        quantize_linears(loaded, "int4", 32, int4_scheme="q4_1")
    assert info.value.field == "--int4Scheme"


def test_export_records_the_scheme_and_old_configs_load(tmp_path: Path, run_cli) -> None:
    out = tmp_path / "onnx"
    proc = run_cli(["llm_export", "--synthetic", "tiny-llama", "--quantization", "int4", "--int4Scheme", "symmetric",
                    "--outputDir", out])
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["int4_scheme"] == "symmetric"
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    layers = [n for n in graph.node if n.op_type == "MatMulNBits" and helper.get_node_attr_value(n, "bits") == 4]
    assert len(layers) == 4 * 2  # tiny-llama's two layers: q/k/v, o, gate/up, down (the head is int8 by default)
    assert {helper.get_node_attr_value(n, "accuracy_level") for n in layers} == {4}
    assert all(len(n.input) == 3 for n in layers)  # no zero points
    del config["int4_scheme"]  # an export from before the field
    assert ModelConfig.from_dict(config).int4_scheme == ""
    bad = run_cli(["llm_export", "--synthetic", "tiny-llama", "--quantization", "int4", "--int4Scheme", "nf4",
                   "--outputDir", tmp_path / "bad"])
    assert bad.returncode == 2 and "--int4Scheme" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
