"""What hardening costs: RSS growth per request on a long request file, and the time the checks add to one run.

    .venv/bin/python -m experiments.engine.hardening [--requests 10000] [--onnxDir out/onnx/smollm2] [--json out/h.json]

1. RSS per request: llm_inference runs (in a fresh process each, tiny synthetic model) a file of N requests
   and one of N/10; peak RSS growth divided by the request difference is the memory each request keeps
   (target <= 10 KB: responses stream to the output file, nothing per request is held after it finishes
   but its parsed request).
2. Check time on a one-request run: each new check timed alone (median of many), summed (target < 50 ms),
   next to the whole one-request run. With --onnxDir, also the manifest digest time of a real export.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PROCESS = """
import resource, sys
from kvforge.cli_common import run_app
from kvforge.runtime.cli import app
sys.argv = ["llm_inference", *sys.argv[1:]]
try:
    run_app(app)
finally:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)  # KiB on Linux
"""


def write_requests(path: Path, count: int) -> None:
    requests = [{"messages": [{"role": "user", "content": f"question {i % 97}: what is {i}?"}]} for i in range(count)]
    path.write_text(json.dumps({"batch_size": 16, "temperature": 0, "max_generate_length": 4,
                                "requests": requests}), encoding="utf-8")


def peak_rss_kib(engine: Path, input_file: Path, output: Path) -> tuple[int, float]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROCESS, "--engineDir", str(engine), "--inputFile", str(input_file),
                           "--outputFile", str(output), "--numThreads", "1"], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"llm_inference failed: {proc.stderr.strip()}")
    return int(proc.stderr.strip().splitlines()[-1]), time.perf_counter() - started


def median_ms(fn: Callable[[], object], repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def check_costs(engine_dir: Path, work: Path) -> dict[str, float]:
    """Each check the hardening added to a one-request run, timed alone."""
    from kvforge.contract.engine_dir import EMBEDDING_FILE, check_embedding, load_engine_dir
    from kvforge.contract.files import check_distinct, check_output_file, loads_json
    from kvforge.contract.manifest import ENGINE_KIND, verify_manifest
    from kvforge.contract.memory import check_pool_fits_memory
    from kvforge.runtime.engine.engine import Engine
    from kvforge.runtime.execution.ort import check_graph_inputs
    from kvforge.runtime.types import Message

    engine = Engine(engine_dir)
    loaded = engine.engine_dir
    text = (work / "one.json").read_text(encoding="utf-8")
    output = work / "one.out.json"
    messages = [Message("user", "question 1: what is 1?")]
    prompt = engine.tokenizer.format(messages)
    return {
        "outputs: writable + distinct": median_ms(lambda: (check_output_file(output, "--outputFile"), check_distinct(
            {"--outputFile": output}, {"--inputFile": work / "one.json", "--engineDir": engine_dir}))),
        "request file: strict JSON (duplicate keys)": median_ms(lambda: loads_json(text, "inputFile")),
        "engine dir: manifest digests": median_ms(lambda: verify_manifest(engine_dir, ENGINE_KIND, "e", "")),
        "engine dir: embedding header": median_ms(lambda: check_embedding(engine_dir / EMBEDDING_FILE,
                                                                          loaded.model, "e")),
        "engine dir: pool vs memory": median_ms(lambda: check_pool_fits_memory(loaded.kv_pool_bytes)),
        "engine dir: graph inputs": median_ms(lambda: check_graph_inputs(engine.backend.session, loaded)),
        "chat template: bounded render": median_ms(lambda: engine.tokenizer.format(messages)),
        "tokenize: content as text": median_ms(lambda: engine.tokenizer.encode_chat(prompt, ["question"])),
        "(whole load_engine_dir, schema included)": median_ms(lambda: load_engine_dir(engine_dir)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--onnxDir", type=Path, help="a real export whose manifest digest time to report")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    figures: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-hardening-") as tmp:
        work = Path(tmp)
        write_onnx_dir(synthetic_model("tiny-llama"), work / "onnx")
        build_engine(work / "onnx", work / "engine", BuildOptions(max_input_len=64, max_kv_cache_capacity=128,
                                                                  max_batch_size=16, tokens_per_page=16))
        small, large = args.requests // 10, args.requests
        for count in (1, small, large):
            write_requests(work / f"{count}.json", count)
        (work / "one.json").write_text((work / "1.json").read_text())
        one_run = min(peak_rss_kib(work / "engine", work / "1.json", work / "o1.json")[1] for _ in range(3))
        rss_small, t_small = peak_rss_kib(work / "engine", work / f"{small}.json", work / "os.json")
        rss_large, t_large = peak_rss_kib(work / "engine", work / f"{large}.json", work / "ol.json")
        per_request = (rss_large - rss_small) * 1024 / (large - small)
        print(f"peak RSS: {rss_small / 1024:,.1f} MiB for {small:,} requests ({t_small:.1f} s), "
              f"{rss_large / 1024:,.1f} MiB for {large:,} ({t_large:.1f} s)")
        print(f"RSS growth per request: {per_request / 1024:,.2f} KB (target <= 10 KB)")
        costs = check_costs(work / "engine", work)
        added = sum(v for k, v in costs.items() if not k.startswith("("))
        for name, ms in costs.items():
            print(f"  {name:45s} {ms:8.3f} ms")
        print(f"checks added to a one-request run: {added:.2f} ms (target < 50 ms); the whole run (a fresh "
              f"process, imports included) takes {one_run * 1e3:,.0f} ms")
        figures = {"requests": [small, large], "peak_rss_kib": [rss_small, rss_large],
                   "rss_bytes_per_request": per_request, "check_ms": costs, "checks_added_ms": added,
                   "one_request_run_ms": one_run * 1e3}
    if args.onnxDir is not None:
        from kvforge.contract.manifest import file_digest

        files = [p for p in sorted(args.onnxDir.iterdir()) if p.is_file() and p.name != "manifest.json"]
        ms = median_ms(lambda: [file_digest(p, p.stat().st_size) for p in files], repeats=5)
        size = sum(p.stat().st_size for p in files)
        print(f"manifest digests of {args.onnxDir} ({size / 2**20:,.0f} MiB in {len(files)} files): {ms:.1f} ms")
        figures["real_export_digest_ms"] = ms
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
