"""ONNX Runtime sessions over graphs a test lowered itself, on the attention path this run takes.

`make test` runs the engine tests twice: on kvforge's CPU kernel (when it builds here) and with
KVFORGE_CPU_KERNEL=off on the pure-ONNX fallback; tests that lower graphs by hand follow the same switch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from kvforge.plugins import ops
from kvforge.plugins.cpu_kernel import kernel_status, register

# The ONNX element type of a pool of each KV storage dtype (fp8 pools are bytes).
POOL_ELEM = {"fp16": TensorProto.FLOAT16, "fp8": TensorProto.UINT8, "fp32": TensorProto.FLOAT}


def cpu_kernel_on() -> bool:
    """Whether this run lowers attention to the CPU kernel (its library builds, KVFORGE_CPU_KERNEL is not off)."""
    return kernel_status()[0] is not None


def session_for(model: onnx.ModelProto | str) -> ort.InferenceSession:
    """A CPU session over a lowered graph (a model or a path), the kernel library registered when it needs it."""
    loaded = onnx.load(model, load_external_data=False) if isinstance(model, str) else model
    options = ort.SessionOptions()
    if any(node.domain == ops.CPU_DOMAIN for node in loaded.graph.node):
        reason = register(options)
        assert not reason, reason
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def rope_attention_session(library: Path, *, num_q: int, num_kv: int, head_dim: int, tokens_per_page: int,
                           dtype: str, tree: bool, rotary: int | None = None) -> ort.InferenceSession:
    """One kvforge.cpu.PagedAttentionRope node as a graph (its ten inputs; without `tree` the last two, explicit
    positions and the tree mask, left empty), on the CPU kernel library at `library`."""
    d, hq, hkv = head_dim, num_q, num_kv
    inputs = [
        helper.make_tensor_value_info("query", TensorProto.FLOAT, ["B", "S", hq * d]),
        helper.make_tensor_value_info("key", TensorProto.FLOAT, ["B", "S", hkv * d]),
        helper.make_tensor_value_info("value", TensorProto.FLOAT, ["B", "S", hkv * d]),
        helper.make_tensor_value_info("pool", POOL_ELEM[dtype], ["N", 2, hkv, tokens_per_page, d]),
        helper.make_tensor_value_info("kv_page_table", TensorProto.INT32, ["B", "W"]),
        helper.make_tensor_value_info("kvcache_start_index", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("context_lengths", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("rope_rotary_cos_sin", TensorProto.FLOAT, ["C", rotary or d]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT32, ["B", "S"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, ["B", "S", "S"]),
    ]
    names = [i.name for i in inputs]
    if not tree:
        names[8:] = ["", ""]
        inputs = inputs[:8]
    node = helper.make_node(ops.CPU_PAGED_ATTENTION_ROPE.name, names, ["out"], domain=ops.CPU_DOMAIN,
                            num_q_heads=hq, num_kv_heads=hkv, head_dim=d, tokens_per_page=tokens_per_page,
                            scale=float(d) ** -0.5)
    graph = helper.make_graph([node], "paged_attention_rope", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(ops.CPU_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def random_tree(rng: np.random.Generator, starts: list[int], seq: int) -> dict[str, np.ndarray]:
    """A random draft tree per row for PagedAttentionRope's tree inputs: each node's parent comes before it, it sees
    itself and its ancestors, and its RoPE position is the row's start + its depth."""
    batch = len(starts)
    mask = np.zeros((batch, seq, seq), dtype=bool)
    depth = np.zeros((batch, seq), dtype=np.int32)
    for b in range(batch):
        for i in range(seq):
            mask[b, i, i] = True
            if i:
                parent = int(rng.integers(0, i))
                mask[b, i] |= mask[b, parent]
                depth[b, i] = depth[b, parent] + 1
    positions = (depth + np.array(starts, dtype=np.int32)[:, None]).astype(np.int32)
    return {"attention_mask": mask, "position_ids": positions}
