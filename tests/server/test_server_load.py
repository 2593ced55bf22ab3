"""32 concurrent clients x 8 requests against one server: every request succeeds with the answer it gets alone, or
gets 429 by design; afterwards the pool is back to its idle free count and the cache audits clean."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import openai
from support.server_harness import MODEL, build_server_engine, idle_audit, live_server

CLIENTS = 32
REQUESTS_PER_CLIENT = 8
SHARED = "Shared context: the Harbor Point array has fourteen turbines and a 6.8 km export cable. "
# Half the prompts share a long prefix (reuse and in-flight sharing), half share nothing.
PROMPTS = [SHARED + f"Question {i}: what is item {i}?" for i in range(8)] + \
          [f"{i} unshared prompt number {i} " * 2 for i in range(8)]
MAX_TOKENS = 6


async def ask(api: openai.AsyncOpenAI, prompt: str, stream: bool) -> str:
    if not stream:
        answer = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")
        return answer.choices[0].text
    text = ""
    async for chunk in await api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                    stream=True):
        text += chunk.choices[0].text if chunk.choices else ""
    return text


async def client_session(base_url: str, seed: int, expected: dict[str, str], outcomes: Counter[str]) -> None:
    rng = random.Random(seed)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120) as api:
        for _ in range(REQUESTS_PER_CLIENT):
            prompt = rng.choice(PROMPTS)
            try:
                text = await ask(api, prompt, stream=rng.random() < 0.5)
            except openai.RateLimitError:
                outcomes["429"] += 1
                continue
            assert text == expected[prompt], "an answer under load differs from the answer alone"
            outcomes["ok"] += 1


def test_many_concurrent_clients(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    engine_dir = build_server_engine(tiny_onnx_dir, tmp_path / "engine")
    with live_server(engine_dir, tmp_path, max_queued_requests=8) as server:
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as api:
            expected = {p: api.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                                  temperature=0).choices[0].text for p in PROMPTS}
        outcomes: Counter[str] = Counter()

        async def run_all() -> None:
            await asyncio.gather(*(client_session(server.base_url, seed, expected, outcomes)
                                   for seed in range(CLIENTS)))

        asyncio.run(asyncio.wait_for(run_all(), timeout=300))
        print(f"\n{CLIENTS}x{REQUESTS_PER_CLIENT} requests: {dict(outcomes)}")
        assert outcomes["ok"] + outcomes["429"] == CLIENTS * REQUESTS_PER_CLIENT
        assert outcomes["ok"] >= CLIENTS  # the queue bounds the load; it does not refuse most of it
        audit = server.on_engine(idle_audit)
        assert audit["records"] > 0
        stats = server.on_engine(lambda e: (e.scheduler.stats.max_running, e.cache.profile()["hit_sequences"]))
        assert stats[0] > 1, "requests that arrived together did not share steps"
        assert stats[1] > 0
        assert server.state.in_flight == 0
        _, metrics = server.request("GET", "/metrics")
        assert f'kvforge_requests_total{{outcome="rejected"}} {float(outcomes["429"])}' in metrics


def test_load_without_reuse_frees_every_page(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    engine_dir = build_server_engine(tiny_onnx_dir, tmp_path / "engine")
    with live_server(engine_dir, tmp_path, reuse=False) as server:

        async def burst() -> list[str]:
            async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as api:
                return await asyncio.gather(*(ask(api, p, stream=i % 2 == 0) for i, p in enumerate(PROMPTS * 2)))

        answers = asyncio.run(burst())
        assert answers[:len(PROMPTS)] == answers[len(PROMPTS):]
        audit = server.on_engine(idle_audit)
        assert audit["free"] == server.on_engine(lambda e: e.cache.pages.capacity)  # nothing cached, all free
