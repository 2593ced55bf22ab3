"""llm_serve with document reuse (issue 37): a chat completion's document parts are restored when they come back
behind another system prompt and in another order, counted in `prompt_tokens_details.cached_tokens` and /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.server_harness import MODEL, LiveServer, build_server_engine, live_server

REPORTS = ["Pump 3 stopped at noon after the seal failed; the crew replaced it.",
           "The north gate stays closed on Sundays because the guard is off duty."]


@pytest.fixture(scope="module")
def server(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine_dir = build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("documents_engine"))
    with live_server(engine_dir, tmp_path_factory.mktemp("documents"), document_reuse=True,
                     document_repair="none") as live:
        yield live


def body(system: str, reports: list[str]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": [*({"type": "document", "text": r} for r in reports),
                                                      {"type": "text", "text": "Which pump?"}]}]}


def metrics(server: LiveServer) -> dict[str, float]:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples}


def test_documents_are_reused_behind_another_system_prompt(server: LiveServer) -> None:
    status, first = server.request("POST", "/v1/chat/completions", body("It is 10:00.", REPORTS))
    assert status == 200, first
    status, second = server.request("POST", "/v1/chat/completions", body("It is 10:05.", REPORTS[::-1]))
    assert status == 200, second
    documents_tokens = sum(len(report.encode()) for report in REPORTS)  # the tiny tokenizer: a token per byte
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= documents_tokens
    values = metrics(server)
    assert values["kvforge_documents_document_hits_total"] >= 4
    assert values["kvforge_documents_reused_tokens_total"] >= 2 * documents_tokens
