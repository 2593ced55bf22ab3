"""Prefill time of one recurrence as lowered for ONNX Runtime: the per-token Scan against the chunked form llm_build
uses for calls of 16 tokens or more, and one decode step; for the gated delta rule (Qwen3.5) and the selective scan
(Mamba2).

One op on random inputs: GatedDeltaRule at a Qwen3.5 layer's geometry (16 key heads, 32 value heads, 128-dim heads
by default), SelectiveScan at Mamba2-130m's (24 heads of 64, state 128, one group); ratios come from one run,
medians of --repeats calls per cell.

    python -m experiments.kernels.recurrent_prefill --threads 2 --tokens 2,8,16,32,64,256,1024
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

from kvforge.builder.lower_recurrent import DELTA_CHUNK, SCAN_CHUNK, lower_recurrent_ops
from kvforge.graph.onnx_graph import FLOAT, INT32, OPSET, value_info
from kvforge.plugins import ops, recurrent


def delta_session(shape: dict[str, int], chunk: int, threads: int) -> ort.InferenceSession:
    hk, hv, dk, dv = shape["num_k_heads"], shape["num_v_heads"], shape["k_head_dim"], shape["v_head_dim"]
    node = helper.make_node(recurrent.GATED_DELTA_RULE.name, list(recurrent.GATED_DELTA_RULE.inputs), ["y", "state"],
                            domain=ops.DOMAIN, **shape)
    return _session(node, [
        value_info("q", FLOAT, ["B", "S", hk * dk]), value_info("k", FLOAT, ["B", "S", hk * dk]),
        value_info("v", FLOAT, ["B", "S", hv * dv]), value_info("g", FLOAT, ["B", "S", hv]),
        value_info("beta", FLOAT, ["B", "S", hv]), value_info("context_lengths", INT32, ["B"]),
        value_info("recurrent_state", FLOAT, ["B", hv, dv, dk])],
        [value_info("y", FLOAT, ["B", "S", hv * dv]), value_info("state", FLOAT, ["B", hv, dv, dk])],
        {"delta_chunk": chunk}, threads)


def scan_session(shape: dict[str, int], chunk: int, threads: int) -> ort.InferenceSession:
    h, p, gn, n = shape["num_heads"], shape["head_dim"], shape["n_groups"], shape["state_size"]
    node = helper.make_node(recurrent.SELECTIVE_SCAN.name, list(recurrent.SELECTIVE_SCAN.inputs), ["y", "state"],
                            domain=ops.DOMAIN, **shape)
    return _session(node, [
        value_info("x", FLOAT, ["B", "S", h * p]), value_info("dt", FLOAT, ["B", "S", h]),
        value_info("b", FLOAT, ["B", "S", gn * n]), value_info("c", FLOAT, ["B", "S", gn * n]),
        value_info("a_log", FLOAT, [h]), value_info("d", FLOAT, [h]), value_info("dt_bias", FLOAT, [h]),
        value_info("context_lengths", INT32, ["B"]), value_info("recurrent_state", FLOAT, ["B", h, p, n])],
        [value_info("y", FLOAT, ["B", "S", h * p]), value_info("state", FLOAT, ["B", h, p, n])],
        {"scan_chunk": chunk}, threads)


def _session(node: object, inputs: list, outputs: list, chunks: dict[str, int], threads: int) -> ort.InferenceSession:
    graph = helper.make_graph([node], "recurrence", inputs, outputs)
    model = lower_recurrent_ops(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)]), **chunks)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def delta_feeds(shape: dict[str, int], tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
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


def scan_feeds(shape: dict[str, int], tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, p, gn, n = shape["num_heads"], shape["head_dim"], shape["n_groups"], shape["state_size"]

    def normal(*dims: int, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.standard_normal(dims)).astype(np.float32)

    return {"x": normal(1, tokens, h * p), "dt": normal(1, tokens, h), "b": normal(1, tokens, gn * n, scale=0.3),
            "c": normal(1, tokens, gn * n, scale=0.3), "a_log": normal(h, scale=0.5), "d": normal(h),
            "dt_bias": normal(h, scale=0.5) - 2.0, "context_lengths": np.array([tokens], np.int32),
            "recurrent_state": np.zeros((1, h, p, n), np.float32)}


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
    parser.add_argument("--tokens", default="2,16,64,256,1024", help="prefill lengths (comma-separated)")
    parser.add_argument("--ops", default="GatedDeltaRule,SelectiveScan", help="which ops (comma-separated)")
    parser.add_argument("--keyHeads", type=int, default=16, help="GatedDeltaRule key heads")
    parser.add_argument("--valueHeads", type=int, default=32, help="GatedDeltaRule value heads")
    parser.add_argument("--headDim", type=int, default=128, help="GatedDeltaRule key and value head dim")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    setups = {
        "GatedDeltaRule": ({"num_k_heads": args.keyHeads, "num_v_heads": args.valueHeads, "k_head_dim": args.headDim,
                            "v_head_dim": args.headDim}, delta_session, delta_feeds, DELTA_CHUNK),
        "SelectiveScan": ({"num_heads": 24, "head_dim": 64, "n_groups": 1, "state_size": 128}, scan_session,
                          scan_feeds, SCAN_CHUNK),
    }
    figures = {}
    for op in args.ops.split(","):
        shape, make, inputs_for, chunk = setups[op]
        per_token, chunked = make(shape, 0, args.threads), make(shape, chunk, args.threads)
        rows = []
        print(f"{op} {shape}, {args.threads} threads, chunks of {chunk}")
        for tokens in (int(t) for t in args.tokens.split(",")):
            inputs = inputs_for(shape, tokens)
            scan_s, scan_out = timed(per_token, inputs, args.repeats)
            chunk_s, chunk_out = timed(chunked, inputs, args.repeats)
            error = max(float(np.abs(a - b).max()) for a, b in zip(scan_out, chunk_out, strict=True))
            rows.append({"tokens": tokens, "per_token_ms": scan_s * 1e3, "lowered_ms": chunk_s * 1e3,
                         "speedup": scan_s / chunk_s, "max_abs_difference": error})
            print(f"  prefill {tokens:5d} tokens: per-token Scan {scan_s * 1e3:8.1f} ms, as lowered "
                  f"{chunk_s * 1e3:8.1f} ms ({scan_s / chunk_s:.1f}x), outputs differ by at most {error:.1e}")
        decode_s, _ = timed(chunked, inputs_for(shape, 1), args.repeats * 5)
        print(f"  decode 1 token (as lowered: the per-token branch): {decode_s * 1e3:.2f} ms")
        figures[op] = {"shape": shape, "rows": rows, "decode_ms": decode_s * 1e3}
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, **figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
