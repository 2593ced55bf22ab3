"""Per-step attention time of 30 SmolLM2-shaped layers: the in-place CPU kernel vs today's gather + GQA lowering.

Each graph holds only the attention of 30 layers (one pool per layer, bound zero-copy as an OrtValue with IO
binding, outputs preallocated): `kernel` is 30 kvforge.cpu.PagedAttention nodes; `gqa` is kvforge/builder/lower_ort.py's
GroupQueryAttention lowering (gather the row's pages, cast fp16 -> fp32, GroupQueryAttention) for the same
inputs. The page table is as narrow as the context allows, which favours the gather. The verify case is a decode
row and its drafts in one call (`--verifyRows`, 5 by default), with its time over the decode step's. Run:
`python -m experiments.kernels.cpu_attention --threads 2` (`KVFORGE_CPU_TARGET=avx2` forces a target).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from experiments._common import Progress, median, write_json
from experiments.kernels._common import (
    HEAD_DIM,
    LAYERS,
    NUM_KV,
    NUM_Q,
    POOL_ELEM,
    SCALE,
    attention_feeds,
    attention_inputs,
    attention_outputs,
    bound_timer,
    kernel_model,
)
from kvforge.builder.lower_ort import Shared, group_query_attention
from kvforge.graph.onnx_graph import GraphWriter
from kvforge.plugins import cpu_kernel


def gqa_model(dtype: str, tokens_per_page: int) -> onnx.ModelProto:
    """Today's lowering of the same attention, node for node (kvforge/builder/lower_ort.py)."""
    shared = Shared(GraphWriter(prefix="lowered/"), group=NUM_Q // NUM_KV)
    for i in range(LAYERS):
        group_query_attention(shared.g, shared, "query", f"past_key_values_{i}", "kv_page_table", "new_kv",
                               "kvcache_start_index", dtype, NUM_KV, HEAD_DIM, SCALE, f"attn_{i}")
    graph = helper.make_graph(shared.g.nodes, "gqa", attention_inputs(dtype, tokens_per_page), attention_outputs(),
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


def measure(session: ort.InferenceSession, feeds: dict[str, np.ndarray], repeats: int) -> dict[str, float]:
    once, _ = bound_timer(session, feeds)
    once()
    once()
    times = [once() for _ in range(repeats)]
    return {"median_ms": median(times), "best_ms": min(times)}


def agree(kernel: ort.InferenceSession, gqa: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> float:
    """Max abs difference of the two graphs' outputs (a sanity check that both compute the same attention)."""
    run_k, out_k = bound_timer(kernel, feeds)
    run_g, out_g = bound_timer(gqa, feeds)
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
    parser.add_argument("--verifyRows", type=int, default=5,
                        help="query rows of the verify case (a decode row and its drafts) at each context; 0: none")
    parser.add_argument("--noPrefill", action="store_true", help="skip the prefill case")
    parser.add_argument("--noGqa", action="store_true", help="time the kernel only (no gather+GQA graph)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    progress = Progress()
    kernel = _session(kernel_model(args.dtype, args.tokensPerPage), args.threads, with_kernel=True)
    gqa = None if args.noGqa else _session(gqa_model(args.dtype, args.tokensPerPage), args.threads, with_kernel=False)
    target = cpu_kernel.chosen_target(cpu_kernel.library_path())
    figures: dict[str, object] = {"threads": args.threads, "tokens_per_page": args.tokensPerPage, "dtype": args.dtype,
                                  "layers": LAYERS, "cpu_target": target, "decode": {}, "verify": {}, "prefill": {}}
    print(f"{LAYERS} layers, {NUM_Q} q / {NUM_KV} kv heads, head_dim {HEAD_DIM}, {args.dtype} pool, "
          f"{args.tokensPerPage} tokens/page, {args.threads} threads, target {figures['cpu_target']}; "
          "ms per step (median / best)")
    print(f"{'case':>26} {'kernel':>16} {'gather+GQA':>16} {'speedup':>8} {'max |diff|':>10} {'KV GB/s':>8} "
          f"{'vs decode':>9} {'load':>5}")
    cases = [(f"decode @{c} cached", c, 1, args.repeats) for c in args.contexts]
    if args.verifyRows > 1:
        cases += [(f"verify {args.verifyRows} @{c} cached", c, args.verifyRows, args.repeats) for c in args.contexts]
    if not args.noPrefill:
        cases.append(("prefill 512 @1024 cached", 1024, 512, args.prefillRepeats))
    for label, cached, new, repeats in cases:
        progress(label)
        feeds = attention_feeds(cached, new, args.dtype, args.tokensPerPage)
        k = measure(kernel, feeds, repeats)
        g = measure(gqa, feeds, repeats) if gqa else {"median_ms": float("nan"), "best_ms": float("nan")}
        diff = agree(kernel, gqa, feeds) if gqa else float("nan")
        # The cached K/V bytes a step must read (every layer's pages once), at the kernel's best time.
        kv_bytes = LAYERS * cached * 2 * NUM_KV * HEAD_DIM * feeds["past_key_values_0"].itemsize
        bandwidth = kv_bytes / k["best_ms"] / 1e6
        kind = "decode" if new == 1 else "verify" if new == args.verifyRows else "prefill"
        decode = figures["decode"].get(str(cached), {}).get("kernel")
        versus = k["median_ms"] / decode["median_ms"] if kind == "verify" and decode else float("nan")
        load = os.getloadavg()[0]  # the machine is shared: a figure is only as good as its load
        figures[kind][str(cached)] = {"kernel": k, "gqa": g, "max_abs_diff": diff, "kv_bytes": kv_bytes,
                                      "kernel_best_kv_gb_per_s": bandwidth, "vs_decode": versus, "load": load}
        print(f"{label:>26} {k['median_ms']:7.2f} / {k['best_ms']:6.2f} {g['median_ms']:7.2f} / {g['best_ms']:6.2f}"
              f" {g['median_ms'] / k['median_ms']:7.1f}x {diff:10.2e} {bandwidth:8.1f} {versus:8.2f}x {load:5.2f}")
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
