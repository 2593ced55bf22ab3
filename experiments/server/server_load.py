"""Serving under load: 64 closed-loop clients for 60 s against one llm_serve, every answer compared with the
same request served alone, errors counted, latency p50/p95, the server's RSS before and after, and /metrics
against the clients' own sums.

Workload: SmolLM2 (maxBatchSize 16, maxInputLen 512, capacity 1024, reuse on, --maxQueuedRequests 64, so 64
clients never see a 429). 16 prompts (half share a ~70-token prefix, half share nothing), /v1/completions,
greedy, 8 tokens, every other request streamed. References: each prompt once, alone, before the load.

    python -m experiments.server.server_load --onnxDir out/onnx/smollm2 --clients 64 --seconds 60 \
        --json out/bench_server_load.json
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from experiments._common import Progress, Server, bench_parser, percentile, write_json
from kvforge.builder.build import BuildOptions, build_engine

BUILD = BuildOptions(max_input_len=512, max_kv_cache_capacity=1024, max_batch_size=16, tokens_per_page=64,
                     backend="onnxruntime")
SHARED = ("Shared context: the Harbor Point tidal array has fourteen turbines, a 6.8 km export cable, a control "
          "building on the north quay and a maintenance vessel named Tern. ")
PROMPTS = [SHARED + f"Question {i}: what is item {i}?" for i in range(8)] + \
          [f"{i} unshared prompt number {i}, about something else entirely. " * 2 for i in range(8)]
MAX_TOKENS = 8


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def ask(api: openai.AsyncOpenAI, prompt: str, stream: bool) -> str:
    if not stream:
        answer = await api.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return answer.choices[0].text
    text = ""
    async for chunk in await api.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True):
        text += chunk.choices[0].text if chunk.choices else ""
    return text


async def load(url: str, clients: int, seconds: float, references: dict[str, str]) -> dict[str, Any]:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    mismatches = 0
    deadline = time.perf_counter() + seconds

    async def client(number: int) -> None:
        nonlocal mismatches
        rng = random.Random(number)
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as api:
            turn = 0
            while time.perf_counter() < deadline:
                prompt = rng.choice(PROMPTS)
                started = time.perf_counter()
                try:
                    text = await ask(api, prompt, stream=(number + turn) % 2 == 0)
                except openai.APIError as exc:
                    key = f"{type(exc).__name__} {getattr(exc, 'status_code', '')}".strip()
                    errors[key] = errors.get(key, 0) + 1
                    continue
                finally:
                    turn += 1
                latencies.append(time.perf_counter() - started)
                mismatches += text != references[prompt]

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - started
    return {"requests": len(latencies) + sum(errors.values()), "ok": len(latencies), "errors": errors,
            "answers_differing_from_alone": mismatches, "wall_s": round(wall, 1),
            "requests_per_s": round(len(latencies) / wall, 2),
            "latency_p50_ms": round(statistics.median(latencies) * 1000, 1),
            "latency_p95_ms": round(percentile(latencies, 95) * 1000, 1)}


def served_requests(url: str) -> dict[str, float]:
    """kvforge_requests_total by outcome, from /metrics."""
    base = url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvforge_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["outcome"]] = sample.value
    return counts


def main() -> None:
    parser = bench_parser(__doc__, repeats=1)
    parser.add_argument("--engineDir", type=Path, default=Path("out/engines/smollm2-load"))
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    progress = Progress()
    if not (args.engineDir / "config.json").is_file():
        progress(f"building {args.engineDir}")
        build_engine(args.onnxDir, args.engineDir, BUILD)
    server = Server(args.engineDir, args.threads, reuse=True)
    try:
        assert server.url is not None
        url = server.url

        async def alone() -> dict[str, str]:
            async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as api:
                return {prompt: await ask(api, prompt, stream=False) for prompt in PROMPTS}

        references = asyncio.run(alone())
        rss_before = rss_kib(server.process.pid)
        before = served_requests(url)
        progress(f"references done; {args.clients} clients for {args.seconds:.0f} s")
        figures = asyncio.run(load(url, args.clients, args.seconds, references))
        after = served_requests(url)
        figures["rss_before_mib"] = round(rss_before / 1024, 1)
        figures["rss_after_mib"] = round(rss_kib(server.process.pid) / 1024, 1)
        served = {outcome: after.get(outcome, 0) - before.get(outcome, 0) for outcome in after}
        figures["metrics_requests_by_outcome"] = served
        figures["metrics_match_clients"] = sum(v for k, v in served.items() if k in ("stop", "length")) == \
            figures["ok"]
        figures.update(clients=args.clients, threads=args.threads)
    finally:
        server.stop()
    for key, value in figures.items():
        print(f"{key}: {value}")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
