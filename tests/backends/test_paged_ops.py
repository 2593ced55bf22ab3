"""The ONNX Runtime lowering of the paged-KV ops equals their numpy reference on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from support.ort_support import cpu_kernel_on, session_for

from kvforge.builder.lower_ort import lower_for_onnxruntime
from kvforge.contract.engine_dir import new_rows_name
from kvforge.graph.onnx_graph import FLOAT, INT32, OPSET, GraphWriter, value_info
from kvforge.plugins import ops
from kvforge.plugins.cpu_kernel import kernel_status, supports_head_dim
from kvforge.plugins.reference import (
    from_storage,
    paged_attention,
    paged_kv_write,
    pool_numpy_dtype,
    rope_table,
    to_storage,
)
from kvforge.runtime.execution.kv_store import KVStore
from kvforge.tools.export.families.llama import POOL_ELEM_TYPES, rope_inputs

pytestmark = pytest.mark.attention_path  # assertions that depend on the attention lowering: run again on the fallback


def op_graph(num_q: int, num_kv: int, head_dim: int, kv_cache_dtype: str):
    """PagedKVWrite followed by PagedAttention, as export writes them for one layer."""
    g = GraphWriter()
    rope_inputs(g, "key")
    g.op(ops.PAGED_KV_WRITE.name, ["key", "value", "rope_rotary_cos_sin", "context_lengths", "kvcache_start_index",
                                   "kv_page_table", "past_key_values_0"], outputs=["present_key_values_0"],
         domain=ops.DOMAIN, num_kv_heads=num_kv, head_dim=head_dim, tokens_per_page=0)
    g.op(ops.PAGED_ATTENTION.name, ["query", "present_key_values_0", "context_lengths", "kvcache_start_index",
                                    "kv_page_table"], outputs=["attention"], domain=ops.DOMAIN,
         num_q_heads=num_q, num_kv_heads=num_kv, head_dim=head_dim, tokens_per_page=0, scale=head_dim ** -0.5)
    pool = POOL_ELEM_TYPES[kv_cache_dtype]
    inputs = [value_info("query", FLOAT, ["b", "s", num_q * head_dim]),
              value_info("key", FLOAT, ["b", "s", num_kv * head_dim]),
              value_info("value", FLOAT, ["b", "s", num_kv * head_dim]),
              value_info("rope_rotary_cos_sin", FLOAT, ["cap", head_dim]),
              value_info("context_lengths", INT32, ["b"]), value_info("kvcache_start_index", INT32, ["b"]),
              value_info("kv_page_table", INT32, ["b", "p"]),
              value_info("past_key_values_0", pool, ["n", 2, num_kv, "t", head_dim])]
    outputs = [value_info("attention", FLOAT, ["b", "s", num_q * head_dim]),
               value_info("present_key_values_0", pool, ["n", 2, num_kv, "t", head_dim])]
    graph = helper.make_graph(g.nodes, "ops", inputs, outputs, g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])


CASES = [  # (kv dtype, batch, max new tokens, tokens per page, head dim, q heads, kv heads)
    ("fp32", 1, 1, 4, 8, 2, 2), ("fp32", 3, 6, 4, 8, 4, 2), ("fp16", 2, 5, 8, 16, 4, 1),
    ("fp16", 4, 1, 4, 8, 8, 2), ("fp8", 2, 7, 4, 16, 4, 4), ("fp8", 3, 3, 8, 8, 6, 3),
    ("fp32", 2, 9, 2, 8, 2, 1), ("fp16", 1, 12, 16, 32, 4, 2),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["onnx-ops", "cpu-kernel"])
def test_lowering_matches_reference(case: tuple, seed: int, cpu_kernel: bool) -> None:
    """Both lowerings (stock ops over gathered pages, kvforge's CPU kernel reading them in place) against the
    reference: -1 entries past each row's pages, shuffled pages, chunks starting mid-page, GQA groups."""
    kv_dtype, batch, max_new, tokens_per_page, head_dim, num_q, num_kv = case
    if cpu_kernel and not cpu_kernel_on():
        pytest.skip(f"kvforge CPU kernel unavailable: {kernel_status()[1]}")
    if cpu_kernel and not supports_head_dim(head_dim):
        pytest.skip(f"the CPU kernel takes head_dim in multiples of 16 (llm_build lowers {head_dim} to stock ops)")
    rng = np.random.default_rng(seed)
    num_pages, capacity = 40, 64
    starts = rng.integers(0, 20, batch).astype(np.int32)
    lengths = rng.integers(1, max_new + 1, batch).astype(np.int32)
    seq = int(lengths.max())
    # Shuffled, non-contiguous pages per row; -1 past what the row needs.
    per_row = -(-(starts + lengths) // tokens_per_page)
    width = int(per_row.max()) + 1
    shuffled = rng.permutation(num_pages)
    table = np.full((batch, width), ops.UNUSED_PAGE, dtype=np.int32)
    used = 0
    for b in range(batch):
        table[b, :per_row[b]] = shuffled[used:used + per_row[b]]
        used += per_row[b]
    pool = to_storage(rng.standard_normal((num_pages, 2, num_kv, tokens_per_page, head_dim)).astype(np.float32),
                      kv_dtype)
    query = rng.standard_normal((batch, seq, num_q * head_dim)).astype(np.float32)
    key = rng.standard_normal((batch, seq, num_kv * head_dim)).astype(np.float32)
    value = rng.standard_normal((batch, seq, num_kv * head_dim)).astype(np.float32)
    cos_sin = rope_table(capacity, head_dim, 10000.0)

    expected_pool = paged_kv_write(key, value, cos_sin, lengths, starts, table, pool, num_kv_heads=num_kv,
                                   head_dim=head_dim, kv_cache_dtype=kv_dtype)
    expected = paged_attention(query, expected_pool, lengths, starts, table, num_q_heads=num_q, num_kv_heads=num_kv,
                               head_dim=head_dim, scale=head_dim ** -0.5, kv_cache_dtype=kv_dtype)

    lowered = lower_for_onnxruntime(op_graph(num_q, num_kv, head_dim, kv_dtype), kv_cache_dtype=kv_dtype,
                                    tokens_per_page=tokens_per_page, num_pages=num_pages, cpu_kernel=cpu_kernel)
    assert any(n.domain == ops.CPU_DOMAIN for n in lowered.graph.node) == cpu_kernel
    session = session_for(lowered)
    cached_width = -(-int(starts.max()) // tokens_per_page)
    attention, new_rows = session.run(["attention", new_rows_name("past_key_values_0")], {
        "query": query, "key": key, "value": value, "rope_rotary_cos_sin": cos_sin, "context_lengths": lengths,
        "kvcache_start_index": starts, "kv_page_table": np.ascontiguousarray(table[:, :cached_width]),
        "past_key_values_0": pool})
    for b in range(batch):
        np.testing.assert_allclose(attention[b, :lengths[b]], expected[b, :lengths[b]], atol=2e-5, rtol=1e-5)

    # The runtime's scatter of the returned rows reproduces the reference pool exactly.
    kv_pool = KVStore(1, num_pages, num_kv, tokens_per_page, head_dim, kv_dtype)
    kv_pool.layers[0][...] = pool
    rows = [(b, i) for b in range(batch) for i in range(lengths[b])]
    positions = np.array([starts[b] + i for b, i in rows])
    pages = np.array([table[b, (starts[b] + i) // tokens_per_page] for b, i in rows])
    kv_pool.scatter(0, new_rows[[b for b, _ in rows], [i for _, i in rows]].astype(np.float32), pages,
                    positions % tokens_per_page)
    assert kv_pool.layers[0].dtype == pool_numpy_dtype(kv_dtype)
    np.testing.assert_array_equal(from_storage(kv_pool.layers[0], kv_dtype), from_storage(expected_pool, kv_dtype))
