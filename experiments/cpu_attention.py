"""Per-step attention time of 30 SmolLM2-shaped layers: the in-place CPU kernel vs today's gather + GQA lowering.

Each graph holds only the attention of 30 layers (one pool per layer, bound zero-copy as an OrtValue with IO
binding, outputs preallocated): `kernel` is 30 kvforge.cpu.PagedAttention nodes; `gqa` is kvforge/builder/lower_ort.py's
GroupQueryAttention lowering (gather the row's pages, cast fp16 -> fp32, GroupQueryAttention) for the same
inputs. The page table is as narrow as the context allows, which favours the gather. Run:
`python experiments/cpu_attention.py --threads 2`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from _common import Progress, median, write_json
from onnx import TensorProto, helper

from kvforge.builder.lower_ort import _group_query_attention, _Shared
from kvforge.graph.onnx_graph import GraphWriter
from kvforge.plugins import cpu_kernel, ops
from kvforge.plugins.reference import pool_numpy_dtype, round_to_storage, to_storage

LAYERS, NUM_Q, NUM_KV, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M
POOL_ELEM = {"fp16": TensorProto.FLOAT16, "fp8": TensorProto.UINT8, "fp32": TensorProto.FLOAT}
SCALE = HEAD_DIM ** -0.5


def _inputs(dtype: str, tokens_per_page: int) -> list[onnx.ValueInfoProto]:
    pools = [helper.make_tensor_value_info(f"past_key_values_{i}", POOL_ELEM[dtype],
                                           ["pages", 2, NUM_KV, tokens_per_page, HEAD_DIM]) for i in range(LAYERS)]
    return [helper.make_tensor_value_info("query", TensorProto.FLOAT, ["B", "S", NUM_Q * HEAD_DIM]),
            helper.make_tensor_value_info("new_kv", TensorProto.FLOAT, ["B", "S", 2, NUM_KV, HEAD_DIM]),
            helper.make_tensor_value_info("kv_page_table", TensorProto.INT32, ["B", "W"]),
            helper.make_tensor_value_info("kvcache_start_index", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("context_lengths", TensorProto.INT32, ["B"]), *pools]


def _outputs() -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(f"attn_{i}", TensorProto.FLOAT, ["B", "S", NUM_Q * HEAD_DIM])
            for i in range(LAYERS)]


def kernel_model(dtype: str, tokens_per_page: int) -> onnx.ModelProto:
    nodes = [helper.make_node(ops.CPU_PAGED_ATTENTION.name,
                              ["query", "new_kv", f"past_key_values_{i}", "kv_page_table", "kvcache_start_index",
                               "context_lengths"], [f"attn_{i}"], domain=ops.CPU_DOMAIN, num_q_heads=NUM_Q,
                              num_kv_heads=NUM_KV, head_dim=HEAD_DIM, tokens_per_page=tokens_per_page, scale=SCALE)
             for i in range(LAYERS)]
    graph = helper.make_graph(nodes, "kernel", _inputs(dtype, tokens_per_page), _outputs())
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(ops.CPU_DOMAIN, 1)])


def gqa_model(dtype: str, tokens_per_page: int) -> onnx.ModelProto:
    """Today's lowering of the same attention, node for node (kvforge/builder/lower_ort.py)."""
    shared = _Shared(GraphWriter(prefix="lowered/"), group=NUM_Q // NUM_KV)
    for i in range(LAYERS):
        _group_query_attention(shared.g, shared, "query", f"past_key_values_{i}", "kv_page_table", "new_kv",
                               "kvcache_start_index", dtype, NUM_KV, HEAD_DIM, SCALE, f"attn_{i}")
    graph = helper.make_graph(shared.g.nodes, "gqa", _inputs(dtype, tokens_per_page), _outputs(),
                              initializer=shared.g.initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _session(model: onnx.ModelProto, threads: int, with_kernel: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    reason = cpu_kernel.register(options) if with_kernel else ""
    if reason:
        raise SystemExit(f"CPU kernel not available: {reason}")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(cached: int, new: int, dtype: str, tokens_per_page: int, seed: int = 0) -> dict[str, np.ndarray]:
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


def _timer(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> tuple[Callable[[], float], list]:
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


def measure(session: ort.InferenceSession, feeds: dict[str, np.ndarray], repeats: int) -> dict[str, float]:
    once, _ = _timer(session, feeds)
    once()
    once()
    times = [once() for _ in range(repeats)]
    return {"median_ms": median(times), "best_ms": min(times)}


def agree(kernel: ort.InferenceSession, gqa: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> float:
    """Max abs difference of the two graphs' outputs (a sanity check that both compute the same attention)."""
    run_k, out_k = _timer(kernel, feeds)
    run_g, out_g = _timer(gqa, feeds)
    run_k()
    run_g()
    return float(max(np.abs(a - b).max() for a, b in zip(out_k, out_g, strict=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokensPerPage", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(POOL_ELEM), default="fp16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 1550, 4096])
    parser.add_argument("--repeats", type=int, default=30, help="decode steps timed per context")
    parser.add_argument("--prefillRepeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    progress = Progress()
    kernel = _session(kernel_model(args.dtype, args.tokensPerPage), args.threads, with_kernel=True)
    gqa = _session(gqa_model(args.dtype, args.tokensPerPage), args.threads, with_kernel=False)
    figures: dict[str, object] = {"threads": args.threads, "tokens_per_page": args.tokensPerPage,
                                  "dtype": args.dtype, "layers": LAYERS, "decode": {}, "prefill": {}}
    print(f"{LAYERS} layers, {NUM_Q} q / {NUM_KV} kv heads, head_dim {HEAD_DIM}, {args.dtype} pool, "
          f"{args.tokensPerPage} tokens/page, {args.threads} threads; ms per step (median / best)")
    print(f"{'case':>26} {'kernel':>16} {'gather+GQA':>16} {'speedup':>8} {'max |diff|':>10} {'KV GB/s':>8}")
    cases = [(f"decode @{c} cached", c, 1, args.repeats) for c in args.contexts]
    cases.append(("prefill 512 @1024 cached", 1024, 512, args.prefillRepeats))
    for label, cached, new, repeats in cases:
        progress(label)
        feeds = _feeds(cached, new, args.dtype, args.tokensPerPage)
        k, g = measure(kernel, feeds, repeats), measure(gqa, feeds, repeats)
        diff = agree(kernel, gqa, feeds)
        # The cached K/V bytes a step must read (every layer's pages once), at the kernel's best time.
        kv_bytes = LAYERS * cached * 2 * NUM_KV * HEAD_DIM * feeds["past_key_values_0"].itemsize
        bandwidth = kv_bytes / k["best_ms"] / 1e6
        figures["decode" if new == 1 else "prefill"][str(cached)] = {
            "kernel": k, "gqa": g, "max_abs_diff": diff, "kv_bytes": kv_bytes, "kernel_best_kv_gb_per_s": bandwidth}
        print(f"{label:>26} {k['median_ms']:7.2f} / {k['best_ms']:6.2f} {g['median_ms']:7.2f} / {g['best_ms']:6.2f}"
              f" {g['median_ms'] / k['median_ms']:7.1f}x {diff:10.2e} {bandwidth:8.1f}")
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
