"""The shared KV tier: what a second process gains from pages a first one computed, and what two servers sharing a
tier gain over two with private caches, on Redis and on Mooncake Store, in one run.

1. TTFT of a second process. SmolLM2 (128-token pages), a ~1,500-token document as the system prompt and a short
   question (greedy, 1 token). A first process answers question 0 with `--sharedCache` and exits (its writes are
   flushed at close). A second, fresh process then asks question 1 about the same document three ways: cold
   (lookup bypass: everything computed), from Redis, from Mooncake. Each repeat uses its own cache salt, so every
   repeat misses locally and the second process's only source is the tier. Also: load time per page (the tier's
   load_ms over the pages it brought) against the prefill time per page it replaces (cold TTFT over the
   document's pages).
2. Throughput: two llm_serve processes (one thread each, a small KV pool of --poolPages pages, so each holds a few
   documents), --clients closed-loop clients over --documents shared documents (~1,000 tokens each, a question of
   their own, 8 tokens), alternating servers, --seconds each: both servers on one Redis vs private caches.

The store servers run here, on loopback; Mooncake's (master + a standalone holder) only inside a private network
namespace (its clients listen on 0.0.0.0), so run the whole bench under one:

    unshare -n sh -c 'ip link set lo up && KVFORGE_NETNS=1 .venv/bin/python -m experiments.reuse.shared_tier \\
        --onnxDir out/onnx/smollm2 --json out/bench_shared_tier.json'

Outside one, the Mooncake rows are skipped with the reason. `make bench-shared-tier` does the above.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai

from experiments._common import Progress, Server, bench_parser, greedy, percentile, rerun_command, write_json
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.tools.bench.text import fit_document, text_tokens
from tests.support.stores import MooncakeServer, RedisServer, in_private_netns  # the tests' store harness

BUILD = BuildOptions(max_input_len=2048, max_kv_cache_capacity=2304, max_batch_size=4, tokens_per_page=128)
DOC_TOKENS = 1500
THROUGHPUT_DOC_TOKENS = 1000
MAX_TOKENS = 8


def question(i: int) -> str:
    return f"Question {i}: in one sentence, what does section {i % 10 + 1} say?"


# --- part 1: one process answers, a second one loads -----------------------------------------------------


def worker(args: Any) -> None:
    """One process: open the engine (with the tier unless --url is empty), run the asked requests, print JSON."""
    from kvforge.runtime.api import LLM

    config: dict[str, Any] = {"num_threads": args.threads, "enable_context_reuse": True}
    if args.url:
        config["shared_cache"] = args.url
    llm = LLM(args.engineDir, **config)
    document = fit_document(llm.engine.tokenizer.encode, DOC_TOKENS)[0]
    results = []
    for item in json.loads(args.requests):
        messages = [{"role": "system", "content": document}, {"role": "user", "content": question(item["q"])}]
        params = greedy(1, reuse_context=item.get("reuse", True))
        before = llm.engine.profile()["context_cache"].get("shared_tier", {})
        [out] = llm.chat(messages, params, cache_salt=item["salt"])
        after = llm.engine.profile()["context_cache"].get("shared_tier", {})
        results.append({"ttft_ms": out.timing.ttft_ms, "prompt_tokens": len(out.prompt_token_ids),
                        "token": out.token_ids[-1], **{k: after[k] - before.get(k, 0) for k in after}})
    started = time.perf_counter()
    llm.close()
    print(json.dumps({"results": results, "close_ms": (time.perf_counter() - started) * 1e3}))


def run_worker(engine_dir: Path, threads: int, url: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    argv, env = rerun_command(__spec__.name)
    proc = subprocess.run([*argv, "--role", "worker", "--onnxDir", ".", "--engineDir", str(engine_dir),
                           "--threads", str(threads), "--url", url, "--requests", json.dumps(requests)],
                          capture_output=True, text=True, check=False, timeout=600, env=env)
    if proc.returncode:
        raise SystemExit(f"worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def second_process(engine_dir: Path, threads: int, backend: str, url: str, repeats: int,
                   progress: Progress) -> dict[str, Any]:
    salts = [f"{backend}-{time.time_ns()}-{r}" for r in range(repeats)]
    progress(f"{backend}: a first process answers question 0 under {repeats} salts")
    primed = run_worker(engine_dir, threads, url, [{"q": 0, "salt": s} for s in salts])
    progress(f"{backend}: a second process asks question 1, cold then from the tier")
    # Cold first (bypass: nothing looked up or loaded), then each salt from the tier.
    runs = run_worker(engine_dir, threads, url, [{"q": 1, "salt": f"cold-{s}", "reuse": False} for s in salts] +
                      [{"q": 1, "salt": s} for s in salts])["results"]
    cold, warm = runs[:repeats], runs[repeats:]
    loaded_pages = [w["loaded_tokens"] / BUILD.tokens_per_page for w in warm]
    prompt_pages = cold[0]["prompt_tokens"] / BUILD.tokens_per_page
    row = {"backend": backend, "prompt_tokens": cold[0]["prompt_tokens"],
           "cold_ttft_ms": statistics.median(c["ttft_ms"] for c in cold),
           "tier_ttft_ms": statistics.median(w["ttft_ms"] for w in warm),
           "loaded_tokens": statistics.median(w["loaded_tokens"] for w in warm),
           "load_ms": statistics.median(w["load_ms"] for w in warm),
           "same_token_as_cold": all(c["token"] == w["token"] for c, w in zip(cold, warm, strict=True)),
           "first_process_writes": sum(r["writes"] for r in primed["results"]),
           "first_process_write_bytes": sum(r["write_bytes"] for r in primed["results"]),
           "first_process_close_ms": primed["close_ms"],
           "errors": sum(w["errors"] + w["timeouts"] + w["corrupt"] for w in warm)}
    row["cold_over_tier"] = row["cold_ttft_ms"] / row["tier_ttft_ms"]
    row["load_ms_per_page"] = row["load_ms"] / max(statistics.median(loaded_pages), 1)
    row["prefill_ms_per_page"] = row["cold_ttft_ms"] / prompt_pages
    return row


# --- part 2: two servers -------------------------------------------------------------------------------------


async def closed_loop(urls: list[str], documents: list[str], clients: int, seconds: float) -> dict[str, Any]:
    ttfts: list[float] = []
    cached = prompt = 0
    counter = iter(range(1 << 30))
    deadline = time.perf_counter() + seconds

    async def client(number: int) -> None:
        nonlocal cached, prompt
        rng = random.Random(number)
        apis = [openai.AsyncOpenAI(base_url=u, api_key="unused", max_retries=0, timeout=600) for u in urls]
        while time.perf_counter() < deadline:
            i = next(counter)
            api = apis[i % len(apis)]
            document = documents[rng.randrange(len(documents))]
            started = time.perf_counter()
            ttft = None
            stream = await api.chat.completions.create(
                model="smollm2", messages=[{"role": "system", "content": document},
                                           {"role": "user", "content": question(i)}],
                max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True})
            usage = None
            async for chunk in stream:
                if ttft is None and any(c.delta.content or c.finish_reason for c in chunk.choices):
                    ttft = (time.perf_counter() - started) * 1e3
                usage = chunk.usage or usage
            assert ttft is not None and usage is not None
            ttfts.append(ttft)
            prompt += usage.prompt_tokens
            cached += usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0

    started = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(clients)))
    wall = time.perf_counter() - started
    return {"requests": len(ttfts), "requests_per_s": len(ttfts) / wall, "ttft_p50_ms": statistics.median(ttfts),
            "ttft_p95_ms": percentile(ttfts, 95), "cached_share": cached / max(prompt, 1), "wall_s": wall}


def two_servers(engine_dir: Path, documents: list[str], clients: int, seconds: float, url: str | None,
                secret: Path) -> dict[str, Any]:
    extra = ["--sharedCache", url, "--saltSecret", str(secret)] if url else ["--saltSecret", str(secret)]
    servers = [Server(engine_dir, 1, reuse=True, extra_args=extra) for _ in range(2)]
    try:
        urls = [s.url for s in servers]
        assert all(urls)
        return asyncio.run(closed_loop(urls, documents, clients, seconds))  # type: ignore[arg-type]
    finally:
        for server in servers:
            server.stop()


def main() -> None:
    parser = bench_parser(__doc__, repeats=3)
    parser.add_argument("--engineDir", type=Path, default=Path("out/engines/smollm2-tier"))
    parser.add_argument("--smallEngineDir", type=Path, default=Path("out/engines/smollm2-tier-small"))
    parser.add_argument("--poolPages", type=int, default=40, help="KV pages per server in part 2.")
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--backends", default="redis,mooncake")
    parser.add_argument("--skipServers", action="store_true", help="Part 1 only.")
    parser.add_argument("--role", default="main", help=argparse_hidden())
    parser.add_argument("--url", default="")
    parser.add_argument("--requests", default="[]")
    args = parser.parse_args()
    if args.role == "worker":
        worker(args)
        return
    progress = Progress()
    for path, options in ((args.engineDir, BUILD), (args.smallEngineDir,
                                                    replace(BUILD, max_kv_pool_pages=args.poolPages))):
        if not (path / "config.json").is_file():
            progress(f"building {path}")
            build_engine(args.onnxDir, path, options)
    figures: dict[str, Any] = {"threads": args.threads, "repeats": args.repeats, "second_process": [],
                               "skipped": {}}
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvforge-bench-tier-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    backends = args.backends.split(",")
    redis = RedisServer(work / "redis") if "redis" in backends else None
    try:
        if redis is not None:
            figures["second_process"].append(second_process(args.engineDir, args.threads, "redis", redis.url,
                                                            args.repeats, progress))
        if "mooncake" in backends:
            if not in_private_netns():
                figures["skipped"]["mooncake"] = "not in a private network namespace (see the module docstring)"
            else:
                with MooncakeServer(work / "mooncake") as mooncake:
                    figures["second_process"].append(second_process(args.engineDir, args.threads, "mooncake",
                                                                    mooncake.url, args.repeats, progress))
        if not args.skipServers and redis is not None:
            from kvforge.runtime.inputs.tokenizer import ChatTokenizer

            encode = ChatTokenizer(args.engineDir).encode
            decode = ChatTokenizer(args.engineDir).decode
            documents = [decode(text_tokens(encode, THROUGHPUT_DOC_TOKENS, start=d)[:THROUGHPUT_DOC_TOKENS])
                         for d in range(args.documents)]
            secret = work / "secret.bin"
            secret.write_bytes(os.urandom(32))
            progress(f"two servers, private caches: {args.clients} clients, {args.seconds:.0f} s")
            private = two_servers(args.smallEngineDir, documents, args.clients, args.seconds, None, secret)
            progress(f"two servers sharing Redis: {args.clients} clients, {args.seconds:.0f} s")
            shared = two_servers(args.smallEngineDir, documents, args.clients, args.seconds,
                                 redis.url + "?prefix=tput:", secret)
            figures["two_servers"] = {"private": private, "shared_redis": shared,
                                      "shared_over_private_requests_per_s":
                                          shared["requests_per_s"] / private["requests_per_s"],
                                      "pool_pages": args.poolPages, "documents": args.documents,
                                      "clients": args.clients, "seconds": args.seconds}
    finally:
        if redis is not None:
            redis.stop()
    print_figures(figures)
    write_json(args.json, figures)


def argparse_hidden() -> str:
    return "internal: 'worker' runs one process's requests"


def print_figures(figures: dict[str, Any]) -> None:
    print(f"{'backend':10}{'prompt':>8}{'cold ms':>10}{'tier ms':>10}{'ratio':>8}{'loaded':>8}"
          f"{'load/page':>11}{'prefill/page':>14}{'same':>6}")
    for row in figures["second_process"]:
        print(f"{row['backend']:10}{row['prompt_tokens']:8d}{row['cold_ttft_ms']:10.1f}{row['tier_ttft_ms']:10.1f}"
              f"{row['cold_over_tier']:8.2f}{row['loaded_tokens']:8.0f}{row['load_ms_per_page']:9.2f}ms"
              f"{row['prefill_ms_per_page']:12.2f}ms{str(row['same_token_as_cold']):>6}")
    for name, reason in figures["skipped"].items():
        print(f"{name}: skipped ({reason})")
    if "two_servers" in figures:
        two = figures["two_servers"]
        for name in ("private", "shared_redis"):
            r = two[name]
            print(f"two servers, {name:13}: {r['requests']:4d} requests, {r['requests_per_s']:.2f}/s, TTFT p50 "
                  f"{r['ttft_p50_ms']:.0f} ms p95 {r['ttft_p95_ms']:.0f} ms, cached {r['cached_share']:.0%}")
        print(f"shared / private requests per second: {two['shared_over_private_requests_per_s']:.2f}")


if __name__ == "__main__":
    main()
