"""What the context-reuse scripts share: a request, one request run alone with its costs, the engine-call floor,
and the 8-turn chat over a document that partial_reuse.py and recurrent_reuse.py both hold.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from experiments._common import greedy
from kvforge.contract.profile_schema import PREFILL_STAGE
from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.manager import Admission
from kvforge.runtime.context_cache.types.partial_tails import restore_slot
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.engine.output import RequestOutput
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.file_loop import drain
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import LookupPolicy, Message, Request

# The chat over a ~1,550-token document: the first turn shares it, the rest ask about it.
SYSTEM = "You answer questions about the report the user shares. Be brief and factual."
QUESTIONS = [
    "Here is a report.\n\n{document}\n\nWhat does the report describe, in one sentence?",
    "How many turbines does the array have?",
    "Why was the Harbor Point channel chosen?",
    "What went wrong with availability?",
    "How were the frames installed?",
    "What did the environmental monitoring find?",
    "What did the project cost?",
    "Which recommendation matters most?",
]


def make_request(engine: Engine, messages: list[dict[str, str]], *, max_generate_length: int, chat: bool,
                 salt: str | None = None, num_logprobs: int = 1) -> EngineRequest:
    """A greedy request, tokenized by the engine (chat template or the raw concatenation)."""
    request = Request(0, [Message(m["role"], m["content"]) for m in messages],
                      greedy(max_generate_length, num_logprobs=num_logprobs), apply_chat_template=chat,
                      add_generation_prompt=chat, cache_salt=salt)
    return engine.inputs.process(request)


@dataclass(slots=True)
class Run:
    """One request run alone, with what the engine loop spent on it."""

    output: RequestOutput
    wall_ms: float  # add_request to the end of the last step
    bookkeeping_us: float  # the context-cache manager's calls
    prefill_ms: float  # the engine calls that computed prompt tokens (the profile's llm_prefill stage)

    @property
    def ttft_ms(self) -> float:
        assert self.output.timing is not None
        return self.output.timing.ttft_ms

    @property
    def cached_tokens(self) -> int:
        return self.output.cached_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.output.token_ids


class Bench:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, request: EngineRequest, reuse: bool) -> Run:
        """One request alone (reuse=False is the lookup bypass), timed from add_request to its last step."""
        engine = self.engine
        request = replace(request, sampling=replace(request.sampling, reuse_context=reuse))
        book = engine.cache.bookkeeping_nanoseconds
        prefill = engine.profiler.stage_ms(PREFILL_STAGE)
        started = time.perf_counter()
        [output] = drain(engine, {engine.add_request(request)})
        wall_ms = (time.perf_counter() - started) * 1e3
        return Run(output, wall_ms, (engine.cache.bookkeeping_nanoseconds - book) / 1e3,
                   engine.profiler.stage_ms(PREFILL_STAGE) - prefill)


def engine_floor(engine: Engine, request: EngineRequest) -> tuple[float, int]:
    """(ms, reused tokens): the engine call alone for the uncached suffix, on top of the cached context.

    A use_cache lease gives the same hit pages (and partial-KV snapshot, when the engine keeps them) the warm
    request got; a snapshot is restored first, untimed; only runner.forward is timed (no scheduling, sampling,
    publication or output), and nothing is published, so the cache is unchanged.
    """
    lease = engine.cache.try_acquire(Admission(request.prompt_ids, KeyExtras(cache_salt=request.cache_salt),
                                               LookupPolicy.USE_CACHE))
    assert lease is not None, "the pool is idle between requests: the floor lease must fit"
    try:
        start = lease.reuse_tokens
        if restore_slot(lease) is not None and engine.partial_store is not None:
            engine.partial_store.restore(restore_slot(lease), lease.page_ids[start // engine.cache.tokens_per_page])
            engine.cache.finish_restore(lease)
        suffix = request.prompt_ids[start:]
        step = StepInputs(engine.executor.embedding[suffix][None], np.array([len(suffix)], dtype=np.int32),
                          np.array([start], dtype=np.int32), [lease.page_ids])
        started = time.perf_counter()
        engine.backend.forward(step)
        return (time.perf_counter() - started) * 1e3, start
    finally:
        engine.cache.release(lease)


# --- the retrieval workload (document_reuse.py, document_edges.py) ---------------------------------------------

# Sixteen of each, so 16 reports state 16 different facts (issue 53's workload); the first twelve are the ones the
# earlier figures used, in the same order, so those runs reproduce.
MACHINES = ["pump", "boiler", "crane", "compressor", "generator", "turbine", "conveyor", "furnace", "mixer", "press",
            "chiller", "winch", "lathe", "forklift", "kiln", "dryer"]
SITES = ["Harbor Point", "North Ridge", "Elm Yard", "Quarry Four", "Salt Flats", "Mill Lane", "Cedar Dock",
         "Iron Gate", "Lake Shore", "Old Depot", "Fox Hill", "West Basin", "Pine Hollow", "Stone Bridge", "Red Cliff",
         "Bay Terminal"]
COLOURS = ["red", "blue", "green", "yellow", "orange", "purple", "white", "black", "grey", "brown", "pink", "gold",
           "silver", "violet", "beige", "navy"]
FILLER = ("The crew logged the readings every hour and filed them with the site office. Maintenance was on schedule "
          "and no injuries were reported. The next inspection is due at the end of the quarter. ")


@dataclass(frozen=True)
class Report:
    text: str
    question: str
    answer: str


def reports(n: int, filler: int, sentences: int | None = None) -> list[Report]:
    """N reports, each stating one fact that no other report states, then `filler` times FILLER, or (`sentences`)
    that many of FILLER's sentences in turn (finer lengths: 4 make a 67-token SmolLM2 report)."""
    out = []
    pad = FILLER * filler
    if sentences is not None:
        parts = [sentence.strip() + "." for sentence in FILLER.split(".") if sentence.strip()]
        pad = " ".join(parts[j % len(parts)] for j in range(sentences))
    for i in range(n):
        machine, site, colour = MACHINES[i % len(MACHINES)], SITES[i % len(SITES)], COLOURS[i % len(COLOURS)]
        text = (f"Report {i + 1}: the {machine} at {site} was painted {colour} last week. " + pad).strip()
        out.append(Report(text, f"What colour was the {machine} at {site} painted? Answer with one word.", colour))
    return out


def workload(docs: list[Report], requests: int, k: int | tuple[int, int],
             seed: int) -> list[tuple[list[dict[str, Any]], str]]:
    """(messages, expected answer) per request: k reports shuffled (the asked one among them; k drawn per request
    when it is a (low, high) range), a timestamped system prompt, the question."""
    rng = random.Random(seed)
    out = []
    for i in range(requests):
        shown_count = rng.randint(*k) if isinstance(k, tuple) else k
        asked = rng.randrange(len(docs))
        shown = rng.sample([j for j in range(len(docs)) if j != asked], shown_count - 1) + [asked]
        rng.shuffle(shown)
        system = (f"Current time: 2026-12-05 {10 + i // 60:02d}:{i % 60:02d}:{rng.randrange(60):02d}. "
                  "Answer from the reports only.")
        content: list[dict[str, str]] = []
        for j in shown:  # BPE merges a run of whitespace with the text around it: one newline between
            content += [{"type": "document", "text": docs[j].text}, {"type": "text", "text": "\n"}]
        content.append({"type": "text", "text": docs[asked].question})
        out.append(([{"role": "system", "content": system}, {"role": "user", "content": content}], docs[asked].answer))
    return out
