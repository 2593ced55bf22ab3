"""What a verify row costs: one backend call of S new tokens on a cached context, against a decode call (S = 1).

Speculative decoding pays only if a row of k+1 positions costs much less than k+1 decode steps; this times
`OrtBackend.forward` alone (no scheduler, no sampling) at S = 1, 2, 5, 9 and prints ONNX Runtime's per-op times of
S = 5 against S = 1, which says where the extra cost goes. Widths are timed in interleaved rounds (S = 1, 2, 5, 9,
then again), so a machine whose load drifts moves them alike; the k = 4 line is issue 43's figure: a verify call of 4
drafts (S = 5) against a 1-row decode call, target at most 1.3x.

With --specBase (an ONNX dir exported with --hiddenStateLayers, e.g. out/onnx/smollm2-base) the engine is built as
an EAGLE3 base: it returns hidden states and takes tree inputs, as the verify calls of --specDecode eagle3 do, and a
k = 4 row shaped as a tree (two branches of two drafts) is timed too.

    python -m experiments.spec.verify_cost --onnxDir out/onnx/smollm2 --threads 2 --contextTokens 1500

Both 4-bit matmuls (llm_build --cpuMatmul kernel and onnx) are built and timed in the same run, one engine after
the other, unless --cpuMatmul picks one; the per-op profile is the first one's.
    python -m experiments.spec.verify_cost --onnxDir out/onnx/smollm2-base --specBase --threads 2 --json out/verify.json
"""

from __future__ import annotations

import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments._common import bench_parser, write_json
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR, load_engine_dir
from kvforge.contract.safetensors_map import map_tensor
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.runtime.execution.tree_attention import ancestor_mask

WIDTHS = (1, 2, 5, 9)
VERIFY_WIDTH = 5  # k = 4 drafts and the pending token
TARGET_RATIO = 1.3  # issue 43: a k = 4 verify call costs at most this many decode calls
TREE_PARENTS = [-1, 0, 1, 0, 3]  # the pending token (node 0) and two branches of two drafts


def prefill(backend: OrtBackend, embedding: np.ndarray, ids: np.ndarray, pages: list[int]) -> None:
    for start in range(0, len(ids), 512):
        chunk = ids[start:start + 512]
        backend.forward(StepInputs(embedding[chunk][None].astype(np.float32), np.array([len(chunk)], np.int32),
                                   np.array([start], np.int32), [pages]))


