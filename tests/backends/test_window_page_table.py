"""The sliding-window group's page table: a row's table with -1 for the pages wholly before its window (what the
group has freed) gives the same attention as the full table, in the CPU kernel and in the numpy reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from kvforge.plugins import ops, reference

HEADS, KV_HEADS, DIM = 4, 2, 16
NO_PAGE = -1


def kernel_session(library: Path, tokens_per_page: int, window: int) -> ort.InferenceSession:
    inputs = [
        helper.make_tensor_value_info("query", TensorProto.FLOAT, ["B", "S", HEADS * DIM]),
        helper.make_tensor_value_info("new_kv", TensorProto.FLOAT, ["B", "S", 2, KV_HEADS, DIM]),
        helper.make_tensor_value_info("pool", TensorProto.FLOAT, ["N", 2, KV_HEADS, tokens_per_page, DIM]),
        helper.make_tensor_value_info("kv_page_table", TensorProto.INT32, ["B", "W"]),
        helper.make_tensor_value_info("kvcache_start_index", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("context_lengths", TensorProto.INT32, ["B"]),
    ]
    node = helper.make_node(ops.CPU_PAGED_ATTENTION.name, [i.name for i in inputs], ["out"], domain=ops.CPU_DOMAIN,
                            num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, tokens_per_page=tokens_per_page,
                            scale=DIM ** -0.5, sliding_window=window)
    graph = helper.make_graph([node], "window_table", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(ops.CPU_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def window_table(table: np.ndarray, starts: list[int], tokens_per_page: int, window: int) -> np.ndarray:
    """`table` with the pages the group frees for a row at each start: wholly before the window of its last page
    boundary (kvforge/runtime/context_cache/types/sliding_window.py keep_from), and garbage where they were."""
    out = table.copy()
    for row, start in enumerate(starts):
        boundary = start // tokens_per_page * tokens_per_page
        out[row, :max(boundary - window + 1, 0) // tokens_per_page] = NO_PAGE
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.integers(0, 150), st.integers(1, 20)), min_size=1, max_size=3),
       tokens_per_page=st.sampled_from([4, 8, 16]), window=st.integers(1, 48), seed=st.integers(0, 2**16))
def test_freed_pages_change_nothing(library: Path, rows: list[tuple[int, int]], tokens_per_page: int, window: int,
                                    seed: int) -> None:
    rng = np.random.default_rng(seed)
    starts, lengths = [s for s, _ in rows], [n for _, n in rows]
    width = max(-(-(s + n) // tokens_per_page) for s, n in rows)
    num_pages = len(rows) * width
    table = rng.permutation(num_pages).reshape(len(rows), width).astype(np.int32)
    feeds = {"query": rng.standard_normal((len(rows), max(lengths), HEADS * DIM)).astype(np.float32),
             "new_kv": rng.standard_normal((len(rows), max(lengths), 2, KV_HEADS, DIM)).astype(np.float32),
             "pool": rng.standard_normal((num_pages, 2, KV_HEADS, tokens_per_page, DIM)).astype(np.float32),
             "kv_page_table": table, "kvcache_start_index": np.array(starts, np.int32),
             "context_lengths": np.array(lengths, np.int32)}
    windowed = {**feeds, "kv_page_table": window_table(table, starts, tokens_per_page, window)}
    session = kernel_session(library, tokens_per_page, window)
    full, freed = (session.run(None, f)[0] for f in (feeds, windowed))
    valid = np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]
    np.testing.assert_array_equal(full[valid], freed[valid])

    def attend(f: dict[str, np.ndarray]) -> np.ndarray:
        return reference.paged_attention_rows(
            f["query"], f["new_kv"], f["pool"], f["kv_page_table"], f["kvcache_start_index"], f["context_lengths"],
            num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scale=DIM ** -0.5, kv_cache_dtype="fp32",
            sliding_window=window)

    np.testing.assert_allclose(attend(windowed)[valid], full[valid], atol=1e-5)
    np.testing.assert_array_equal(attend(feeds)[valid], attend(windowed)[valid])
