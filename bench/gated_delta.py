"""Prefill time of one gated delta-net recurrence (the GatedDeltaRule op as lowered for ONNX Runtime): the per-token
Scan against the chunked form llm_build uses for calls of more than one token, and one decode step.

One op on random inputs at a Qwen3.5 layer's geometry (16 key heads, 32 value heads, 128-dim heads by default);
ratios come from one run, medians of --repeats calls per cell.

    python bench/gated_delta.py --threads 2 --tokens 64,256,1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import helper

from kvforge.builder.lower_recurrent import DELTA_CHUNK, lower_recurrent_ops
from kvforge.graph.onnx_graph import FLOAT, INT32, OPSET, value_info
from kvforge.plugins import ops, recurrent


def session(shape: dict[str, int], chunk: int, threads: int) -> ort.InferenceSession:
    hk, hv, dk, dv = shape["num_k_heads"], shape["num_v_heads"], shape["k_head_dim"], shape["v_head_dim"]
    node = helper.make_node(recurrent.GATED_DELTA_RULE.name, list(recurrent.GATED_DELTA_RULE.inputs), ["y", "state"],
                            domain=ops.DOMAIN, **shape)
    graph = helper.make_graph([node], "gated_delta", [
        value_info("q", FLOAT, ["B", "S", hk * dk]), value_info("k", FLOAT, ["B", "S", hk * dk]),
        value_info("v", FLOAT, ["B", "S", hv * dv]), value_info("g", FLOAT, ["B", "S", hv]),
        value_info("beta", FLOAT, ["B", "S", hv]), value_info("context_lengths", INT32, ["B"]),
        value_info("recurrent_state", FLOAT, ["B", hv, dv, dk])],
        [value_info("y", FLOAT, ["B", "S", hv * dv]), value_info("state", FLOAT, ["B", hv, dv, dk])])
    model = lower_recurrent_ops(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)]), delta_chunk=chunk)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds(shape: dict[str, int], tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hk, hv, dk, dv = shape["num_k_heads"], shape["num_v_heads"], shape["k_head_dim"], shape["v_head_dim"]
    q, k = (rng.standard_normal((1, tokens, hk, dk)) for _ in range(2))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * dk ** 0.5
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return {"q": q.reshape(1, tokens, -1).astype(np.float32), "k": k.reshape(1, tokens, -1).astype(np.float32),
            "v": rng.standard_normal((1, tokens, hv * dv)).astype(np.float32),
            "g": -np.abs(rng.standard_normal((1, tokens, hv))).astype(np.float32) * 0.1,
            "beta": rng.uniform(0.0, 1.0, (1, tokens, hv)).astype(np.float32),
            "context_lengths": np.array([tokens], np.int32),
            "recurrent_state": np.zeros((1, hv, dv, dk), np.float32)}


def timed(run: ort.InferenceSession, inputs: dict[str, np.ndarray], repeats: int) -> tuple[float, list[np.ndarray]]:
    outputs = run.run(None, inputs)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run.run(None, inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="64,256,1024", help="prefill lengths (comma-separated)")
    parser.add_argument("--keyHeads", type=int, default=16)
    parser.add_argument("--valueHeads", type=int, default=32)
    parser.add_argument("--headDim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shape = {"num_k_heads": args.keyHeads, "num_v_heads": args.valueHeads, "k_head_dim": args.headDim,
             "v_head_dim": args.headDim}
    per_token, chunked = session(shape, 0, args.threads), session(shape, DELTA_CHUNK, args.threads)
    rows = []
    print(f"GatedDeltaRule, {args.keyHeads}/{args.valueHeads} heads of {args.headDim}, {args.threads} threads, "
          f"chunks of {DELTA_CHUNK}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        inputs = feeds(shape, tokens)
        scan_s, scan_out = timed(per_token, inputs, args.repeats)
        chunk_s, chunk_out = timed(chunked, inputs, args.repeats)
        error = max(float(np.abs(a - b).max()) for a, b in zip(scan_out, chunk_out, strict=True))
        rows.append({"tokens": tokens, "per_token_ms": scan_s * 1e3, "chunked_ms": chunk_s * 1e3,
                     "speedup": scan_s / chunk_s, "max_abs_difference": error})
        print(f"  prefill {tokens:5d} tokens: per-token Scan {scan_s * 1e3:8.1f} ms, chunked {chunk_s * 1e3:8.1f} ms "
              f"({scan_s / chunk_s:.1f}x), outputs differ by at most {error:.1e}")
    decode = feeds(shape, 1)
    decode_s, _ = timed(chunked, decode, args.repeats * 5)
    print(f"  decode 1 token (per-token branch of the chunked lowering): {decode_s * 1e3:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({"shape": shape, "threads": args.threads, "rows": rows,
                                         "decode_ms": decode_s * 1e3}, indent=2) + "\n")


if __name__ == "__main__":
    main()
