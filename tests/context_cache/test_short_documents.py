"""Short documents (issue 53 item 4): a document of at least 16 tokens is reused whatever the page size, because the
document store keeps rows, not pages; `full` repair still answers as a cold run, token for token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvforge import LLM, SamplingParams
from kvforge.builder.build import BuildOptions
from kvforge.runtime.context_cache.types.document_chunks import MIN_DOCUMENT_TOKENS
from kvforge.runtime.engine.engine import RequestOutput
from kvforge.runtime.inputs.checks import parse_messages
from kvforge.runtime.types import Request

GREEDY = SamplingParams(temperature=0, max_generate_length=6)
# 64-token pages and a token per byte (the tiny tokenizer): each report is under half a page, so before issue 53 it
# was never reused (`skipped_too_short`).
LARGE_PAGES = BuildOptions(max_input_len=256, max_kv_cache_capacity=1024, max_batch_size=4, tokens_per_page=64)
REPORTS = ["Report 1: the pump is red.", "Report 2: the gate is shut."]  # 26 and 27 tokens


@pytest.fixture(scope="module")
def large_pages(engine_dir_for: Callable[..., Path]) -> Path:
    return engine_dir_for(build=LARGE_PAGES)


def chat(system: str, reports: list[str], question: str = "Why?") -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    for report in reports:
        content += [{"type": "document", "text": report}, {"type": "text", "text": "\n"}]
    content.append({"type": "text", "text": question})
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def answer(llm: LLM, messages: list[dict[str, Any]]) -> RequestOutput:
    engine = llm.engine
    request = Request(0, parse_messages(messages, "messages"), GREEDY, apply_chat_template=False)
    request_id = engine.add_request(engine.inputs.process(request, where=""))
    final = None
    while engine.has_unfinished():
        final = next((out for out in engine.step() if out.request_id == request_id and out.finished), final)
    assert final is not None
    return final


def ask(llm: LLM) -> list[RequestOutput]:
    """The reports behind one system prompt, then in the other order behind a longer one (another page offset)."""
    return [answer(llm, chat("t=1\n", REPORTS)), answer(llm, chat("t=22, Tuesday\n", REPORTS[::-1])),
            answer(llm, chat("t=333\n", REPORTS, "And now?"))]


# kvforge.LLM gives reuse a partial-KV snapshot pool by default, whose tails a short document's publication could use;
# llm_inference and llm_serve have none unless asked: the document type keeps its producer's tail itself.
@pytest.mark.parametrize("snapshots", [{}, {"context_cache_partial_kv_snapshot_pool_bytes": 0}],
                         ids=["partial-pool", "no-partial-pool"])
def test_documents_shorter_than_a_page_are_reused(large_pages: Path, snapshots: dict[str, int]) -> None:
    assert all(MIN_DOCUMENT_TOKENS <= len(r) < LARGE_PAGES.tokens_per_page // 2 for r in REPORTS)
    llm = LLM(str(large_pages), num_threads=1, document_reuse=True, document_repair="none", **snapshots)
    assert bool(llm.engine.config.context_cache_partial_kv_snapshot_pool_bytes) == (not snapshots)
    outputs = ask(llm)
    counters = llm.context_cache_metrics()["documents"]
    assert counters["skipped_too_short"] == 0 and counters["documents_produced"] == 2
    assert counters["document_hits"] == 6 and counters["reused_tokens"] == 3 * sum(map(len, REPORTS))
    # Stored before the second and third requests arrived: every report token is cached there.
    assert [out.cached_tokens for out in outputs[1:]] == [sum(map(len, REPORTS))] * 2


def test_full_repair_of_short_documents_answers_as_cold(large_pages: Path) -> None:
    cold = [out.token_ids for out in ask(LLM(str(large_pages), num_threads=1))]
    full = LLM(str(large_pages), num_threads=1, document_reuse=True, document_repair="full")
    assert [out.token_ids for out in ask(full)] == cold
    counters = full.context_cache_metrics()["documents"]
    assert counters["document_hits"] == 6 and counters["repaired_tokens"] == 3 * sum(map(len, REPORTS))


def test_restored_short_documents_hold_the_rows_a_standalone_prefill_computed(large_pages: Path) -> None:
    """`none` changes only the context the documents saw: a prompt that starts with a report has its K/V restored
    where it was computed (position 0), so with nothing before it the answer is cold's."""
    alone = [{"role": "user", "content": [{"type": "document", "text": REPORTS[0]},
                                          {"type": "text", "text": "\nWhy?"}]}]
    cold = answer(LLM(str(large_pages), num_threads=1), alone).token_ids
    llm = LLM(str(large_pages), num_threads=1, document_reuse=True, document_repair="none")
    answer(llm, chat("t=1\n", REPORTS[:1]))  # stores the report
    assert answer(llm, alone).token_ids == cold


def test_documents_under_the_minimum_are_still_computed(large_pages: Path) -> None:
    llm = LLM(str(large_pages), num_threads=1, document_reuse=True, document_repair="none")
    tiny = "x" * (MIN_DOCUMENT_TOKENS - 1)
    for system in ("t=1\n", "t=22\n"):
        answer(llm, chat(system, [tiny]))
    counters = llm.context_cache_metrics()["documents"]
    assert counters["skipped_too_short"] == 2 and counters["document_hits"] == 0