def call(backend: OrtBackend, embedding: np.ndarray, ids: np.ndarray, width: int, context: int,
         pages: list[int], tree: bool = False) -> float:
    """One verify-shaped call of `width` new tokens at `context`, logits at each; `tree`: TREE_PARENTS' shape (RoPE
    positions by depth, each node seeing its ancestors) instead of a chain."""
    position_ids = mask = None
    if tree:
        nodes = ancestor_mask(TREE_PARENTS)
        position_ids = (context + nodes.sum(axis=1) - 1).astype(np.int32)[None]
        mask = nodes[None]
    started = time.perf_counter()
    backend.forward(StepInputs(embedding[ids[:width]][None].astype(np.float32), np.array([width], np.int32),
                               np.array([context], np.int32), [pages],
                               logits_indices=np.arange(width, dtype=np.int64),
                               position_ids=position_ids, attention_mask=mask))
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = bench_parser(__doc__, repeats=8)
    parser.add_argument("--contextTokens", type=int, default=1500)
    parser.add_argument("--specBase", action="store_true", help="build an EAGLE3 base (tree inputs, hidden states)")
    parser.add_argument("--cpuMatmul", choices=("kernel", "onnx", "both"), default="both",
                        help="the 4-bit matmul of the engine (llm_build --cpuMatmul); both: time both engines in "
                             "the same run, one after the other")
    args = parser.parse_args()
    context = args.contextTokens
    matmuls = ("kernel", "onnx") if args.cpuMatmul == "both" else (args.cpuMatmul,)
    with tempfile.TemporaryDirectory(prefix="kvforge-verify-") as tmp:
        backends: dict[str, OrtBackend] = {}
        for matmul in matmuls:
            build = BuildOptions(max_input_len=min(512, context + 256), max_kv_cache_capacity=context + 256,
                                 max_batch_size=1, tokens_per_page=128, spec_base=args.specBase, cpu_matmul=matmul)
            build_engine(args.onnxDir, Path(tmp) / matmul, build)
            engine = load_engine_dir(Path(tmp) / matmul)
            embedding = map_tensor(engine.file(EMBEDDING_FILE), EMBEDDING_TENSOR)
            backends[matmul] = OrtBackend(engine, args.threads, embedding)
        pages = list(range(-(-(context + 16) // 128)))
        ids = np.arange(context) % 1000 + 100
        for backend in backends.values():
            prefill(backend, embedding, ids, pages)
        print(f"backend call at {context} tokens of context, {args.threads} threads, median of {args.repeats}:")
        shapes = [(f"S={width}", width, False) for width in WIDTHS]
        if backends[matmuls[0]].tree_attention:
            shapes.append((f"S={VERIFY_WIDTH} tree", VERIFY_WIDTH, True))
        times = {(m, label): [] for m in matmuls for label, _, _ in shapes}
        # One engine after the other (an idle session's intra-op threads keep spinning a while after its last run
        # and steal the cores from the other's calls: interleaving engines inflated whichever width came first),
        # each in interleaved rounds of the widths, so load drift moves every width alike.
        for matmul, backend in backends.items():
            for _ in range(3):
                call(backend, embedding, ids, 1, context, pages)
            for _ in range(args.repeats):
                for label, width, tree in shapes:
                    times[matmul, label].append(call(backend, embedding, ids, width, context, pages, tree))
        medians = {key: float(np.median(values)) for key, values in times.items()}
        ratios: dict[str, dict[str, float]] = {}
        for matmul in matmuls:
            base = medians[matmul, "S=1"]
            print(f" --cpuMatmul {matmul}:")
            for label, width, _ in shapes:
                ms = medians[matmul, label]
                print(f"   {label}: {ms:6.1f} ms  ({ms / base:4.2f}x a decode call; {ms / width:5.1f} ms a position)")
            ratios[matmul] = {label: medians[matmul, label] / base for label, width, _ in shapes
                              if width == VERIFY_WIDTH}
            for label, ratio in ratios[matmul].items():
                verdict = "met" if ratio <= TARGET_RATIO else "missed"
                print(f"   k=4 verify ({label}) / decode: {ratio:.2f}x (issue 43 target <= {TARGET_RATIO}x: {verdict})")
        if len(matmuls) == 2:
            for label, _, _ in shapes:
                print(f" {label}: kernel / onnx = {medians['kernel', label] / medians['onnx', label]:.2f}x")
        write_json(args.json, {"context_tokens": context, "threads": args.threads, "repeats": args.repeats,
                               "spec_base": args.specBase,
                               "median_ms": {f"{m} {label}": v for (m, label), v in medians.items()},
                               "k4_ratio": ratios, "target_ratio": TARGET_RATIO})
        engine = load_engine_dir(Path(tmp) / matmuls[0])
        profiled = OrtBackend(engine, args.threads, embedding, profile_prefix=f"{tmp}/ort")
        prefill(profiled, embedding, ids, pages)
        for width in (1, 5):
            for _ in range(5):
                call(profiled, embedding, ids, width, context, pages)
        trace = json.loads(Path(profiled.session.end_profiling()).read_text())
    runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[-10:]
    print("ONNX Runtime per-op ms per call (profiling on):")
    for label, group in (("S=1", runs[:5]), ("S=5", runs[5:])):
        low, high = group[0]["ts"], group[-1]["ts"] + group[-1]["dur"]
        ops: collections.Counter[str] = collections.Counter()
        for event in trace:
            if event.get("cat") == "Node" and str(event.get("name", "")).endswith("_kernel_time") \
                    and low <= event["ts"] <= high:
                ops[event["args"].get("op_name", "?")] += event["dur"] / 5 / 1e3
        print(f"   {label}: " + ", ".join(f"{op} {ms:.1f}" for op, ms in ops.most_common(5)))


if __name__ == "__main__":
    main()
