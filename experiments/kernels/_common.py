"""What the CPU-kernel scripts share: 30 SmolLM2-shaped attention layers as one ONNX graph, random paged feeds for
it, and a zero-copy timer (cpu_attention.py and cpu_targets.py time the same graph).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from kvforge.plugins import ops
from kvforge.plugins.reference import pool_numpy_dtype, round_to_storage, to_storage

LAYERS, NUM_Q, NUM_KV, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M
POOL_ELEM = {"fp16": TensorProto.FLOAT16, "fp8": TensorProto.UINT8, "fp32": TensorProto.FLOAT}
SCALE = HEAD_DIM ** -0.5


def attention_inputs(dtype: str, tokens_per_page: int) -> list[onnx.ValueInfoProto]:
    pools = [helper.make_tensor_value_info(f"past_key_values_{i}", POOL_ELEM[dtype],
                                           ["pages", 2, NUM_KV, tokens_per_page, HEAD_DIM]) for i in range(LAYERS)]
    return [helper.make_tensor_value_info("query", TensorProto.FLOAT, ["B", "S", NUM_Q * HEAD_DIM]),
            helper.make_tensor_value_info("new_kv", TensorProto.FLOAT, ["B", "S", 2, NUM_KV, HEAD_DIM]),
            helper.make_tensor_value_info("kv_page_table", TensorProto.INT32, ["B", "W"]),
            helper.make_tensor_value_info("kvcache_start_index", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("context_lengths", TensorProto.INT32, ["B"]), *pools]


def attention_outputs() -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(f"attn_{i}", TensorProto.FLOAT, ["B", "S", NUM_Q * HEAD_DIM])
            for i in range(LAYERS)]


def kernel_model(dtype: str, tokens_per_page: int) -> onnx.ModelProto:
    nodes = [helper.make_node(ops.CPU_PAGED_ATTENTION.name,
                              ["query", "new_kv", f"past_key_values_{i}", "kv_page_table", "kvcache_start_index",
                               "context_lengths"], [f"attn_{i}"], domain=ops.CPU_DOMAIN, num_q_heads=NUM_Q,
                              num_kv_heads=NUM_KV, head_dim=HEAD_DIM, tokens_per_page=tokens_per_page, scale=SCALE)
             for i in range(LAYERS)]
    graph = helper.make_graph(nodes, "kernel", attention_inputs(dtype, tokens_per_page), attention_outputs())
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(ops.CPU_DOMAIN, 1)])


def attention_feeds(cached: int, new: int, dtype: str, tokens_per_page: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    pages = -(-cached // tokens_per_page)
    feeds = {
        "query": rng.standard_normal((1, new, NUM_Q * HEAD_DIM)).astype(np.float32),
        "new_kv": round_to_storage(rng.standard_normal((1, new, 2, NUM_KV, HEAD_DIM)).astype(np.float32), dtype),
        "kv_page_table": rng.permutation(pages + 1)[:pages].astype(np.int32)[None],  # scattered, not in order
        "kvcache_start_index": np.array([cached], dtype=np.int32),
        "context_lengths": np.array([new], dtype=np.int32),
    }
    shape = (pages + 1, 2, NUM_KV, tokens_per_page, HEAD_DIM)
    for i in range(LAYERS):  # a pool per layer, so the step streams every layer's pages from memory as in a model
        pool = to_storage(rng.standard_normal(shape).astype(np.float32), dtype)
        feeds[f"past_key_values_{i}"] = pool.astype(pool_numpy_dtype(dtype))
    return feeds


def bound_timer(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> tuple[Callable[[], float], list]:
    binding = session.io_binding()
    for name, array in feeds.items():  # zero-copy: the OrtValues wrap the numpy buffers
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    outputs = [np.empty(feeds["query"].shape, dtype=np.float32) for _ in range(LAYERS)]
    for i, out in enumerate(outputs):
        binding.bind_ortvalue_output(f"attn_{i}", ort.OrtValue.ortvalue_from_numpy(out))

    def once() -> float:
        started = time.perf_counter()
        session.run_with_iobinding(binding)
        return (time.perf_counter() - started) * 1e3

    return once, outputs
