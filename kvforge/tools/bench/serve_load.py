"""A closed-loop load client for OpenAI-compatible servers: the retrieval-and-chat workload of issue 54, driven the
same way against llm_serve, llama-server or a router in front of replicas, so their figures compare.

Each *session* is a growing conversation: a shared system prompt, then turns whose user message carries 3 of the
8 retrieved documents (a different choice and order each turn) and a question, the assistant's scripted reply
kept in the history (scripted, so every server gets the same prompts whatever it answered). Each of `clients`
clients takes the next session from a common queue and sends its turns one after another (streamed
`/v1/chat/completions`, greedy, exactly `max_tokens` tokens: the end tokens are banned through `logit_bias`), so
at most `clients` requests are in flight. TTFT is the time from sending to the first streamed content.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvforge.contract.errors import KvforgeError
from kvforge.tools.bench.text import DOCUMENT_SECTIONS, GLOSSARY

SYSTEM_PROMPT = (
    "You are the assistant of the Harbor Point engineering office. Answer from the retrieved documents given in "
    "each message; quote figures exactly as the documents give them, say which document you used, and say so "
    "plainly when the documents do not answer the question. Keep answers short and factual, in plain English, "
    "and never invent names, dates or numbers. Earlier turns of the conversation stay relevant: build on them.")
QUESTIONS = ["What does the first document say about the schedule?", "Which figures do these documents agree on?",
             "Who is responsible for the work described here?", "What went wrong, according to these documents?",
             "Summarise the differences between the documents.", "What should the office check next?"]
REPLY = ("According to the documents, the figures above hold; the second document adds the schedule, and the "
         "third names who signed off.")
NUM_DOCUMENTS = 8
PER_TURN = 3


def documents(words: int, count: int = NUM_DOCUMENTS) -> list[str]:
    """`count` distinct documents of about `words` words each, cut from the report's sections and its glossary."""
    pool = " ".join(section.replace("\n", " ") for section in DOCUMENT_SECTIONS).split()
    docs = []
    for i in range(count):
        start = (i * 97) % max(1, len(pool) - words)
        body = " ".join(pool[start:start + words])
        docs.append(f"Document {i + 1} ({GLOSSARY[i % len(GLOSSARY)]}): {body}")
    return docs


@dataclass(frozen=True, slots=True)
class Session:
    """One conversation: the messages of each turn's request (each a prefix-extension of the one before)."""

    turns: list[list[dict[str, str]]]


def sessions(count: int, turns: int, doc_words: int, seed: int = 0, system_prompt: str = SYSTEM_PROMPT,
             num_documents: int = NUM_DOCUMENTS) -> list[Session]:
    """`count` sessions of `turns` turns; session i draws its documents with random.Random(seed + i), so a run is
    the same on every server."""
    if count < 1 or turns < 1 or doc_words < 1:
        raise KvforgeError(f"sessions {count}, turns {turns} and document words {doc_words} must be at least 1",
                           "sessions")
    docs = documents(doc_words, num_documents)
    out = []
    for i in range(count):
        rng = random.Random(seed + i)
        history: list[dict[str, str]] = [{"role": "system", "content": system_prompt}]
        requests = []
        for turn in range(turns):
            chosen = rng.sample(range(num_documents), PER_TURN)  # 3 of 8, in the order retrieval ranked them
            context = "\n\n".join(docs[d] for d in chosen)
            question = QUESTIONS[(i + turn) % len(QUESTIONS)]
            history = [*history, {"role": "user", "content": f"Retrieved documents:\n\n{context}\n\n{question}"}]
            requests.append(history)
            history = [*history, {"role": "assistant", "content": REPLY}]
        out.append(Session(requests))
    return out


@dataclass(slots=True)
class Result:
    """One request as the client saw it."""

    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class LevelFigures:
    clients: int
    requests: int
    errors: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    latency_p50_ms: float
    output_tokens: int
    prompt_tokens: int
    error_kinds: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int,
                      banned: list[int]) -> Result:
    """A streamed chat completion: TTFT at the first content delta; tokens from the final usage chunk (or the
    content deltas counted, for a server that sends no usage)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": {str(t): -100 for t in banned}}
    started = time.perf_counter()
    ttft = 0.0
    deltas = 0
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Result(False, error=f"HTTP {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        deltas += 1
                        ttft = ttft or time.perf_counter() - started
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Result(False, error=type(exc).__name__)
    latency = time.perf_counter() - started
    return Result(True, ttft or latency, latency, int(usage.get("completion_tokens", deltas)),
                  int(usage.get("prompt_tokens", 0)))


async def run_level(base_url: str, model: str, clients: int, work: list[Session], max_tokens: int,
                    banned: list[int], api_key: str | None = None, timeout_s: float = 600.0) -> LevelFigures:
    """`clients` closed-loop clients through every session of `work` (each session's turns in order, on one
    client); the level's figures."""
    if clients < 1:
        raise KvforgeError(f"clients must be at least 1, got {clients}", "clients")
    if max_tokens < 1:
        raise KvforgeError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for session in work:
        queue.put_nowait(session)
    results: list[Result] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async with httpx.AsyncClient(base_url=base_url.rstrip("/").removesuffix("/v1"), headers=headers,
                                 timeout=timeout_s, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                session = queue.get_nowait()
                for messages in session.turns:
                    results.append(await one_request(client, model, messages, max_tokens, banned))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - started
    done = [r for r in results if r.ok]
    kinds: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kinds[r.error] = kinds.get(r.error, 0) + 1
    ttfts = [r.ttft_s * 1000 for r in done] or [0.0]
    out_tokens = sum(r.output_tokens for r in done)
    return LevelFigures(clients=clients, requests=len(results), errors=len(results) - len(done), wall_s=round(wall, 3),
                        requests_per_s=round(len(done) / wall, 3), output_tokens_per_s=round(out_tokens / wall, 2),
                        ttft_p50_ms=round(statistics.median(ttfts), 1), ttft_p95_ms=round(percentile(ttfts, 95), 1),
                        latency_p50_ms=round(statistics.median([r.latency_s * 1000 for r in done] or [0.0]), 1),
                        output_tokens=out_tokens, prompt_tokens=sum(r.prompt_tokens for r in done), error_kinds=kinds)


def level(base_url: str, model: str, clients: int, work: list[Session], max_tokens: int, banned: list[int],
          api_key: str | None = None) -> LevelFigures:
    """run_level from synchronous code."""
    return asyncio.run(run_level(base_url, model, clients, work, max_tokens, banned, api_key))
