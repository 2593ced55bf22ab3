"""Serving: throughput and TTFT of llm_serve at 1, 4 and 16 concurrent clients, reuse on and off, against the
static llm_inference path on the same workload, in one run.

Workload: one SmolLM2 engine (maxBatchSize 16, maxInputLen 1792, capacity 2048, 128-token pages). Every request
is a chat: the same ~1,500-token system prompt (the report of experiments/_common.py) and its own short question,
greedy, exactly --maxTokens generated (end of sequence suppressed). Each level runs max(8, 2 x clients)
requests, each client sending its next request when the last one finished (closed loop).

- server: `llm_serve` in a subprocess on 127.0.0.1 (reuse on: --enableContextReuse), clients are `openai`
  AsyncOpenAI streams; TTFT is measured by the client from sending to the first streamed text.
- static: the same requests as a request file through file_loop.run_request_file(STATIC) with batch_size =
  clients (llm_inference's default path), in this process; TTFT is the response's timing.ttft_ms (from its
  batch's start: time waiting for earlier batches is not in it, which favours static).
Before each series one warm-up request (a question of its own) runs on each path, so reuse on starts with the
system prompt cached, as a server in steady use has it. At each level the two paths run back to back (the
server idles while the static path runs), so both see the same load from whatever else runs on the machine.

    python -m experiments.server.serve --onnxDir out/onnx/smollm2 --threads 2 --json out/bench_serve.json
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import openai

from experiments._common import Progress, Server, bench_parser, fit_document, greedy, percentile, write_json
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.file_loop import Scheduling, prepare_requests, run_request_file
from kvforge.runtime.inputs.request_file import RequestFile
from kvforge.runtime.inputs.tokenizer import ChatTokenizer
from kvforge.runtime.types import Message, Request

BUILD = BuildOptions(max_input_len=1792, max_kv_cache_capacity=2048, max_batch_size=16, tokens_per_page=128)
SYSTEM_TOKENS = 1500
CONCURRENCY = (1, 4, 16)


def requests_for(clients: int) -> int:
    return max(8, 2 * clients)


def question(i: int) -> str:
    return f"Question {i}: in one sentence, what does section {i % 10 + 1} of the report say about the array?"


def summary(ttfts_ms: list[float], tokens: int, seconds: float, cached: int) -> dict[str, float]:
    return {"requests": len(ttfts_ms), "tokens_per_s": tokens / seconds, "ttft_p50_ms": statistics.median(ttfts_ms),
            "ttft_p95_ms": percentile(ttfts_ms, 95), "wall_s": seconds, "cached_tokens": cached}


# --- the server, driven by openai clients ---------------------------------------------------------------


async def one_request(api: openai.AsyncOpenAI, system: str, i: int, max_tokens: int, eos: dict[str, int],
                      ) -> tuple[float, int, int]:
    """(TTFT ms, generated tokens, cached tokens) of one streamed chat."""
    started = time.perf_counter()
    ttft, usage = None, None
    stream = await api.chat.completions.create(
        model="smollm2", messages=[{"role": "system", "content": system}, {"role": "user", "content": question(i)}],
        max_tokens=max_tokens, temperature=0, logit_bias=eos, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if ttft is None and any(c.delta.content or c.finish_reason for c in chunk.choices):
            ttft = (time.perf_counter() - started) * 1e3
        usage = chunk.usage or usage
    assert usage is not None and ttft is not None
    return ttft, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens


async def serve_level(url: str, system: str, clients: int, count: int, first: int, max_tokens: int,
                      eos: dict[str, int]) -> dict[str, float]:
    numbers = iter(range(first, first + count))
    results: list[tuple[float, int, int]] = []

    async def client() -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=3600) as api:
            for i in numbers:  # the clients share one iterator: each takes the next question when it is free
                results.append(await one_request(api, system, i, max_tokens, eos))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    seconds = time.perf_counter() - started
    return summary([r[0] for r in results], sum(r[1] for r in results), seconds, sum(r[2] for r in results))


# --- the static llm_inference path ----------------------------------------------------------------------


def static_level(engine: Engine, system: str, clients: int, count: int, first: int, max_tokens: int,
                 eos: dict[str, int]) -> dict[str, float]:
    sampling = greedy(max_tokens, logit_bias={int(k): v for k, v in eos.items()})
    requests = [Request(i, [Message("system", system), Message("user", question(first + i))], sampling)
                for i in range(count)]
    request_file = RequestFile(requests, batch_size=clients)
    prepared = prepare_requests(engine, request_file)
    started = time.perf_counter()
    responses = run_request_file(engine, request_file, prepared, Scheduling.STATIC)
    seconds = time.perf_counter() - started
    return summary([r["timing"]["ttft_ms"] for r in responses], sum(r["usage"]["completion_tokens"] for r in responses),
                   seconds, sum(r["usage"]["cached_tokens"] for r in responses))


# --- the run ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = bench_parser(__doc__, repeats=1)
    parser.add_argument("--engineDir", type=Path, default=Path("out/engines/smollm2-serve"))
    parser.add_argument("--maxTokens", type=int, default=32)
    parser.add_argument("--clients", default=",".join(map(str, CONCURRENCY)), help="concurrency levels, e.g. 1,4,16")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    progress = Progress()
    if not (args.engineDir / "config.json").is_file():
        progress(f"building {args.engineDir}")
        build_engine(args.onnxDir, args.engineDir, BUILD)
    tokenizer = ChatTokenizer(args.engineDir)
    system, system_tokens = fit_document(tokenizer.encode, SYSTEM_TOKENS)
    eos = {str(t): -100 for t in load_engine_dir(args.engineDir).model.eos_token_ids}
    figures: dict[str, Any] = {"system_prompt_tokens": system_tokens, "max_tokens": args.maxTokens,
                               "threads": args.threads, "server": {}, "static": {}}
    number = 10_000  # question numbers: every request of the run asks its own question
    for reuse in (False, True):
        mode = "reuse_on" if reuse else "reuse_off"
        progress(f"{mode}: starting llm_serve and the static engine")
        server = Server(args.engineDir, args.threads, reuse)  # idle (no CPU) while the static path runs
        engine = Engine(args.engineDir, EngineConfig(num_threads=args.threads, enable_context_reuse=reuse))
        try:
            assert server.url is not None
            asyncio.run(serve_level(server.url, system, 1, 1, 0, args.maxTokens, eos))  # warm-ups
            static_level(engine, system, 1, 1, 0, args.maxTokens, eos)
            for clients in levels:  # the two paths back to back at each level: both see the same machine load
                count = requests_for(clients)
                figures["server"].setdefault(mode, {})[clients] = asyncio.run(serve_level(
                    server.url, system, clients, count, number, args.maxTokens, eos))
                figures["static"].setdefault(mode, {})[clients] = static_level(
                    engine, system, clients, count, number + 500, args.maxTokens, eos)
                number += 1000
                progress(f"{mode}, {clients} clients: server {figures['server'][mode][clients]}, "
                         f"static {figures['static'][mode][clients]}")
        finally:
            server.stop()
            del engine
    report(figures, levels)
    write_json(args.json, figures)


def report(figures: dict[str, Any], levels: list[int]) -> None:
    print(f"\nshared system prompt {figures['system_prompt_tokens']} tokens, {figures['max_tokens']} generated "
          f"per request, {figures['threads']} threads")
    print("| path | reuse | clients | requests | tok/s | TTFT p50 ms | TTFT p95 ms | cached tokens | "
          "kvforge/server/static tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in ("reuse_off", "reuse_on"):
        for clients in levels:
            for path in ("server", "static"):
                f = figures[path][mode][clients]
                ratio = f["tokens_per_s"] / figures["static"][mode][clients]["tokens_per_s"]
                print(f"| {path} | {mode[6:]} | {clients} | {f['requests']} | {f['tokens_per_s']:.1f} | "
                      f"{f['ttft_p50_ms']:.0f} | {f['ttft_p95_ms']:.0f} | {f['cached_tokens']} | "
                      f"{ratio:.2f} |")
    for clients in levels:
        on, off = figures["server"]["reuse_on"][clients], figures["server"]["reuse_off"][clients]
        print(f"server, {clients} clients: reuse on/off tok/s {on['tokens_per_s'] / off['tokens_per_s']:.2f}x, "
              f"TTFT p50 off/on {off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x")


if __name__ == "__main__":
    main()
