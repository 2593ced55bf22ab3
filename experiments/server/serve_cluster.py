"""Two llm_serve replicas behind Shepherd Model Gateway (issue 54 item 4): the retrieval-and-agents workload through
`cache_aware`, `round_robin`, and `round_robin` with the Redis tier; reused-token share from the replicas' own
counters, TTFT p50/p95 and throughput, and issue 54's target (cache_aware reuses >= 1.5x the tokens round_robin
does without the tier).

Workload (kvforge.tools.bench.serve_load): --sessions growing conversations of --turns turns (a shared system
prompt; each user message 3 of 8 shared documents in changing order and a question; greedy, --maxTokens tokens),
--clients closed-loop clients. Each policy starts from empty caches: fresh replicas (and a fresh redis-server for
the tier), as `make cluster` starts them: `smg launch --policy P --worker-urls ...` on 127.0.0.1, its metrics on a
free loopback port. The reused-token share is the sum over both replicas of vllm:prefix_cache_hits over
vllm:prefix_cache_queries (prompt tokens served from the cache, the shared tier's pages included, over prompt tokens
looked up).

    python -m experiments.server.serve_cluster --onnxDir out/onnx/smollm2 --json out/bench_serve_cluster.json
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from experiments._common import write_json
from experiments.server._serve import (
    BIN,
    Process,
    counters,
    cpu_model,
    delta,
    ensure_engine,
    free_port,
    http_ok,
    llm_serve,
    load_average,
)
from kvforge.builder.build import BuildOptions
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.tools.bench import serve_load

BUILD = BuildOptions(max_input_len=1024, max_kv_cache_capacity=2048, max_batch_size=16, tokens_per_page=16)
MODES = {"cache_aware": ("cache_aware", False), "round_robin": ("round_robin", False),
         "round_robin+redis": ("round_robin", True)}
TARGET = 1.5  # cache_aware's reused tokens over round_robin's (no tier), at least


def run_mode(mode: str, engine_dir: Path, args: argparse.Namespace, banned: list[int]) -> dict[str, Any]:
    policy, tier = MODES[mode]
    logs = args.logDir / mode
    started: list[Process] = []
    try:
        extra: list[str] = []
        if tier:
            redis = shutil.which("redis-server")
            if redis is None:
                return {"mode": mode, "skipped": "redis-server is not installed (apt-get install redis-server)"}
            redis_port = free_port()
            logs.mkdir(parents=True, exist_ok=True)
            started.append(Process([redis, "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
                                    "--appendonly", "no", "--dir", str(logs)], logs / "redis.log"))
            secret = logs / "salt.secret"
            secret.write_text(secrets.token_hex(32))
            extra = ["--sharedCache", f"redis://127.0.0.1:{redis_port}/0", "--saltSecret", str(secret)]
            time.sleep(1)
        ports = [free_port() for _ in range(args.replicas)]
        for port in ports:
            started.append(llm_serve(engine_dir, port, args.threads, logs / f"replica-{port}.log", extra))
        gateway = free_port()
        router = Process([str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(gateway), "--policy",
                          policy, "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports],
                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())], logs / "smg.log")
        started.append(router)
        router.wait(f"http://127.0.0.1:{gateway}/v1/models")
        deadline = time.monotonic() + 20
        while not http_ok(f"http://127.0.0.1:{gateway}/readiness") and time.monotonic() < deadline:
            time.sleep(0.5)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        before = [counters(url) for url in urls]
        work = serve_load.sessions(args.sessions, args.turns, args.docWords, seed=args.seed)
        figures = serve_load.level(f"http://127.0.0.1:{gateway}", "smollm2", args.clients, work, args.maxTokens,
                                   banned).as_dict()
        per_replica = [delta(counters(url), b) for url, b in zip(urls, before, strict=True)]
    finally:
        for process in reversed(started):
            process.stop()
    hits = sum(r.get("vllm:prefix_cache_hits_total", 0.0) for r in per_replica)
    queries = sum(r.get("vllm:prefix_cache_queries_total", 0.0) for r in per_replica)
    row = {"mode": mode, **figures, "reused_tokens": hits, "queried_tokens": queries,
           "reused_token_share": round(hits / queries, 3) if queries else 0.0,
           "prompt_tokens_per_replica": [r.get("kvforge_prompt_tokens_total", 0.0) for r in per_replica],
           "load_after": load_average()}
    print(f"{mode:18} reused {row['reused_token_share']:.1%} of {queries:,.0f} prompt tokens; "
          f"{row['requests']} requests ({row['errors']} errors), {row['requests_per_s']:.2f} req/s, "
          f"{row['output_tokens_per_s']:.1f} out tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms "
          f"p95 {row['ttft_p95_ms']:.0f} ms; per replica prompt tokens {row['prompt_tokens_per_replica']}",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnxDir", type=Path, default=Path("out/onnx/smollm2"))
    parser.add_argument("--engineDir", type=Path, default=Path("out/engines/smollm2-serve16"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="per replica (2 replicas on 2 cores: 1 each)")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--docWords", type=int, default=60)
    parser.add_argument("--maxTokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=54)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--logDir", type=Path, default=Path("out/bench_serve_cluster_logs"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    for flag in ("replicas", "threads", "clients", "sessions", "turns", "docWords", "maxTokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if not (BIN / "smg").exists():
        raise SystemExit(f"smg (Shepherd Model Gateway) is not installed in {BIN}: pip install 'kvforge[cluster]'")
    engine_dir = ensure_engine(args.onnxDir, args.engineDir, BUILD)
    banned = sorted(load_engine_dir(engine_dir).model.eos_token_ids)
    figures: dict[str, Any] = {"cpu": cpu_model(), "threads_per_replica": args.threads, "replicas": args.replicas,
                               "load_before": load_average(), "rows": []}
    print(f"CPU {figures['cpu']}; load {figures['load_before']}", flush=True)
    for mode in args.modes:
        figures["rows"].append(run_mode(mode, engine_dir, args, banned))
    by_mode = {r["mode"]: r for r in figures["rows"] if "skipped" not in r}
    if {"cache_aware", "round_robin"} <= set(by_mode) and by_mode["round_robin"]["reused_tokens"]:
        ratio = by_mode["cache_aware"]["reused_tokens"] / by_mode["round_robin"]["reused_tokens"]
        figures["reuse_ratio"] = round(ratio, 2)
        print(f"cache_aware / round_robin reused tokens = {ratio:.2f}x (target >= {TARGET}x: "
              f"{'met' if ratio >= TARGET else 'MISSED'})")
    figures["load_after"] = load_average()
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
