"""The CPU kernels per compiled target, in one run: a decode row through SmolLM2-135M's 4-bit matmuls (MatMulBlocks
against ONNX Runtime's MatMulNBits, whose MLAS kernels dispatch at run time on their own) and one decode step's
attention reads of 30 layers over an fp16 (and fp8) pool at a long context.

Each compiled target this CPU runs is forced in turn (KVFORGE_CPU_TARGET, applied by the library on each call), so
`scalar`, `sse4`, `avx2` and AVX-512 are measured side by side on one machine; the load average is printed beside
the figures (a shared machine's absolute times are noisy, the ratios within the run less so). Run:
`python -m experiments.kernels.cpu_targets --threads 2 [--context 1500] [--json out.json]`. `--compare LIB` also times
another build of the library in the same run (for example main's before issue 50, built with -march=native
-mno-avx512f: what an AVX2 CPU ran then), without forcing anything in it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from experiments._common import median, write_json
from experiments.kernels._common import LAYERS, attention_feeds, bound_timer, kernel_model
from kvforge.builder.lower_matmul import MATMUL_BLOCKS, pack_blocks
from kvforge.plugins import cpu_kernel, ops

# SmolLM2-135M's linears per layer (K, N): q/k/v packed, o, gate/up packed, down; 30 layers.
HIDDEN, INTERMEDIATE = 576, 1536
LINEARS = [(HIDDEN, HIDDEN + 2 * 192), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
BLOCK = 32


def _weights(rng: np.random.Generator, k: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    values = rng.integers(0, 16, size=(n, k // BLOCK, BLOCK)).astype(np.uint8)
    scales = (rng.random((n, k // BLOCK)) * 0.05 + 0.001).astype(np.float32)
    return values, scales, (-8 * scales).astype(np.float32)


def matmul_models(rng: np.random.Generator) -> tuple[onnx.ModelProto, onnx.ModelProto, onnx.ModelProto]:
    """(MatMulBlocks graph, MatMulNBits graph, MatMulNBits graph in the engine's Q4_1 form) of the 30 layers'
    linears, each reading the same input row. The Q4_1 form is what an engine built with `--linearKernel mlas` runs
    for a GGUF Q4_1 export: MatMulNBits with zero points at accuracy level 4 (int8 activations: MLAS's path whose
    rows do not depend on the row count) plus the exact-remainder correction,
    Add(MatMulNBits(x), MatMul(MatMul(x, block_sum), offsets)) (kvforge/tools/export/quantize.py)."""
    blocks_nodes, nbits_nodes, blocks_init, nbits_init, outputs = [], [], [], [], []
    q41_nodes, q41_init = [], []
    for layer in range(LAYERS):
        for j, (k, n) in enumerate(LINEARS):
            name = f"l{layer}_{j}"
            values, scales, mins = _weights(rng, k, n)
            blocks_init.append(numpy_helper.from_array(pack_blocks(values, scales, mins), f"{name}_w"))
            blocks_nodes.append(helper.make_node(MATMUL_BLOCKS, [f"x{k}", f"{name}_w"], [name], domain=ops.CPU_DOMAIN,
                                                 K=k, N=n, bits=4))
            low, high = values[..., 0::2], values[..., 1::2]
            packed = (low | (high << 4)).astype(np.uint8)  # MatMulNBits: element 2i low nibble, 2i + 1 high
            nbits_init += [numpy_helper.from_array(packed, f"{name}_q"),
                           numpy_helper.from_array(scales.reshape(-1), f"{name}_s")]
            nbits_nodes.append(helper.make_node("MatMulNBits", [f"x{k}", f"{name}_q", f"{name}_s"], [name],
                                                domain="com.microsoft", K=k, N=n, bits=4, block_size=BLOCK))
            blocks = k // BLOCK
            zero = np.full((n, (blocks + 1) // 2), 0x88, dtype=np.uint8)  # zero point 8 in both nibbles
            block_sum = np.kron(np.eye(blocks, dtype=np.float32), np.ones((BLOCK, 1), dtype=np.float32))  # [K, K/32]
            q41_init += [numpy_helper.from_array(packed, f"{name}_q"), numpy_helper.from_array(scales.reshape(-1),
                                                                                               f"{name}_s"),
                         numpy_helper.from_array(zero.reshape(-1), f"{name}_z"),
                         numpy_helper.from_array(block_sum, f"{name}_bs"),
                         numpy_helper.from_array((rng.random((blocks, n)) * 0.01).astype(np.float32), f"{name}_o")]
            q41_nodes += [helper.make_node("MatMulNBits", [f"x{k}", f"{name}_q", f"{name}_s", f"{name}_z"],
                                           [f"{name}_y"], domain="com.microsoft", K=k, N=n, bits=4,
                                           block_size=BLOCK, accuracy_level=4),
                          helper.make_node("MatMul", [f"x{k}", f"{name}_bs"], [f"{name}_sums"]),
                          helper.make_node("MatMul", [f"{name}_sums", f"{name}_o"], [f"{name}_r"]),
                          helper.make_node("Add", [f"{name}_y", f"{name}_r"], [name])]
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, n]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]) for k in (HIDDEN, INTERMEDIATE)]
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
              helper.make_opsetid(ops.CPU_DOMAIN, 1)]
    return (helper.make_model(helper.make_graph(blocks_nodes, "blocks", inputs, outputs, blocks_init),
                              opset_imports=opsets),
            helper.make_model(helper.make_graph(nbits_nodes, "nbits", inputs, outputs, nbits_init),
                              opset_imports=opsets),
            helper.make_model(helper.make_graph(q41_nodes, "nbits_q4_1", inputs, outputs, q41_init),
                              opset_imports=opsets))


def _session(model: onnx.ModelProto, threads: int, library: Path | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if library is not None:
        options.register_custom_ops_library(str(library))
    elif reason := cpu_kernel.register(options):
        raise SystemExit(f"CPU kernel not available: {reason}")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _time(call, repeats: int) -> float:
    call()
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e3)
    return median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=1500, help="cached tokens the attention reads")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--compare", type=Path, default=None, help="another build of the library to time beside")
    args = parser.parse_args()
    library = cpu_kernel.library_path()
    targets = cpu_kernel.runnable_targets(library)
    cpu = cpu_kernel.cpu_description()
    print(f"cpu: {cpu['cpu_model']}; simd: {' '.join(cpu['simd'])}; compiled targets: "
          f"{' '.join(cpu_kernel.compiled_targets(library))}; runnable here: {' '.join(targets)}")
    print(f"loadavg before: {Path('/proc/loadavg').read_text().strip()}")
    rng = np.random.default_rng(0)
    blocks_model, nbits_model, q41_model = matmul_models(rng)
    x = {f"x{k}": rng.standard_normal((1, k)).astype(np.float32) for k in (HIDDEN, INTERMEDIATE)}
    blocks, nbits = _session(blocks_model, args.threads), _session(nbits_model, args.threads)
    attention = {dtype: (_session(kernel_model(dtype, 64), args.threads), attention_feeds(args.context, 1, dtype, 64))
                 for dtype in ("fp16", "fp8")}
    runners = {dtype: bound_timer(session, feeds)[0] for dtype, (session, feeds) in attention.items()}
    results: dict[str, dict[str, float]] = {}
    nbits_ms = _time(lambda: nbits.run(None, x), args.repeats)
    q41 = _session(q41_model, args.threads)
    q41_ms = _time(lambda: q41.run(None, x), args.repeats)
    int8_model = onnx.ModelProto()
    int8_model.CopyFrom(nbits_model)
    for node in int8_model.graph.node:  # accuracy level 4: int8 activations (a row's result independent of the rows)
        node.attribute.append(helper.make_attribute("accuracy_level", 4))
    int8 = _session(int8_model, args.threads)
    int8_ms = _time(lambda: int8.run(None, x), args.repeats)
    print(f"{'target':>8} {'matmul 1 row ms':>16} {'vs MatMulNBits':>15} {'attn fp16 ms':>13} {'attn fp8 ms':>12}")
    for target in targets:
        os.environ[cpu_kernel.TARGET_ENV] = target
        if cpu_kernel.chosen_target(library) != target:
            raise SystemExit(f"forcing {target} did not take")
        row = {"matmul_ms": _time(lambda: blocks.run(None, x), args.repeats)}
        for dtype, once in runners.items():
            row[f"attention_{dtype}_ms"] = _time(once, args.repeats)
        results[target] = row
        print(f"{target:>8} {row['matmul_ms']:16.2f} {nbits_ms / row['matmul_ms']:14.2f}x "
              f"{row['attention_fp16_ms']:13.2f} {row['attention_fp8_ms']:12.2f}", flush=True)
    os.environ.pop(cpu_kernel.TARGET_ENV, None)
    if args.compare is not None:
        other = _session(blocks_model, args.threads, args.compare)
        row = {"matmul_ms": _time(lambda: other.run(None, x), args.repeats)}
        for dtype, (_, feeds) in attention.items():
            session = _session(kernel_model(dtype, 64), args.threads, args.compare)
            row[f"attention_{dtype}_ms"] = _time(bound_timer(session, feeds)[0], args.repeats)
        results[f"compare:{args.compare.name}"] = row
        print(f"{args.compare.name:>8} {row['matmul_ms']:16.2f} {nbits_ms / row['matmul_ms']:14.2f}x "
              f"{row['attention_fp16_ms']:13.2f} {row['attention_fp8_ms']:12.2f}")
    print(f"{'MatMulNBits':>8} {nbits_ms:16.2f}   (ONNX Runtime {ort.__version__}, MLAS's own dispatch)")
    print(f"MatMulNBits level 4 + Q4_1 correction {q41_ms:.2f}   (what an --linearKernel mlas engine runs for a GGUF "
          "Q4_1 export)")
    print(f"MatMulNBits level 4 {int8_ms:.2f}   (int8 activations; --linearKernel mlas on a plain 4-bit export)")
    print(f"loadavg after: {Path('/proc/loadavg').read_text().strip()}")
    if args.json:
        write_json(args.json, {"cpu": cpu, "threads": args.threads, "context": args.context, "targets": results,
                               "matmulnbits_ms": nbits_ms,
                               "matmulnbits_q4_1_level4_ms": q41_ms, "matmulnbits_level4_ms": int8_ms,
                               "loadavg": Path("/proc/loadavg").read_text().split()[:3]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
