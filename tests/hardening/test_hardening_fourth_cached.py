"""The fourth hostile pass, issue 52 item 3: `cached_tokens` counts only prompt tokens whose K/V existed before the
request arrived. Documents its own standalone prefills produced are not cached, in the engine's outputs, kvforge.LLM,
llm_serve's usage and /metrics, and the profile; and choices 2..n of one call do not count the first's prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.engine_driver import document_prompt
from support.server_harness import MODEL, LiveServer, build_server_engine, live_server

from kvforge import LLM
from kvforge.runtime.engine.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from kvforge.runtime.types import SamplingParams

T = 16  # the tiny engine's page
GREEDY = SamplingParams(temperature=0, max_generate_length=4)
DOC_A, DOC_B = list(range(40, 60)), list(range(70, 88))
REPORTS = ["Pump 3 stopped at noon after the seal failed; the crew replaced it.",
           "The north gate stays closed on Sundays because the guard is off duty."]


def prompt(system: list[int], docs: list[list[int]], question: list[int]) -> EngineRequest:
    return document_prompt(system, docs, question, GREEDY)


def drain(engine: Engine, ids: list[str]) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert set(finals) == set(ids)
    return finals


@pytest.mark.parametrize("repair", ["none", "full"])
def test_a_requests_own_documents_are_not_cached(tiny_engine_dir: Path, repair: str) -> None:
    engine = Engine(tiny_engine_dir, EngineConfig(num_threads=1, document_reuse=True, document_repair=repair))
    [first] = drain(engine, [engine.add_request(prompt([1, 2, 3], [DOC_A, DOC_B], [9, 10]))]).values()
    assert first.cached_tokens == 0  # before: 38 (both documents, produced for this very request)
    assert engine.profile()["prefill"]["reused_tokens"] == 0
    assert engine.profile()["context_cache"]["documents"]["documents_produced"] == 2  # they were restored, though
    [second] = drain(engine, [engine.add_request(prompt([4, 5], [DOC_B, DOC_A], [11]))]).values()
    expected = 0 if repair == "full" else len(DOC_A) + len(DOC_B)  # full recomputes every document token
    assert second.cached_tokens == expected and engine.profile()["prefill"]["reused_tokens"] == expected


def test_requests_arriving_together_do_not_count_each_others_new_documents(tiny_engine_dir: Path) -> None:
    """The second request's documents are produced by standalone prefills the first queued, after the second
    arrived: their K/V did not exist when it arrived, so neither counts them."""
    engine = Engine(tiny_engine_dir, EngineConfig(num_threads=1, document_reuse=True, document_repair="none"))
    ids = [engine.add_request(prompt(system, [DOC_A, DOC_B], [9])) for system in ([1, 2], [3, 4, 5])]
    assert [output.cached_tokens for output in drain(engine, ids).values()] == [0, 0]


@pytest.fixture(scope="module")
def chat_engine(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Roomy enough for a chat template and two reports (a token per byte)."""
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("cached_engine"))


def test_kvforge_llm_reports_the_same(chat_engine: Path) -> None:
    llm = LLM(chat_engine, document_reuse=True, document_repair="none", num_threads=1)

    def ask(system: str, reports: list[str]) -> int:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": [*({"type": "document", "text": r} for r in reports),
                                                 {"type": "text", "text": "Which pump?"}]}]
        return llm.chat([messages], GREEDY)[0].cached_tokens

    assert ask("It is 10:00.", REPORTS) == 0
    assert ask("It is 10:05.", REPORTS[::-1]) >= sum(len(r.encode()) for r in REPORTS) - 2  # byte tokens
    llm.close()


@pytest.fixture(scope="module")
def server(chat_engine: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(chat_engine, tmp_path_factory.mktemp("cached"), document_reuse=True,
                     document_repair="none") as live:
        yield live


def body(system: str, reports: list[str], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 3, "temperature": 0, **extra,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": [*({"type": "document", "text": r} for r in reports),
                                                      {"type": "text", "text": "Which pump?"}]}]}


def hits(server: LiveServer) -> tuple[float, float]:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    values = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples}
    return values["kvforge_prefix_cache_hits_tokens_total"], values["kvforge_prefill_reused_tokens_total"]


def test_llm_serve_usage_and_metrics_count_what_existed_before(server: LiveServer) -> None:
    status, first = server.request("POST", "/v1/chat/completions", body("It is 10:00.", REPORTS))
    assert status == 200, first
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hits(server) == (0, 0)
    status, second = server.request("POST", "/v1/chat/completions", body("It is 10:05.", REPORTS[::-1]))
    assert status == 200, second
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= sum(len(r.encode()) for r in REPORTS) - 2
    assert hits(server)[0] == cached
    # n choices: the second and third read the prompt the first computed for this same call.
    status, third = server.request("POST", "/v1/chat/completions", body("It is 11:00.", ["A fresh report. " * 3],
                                                                          n=3))
    assert status == 200, third
    assert hits(server)[0] == cached + third["usage"]["prompt_tokens_details"]["cached_tokens"]
