"""Prefill time of one long prompt by chunk size: why llm_inference defaults to --prefillChunkSize 512.

On the CPU a call's masked score matrix grows with the square of its length, so several shorter calls
(each attending to the pages the earlier ones wrote) beat one long call.

    python -m experiments.engine.prefill_chunks --onnxDir onnx/smollm2 --threads 2 --promptTokens 1536
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR, load_engine_dir
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.ort import OrtBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnxDir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--promptTokens", type=int, default=1536)
    parser.add_argument("--chunks", default="0,1024,768,512,256,128", help="chunk sizes; 0 = one call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    n = args.promptTokens
    with tempfile.TemporaryDirectory() as tmp:
        build_engine(args.onnxDir, Path(tmp) / "engine", BuildOptions(max_input_len=n, max_kv_cache_capacity=n,
                                                                      max_batch_size=1, tokens_per_page=128))
        engine = load_engine_dir(Path(tmp) / "engine")
        runner = OrtBackend(engine, args.threads)
        embedding = load_file(str(engine.file(EMBEDDING_FILE)))[EMBEDDING_TENSOR]
        prompt = embedding[np.random.default_rng(0).integers(0, embedding.shape[0], n)][None]
        pages = list(range(engine.build.max_pages_per_seq))
        runner.forward(StepInputs(prompt[:, :64], np.array([64]), np.array([0]), [pages]))  # warm up
        seconds = {}
        for chunk in (int(c) for c in args.chunks.split(",")):
            size = chunk or n
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                for start in range(0, n, size):
                    length = min(size, n - start)
                    runner.forward(StepInputs(prompt[:, start:start + length], np.array([length]),
                                              np.array([start]), [pages]))
                times.append(time.perf_counter() - started)
            seconds[chunk] = statistics.median(times)
    print(f"prefill of {n} tokens, {args.threads} threads, medians of {args.repeats}")
    print(f"{'chunk':>8}{'seconds':>10}{'tok/s':>10}{'vs one call':>13}")
    for chunk, value in seconds.items():
        print(f"{chunk or 'whole':>8}{value:10.2f}{n / value:10.1f}{seconds[0] / value if 0 in seconds else 0:13.2f}")
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in seconds.items()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
