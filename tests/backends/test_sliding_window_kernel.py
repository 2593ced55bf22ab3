"""Sliding-window attention (Gemma's local layers): the CPU kernel's `sliding_window` attribute against the numpy
reference, and the reference against a plain masked softmax written out here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from support.ort_support import POOL_ELEM

from kvforge.plugins import ops, reference
from kvforge.plugins.reference import to_storage

TOLERANCE = 1e-5
HEADS, KV_HEADS, DIM = 4, 2, 32


def _session(library: Path, tokens_per_page: int, window: int, dtype: str) -> ort.InferenceSession:
    inputs = [
        helper.make_tensor_value_info("query", TensorProto.FLOAT, ["B", "S", HEADS * DIM]),
        helper.make_tensor_value_info("new_kv", TensorProto.FLOAT, ["B", "S", 2, KV_HEADS, DIM]),
        helper.make_tensor_value_info("pool", POOL_ELEM[dtype], ["N", 2, KV_HEADS, tokens_per_page, DIM]),
        helper.make_tensor_value_info("kv_page_table", TensorProto.INT32, ["B", "W"]),
        helper.make_tensor_value_info("kvcache_start_index", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("context_lengths", TensorProto.INT32, ["B"]),
    ]
    node = helper.make_node(ops.CPU_PAGED_ATTENTION.name, [i.name for i in inputs], ["out"], domain=ops.CPU_DOMAIN,
                            num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, tokens_per_page=tokens_per_page,
                            scale=DIM ** -0.5, sliding_window=window)
    graph = helper.make_graph([node], "windowed", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                                                         None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ops.CPU_DOMAIN,
                                                                                                     1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(starts: list[int], lengths: list[int], tokens_per_page: int, dtype: str,
           seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    seq, batch = max(lengths), len(starts)
    width = max(-(-s // tokens_per_page) for s in [*starts, 1])
    num_pages = batch * width + 2
    table = rng.permutation(num_pages)[:batch * width].reshape(batch, width).astype(np.int32)
    pool = to_storage(rng.standard_normal((num_pages, 2, KV_HEADS, tokens_per_page, DIM)).astype(np.float32), dtype)
    new_kv = reference.round_to_storage(rng.standard_normal((batch, seq, 2, KV_HEADS, DIM)).astype(np.float32), dtype)
    return {"query": rng.standard_normal((batch, seq, HEADS * DIM)).astype(np.float32), "new_kv": new_kv,
            "pool": pool, "kv_page_table": table, "kvcache_start_index": np.array(starts, np.int32),
            "context_lengths": np.array(lengths, np.int32)}


def _reference(feeds: dict[str, np.ndarray], window: int, dtype: str) -> np.ndarray:
    return reference.paged_attention_rows(
        feeds["query"], feeds["new_kv"], feeds["pool"], feeds["kv_page_table"], feeds["kvcache_start_index"],
        feeds["context_lengths"], num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scale=DIM ** -0.5,
        kv_cache_dtype=dtype, sliding_window=window)


CASES = {  # (starts, lengths, tokens per page, window, dtype)
    "decode-past-the-window": ([200, 31], [1, 1], 16, 32, "fp32"),
    "chunk-crossing-the-window-edge": ([40, 0], [70, 45], 16, 32, "fp16"),
    "window-not-a-page-multiple": ([97], [20], 16, 7, "fp8"),
    "window-longer-than-the-context": ([10], [5], 4, 512, "fp32"),
    "window-of-one": ([50], [3], 8, 1, "fp32"),
    "split-decode-of-a-long-row": ([1600], [1], 64, 100, "fp16"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_window_matches_reference(library: Path, name: str) -> None:
    starts, lengths, page, window, dtype = CASES[name]
    feeds = _feeds(starts, lengths, page, dtype)
    got = _session(library, page, window, dtype).run(None, feeds)[0]
    np.testing.assert_allclose(got, _reference(feeds, window, dtype), rtol=0, atol=TOLERANCE)
    if window < starts[0]:  # the window must change the answer, or the case tests nothing
        assert not np.allclose(got, _reference(feeds, 0, dtype), atol=1e-3)


def test_reference_window_is_a_plain_masked_softmax() -> None:
    """One row, fp32, written out: query at position p sees keys p - window + 1 .. p."""
    window, start, length = 5, 12, 4
    feeds = _feeds([start], [length], 4, "fp32", seed=3)
    got = _reference(feeds, window, "fp32")[0]
    keys, values = reference.gather_sequence_kv(feeds["pool"], feeds["kv_page_table"][0], start, "fp32")
    keys = np.concatenate([keys, feeds["new_kv"][0, :, 0].transpose(1, 0, 2)], axis=1)  # [Hkv, start+length, D]
    values = np.concatenate([values, feeds["new_kv"][0, :, 1].transpose(1, 0, 2)], axis=1)
    for i in range(length):
        p = start + i
        for h in range(HEADS):
            q = feeds["query"][0, i, h * DIM:(h + 1) * DIM].astype(np.float64)
            k, v = keys[h // (HEADS // KV_HEADS), p - window + 1:p + 1], values[h // (HEADS // KV_HEADS),
                                                                                  p - window + 1:p + 1]
            scores = k @ q * DIM ** -0.5
            probs = np.exp(scores - scores.max())
            np.testing.assert_allclose(got[i, h * DIM:(h + 1) * DIM], probs / probs.sum() @ v, atol=1e-5)


def test_negative_window_is_refused(library: Path) -> None:
    with pytest.raises(Exception, match="sliding_window"):
        _session(library, 16, -1, "fp32")


def test_backends_without_a_window_refuse_sliding_layers_in_one_line(tmp_path: Path) -> None:
    """TensorRT (its CUDA kernels attend over every cached position) and tree verification (a tree's positions are
    not start + i) refuse a Gemma graph, each naming what to change."""
    from kvforge.builder.build import BuildOptions
    from kvforge.builder.lower_ort import lower_for_onnxruntime
    from kvforge.builder.trt_build import build_tensorrt_engine
    from kvforge.contract.errors import InvalidConfig
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    loaded = synthetic_model("tiny-gemma3")
    write_onnx_dir(loaded, tmp_path / "onnx")
    geometry = BuildOptions(max_input_len=64, max_kv_cache_capacity=128).geometry(4096)
    with pytest.raises(InvalidConfig, match="sliding-window .* --backend onnxruntime") as refused:
        build_tensorrt_engine(tmp_path / "onnx", tmp_path / "engine", loaded.config, geometry)
    assert refused.value.field == "backend" and not (tmp_path / "engine").exists()
    model = onnx.load(tmp_path / "onnx" / "model.onnx")
    with pytest.raises(InvalidConfig, match="tree attention .* sliding-window"):
        lower_for_onnxruntime(model, kv_cache_dtype="fp16", tokens_per_page=16, num_pages=8, cpu_kernel=True,
                              tree_inputs=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.integers(0, 150), st.integers(0, 40)), min_size=1, max_size=3),
       window=st.integers(1, 80), page=st.sampled_from([4, 16, 64]), dtype=st.sampled_from(["fp32", "fp16"]),
       seed=st.integers(0, 2**16))
def test_kernel_window_property(library: Path, rows: list[tuple[int, int]], window: int, page: int, dtype: str,
                                seed: int) -> None:
    """Any batch (rows of any cached length, chunk length 0 included), any window and page size: kernel = reference."""
    starts, lengths = [s for s, _ in rows], [n for _, n in rows]
    if not any(lengths):
        lengths[0] = 1
    feeds = _feeds(starts, lengths, page, dtype, seed)
    got = _session(library, page, window, dtype).run(None, feeds)[0]
    np.testing.assert_allclose(got, _reference(feeds, window, dtype), rtol=0, atol=TOLERANCE)
