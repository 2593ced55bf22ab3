"""Documents across processes (issue 37): a second engine on the same shared tier reuses the documents a first one
computed. A document's standalone prefill is an ordinary prompt from position 0, so its full pages are tier pages: the
second engine's standalone prefills load them, and its requests restore the documents from there."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine_driver import make_engine
from support.memory_store import MemoryStore

from kvforge.runtime.engine import engine as engine_module
from kvforge.runtime.engine.engine import Engine, EngineRequest
from kvforge.runtime.media_spans import DocumentSpan
from kvforge.runtime.types import SamplingParams

URL = "redis://in-process"  # a real scheme (checked before loading); open_store is patched to the memory store
DOCUMENTS = [list(range(40, 60)), list(range(70, 92))]  # 20 and 22 tokens: a full page each, and a tail


def request(system: list[int], order: list[int]) -> EngineRequest:
    ids, spans = list(system), []
    for i in order:
        spans.append(DocumentSpan(len(ids), len(DOCUMENTS[i])))
        ids += DOCUMENTS[i]
    return EngineRequest([*ids, 9, 10], SamplingParams(temperature=0, max_generate_length=3), documents=tuple(spans))


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    shared = MemoryStore()
    monkeypatch.setattr(engine_module, "open_store", lambda url, timeout_s: shared)
    return shared


def run(engine: Engine, req: EngineRequest) -> int:
    """The request's cached tokens."""
    request_id = engine.add_request(req)
    cached = -1
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id == request_id
            cached = output.cached_tokens
        engine.cache.check_invariants()
    return cached


def test_a_second_engine_reuses_the_documents_the_first_computed(tiny_engine_dir: Path, store: MemoryStore) -> None:
    first = make_engine(tiny_engine_dir, shared_cache=URL, document_reuse=True, document_repair="none")
    run(first, request([1, 2, 3], [0, 1]))
    first.close()  # flushes the writes
    second = make_engine(tiny_engine_dir, shared_cache=URL, document_reuse=True, document_repair="none")
    prompt = request([4, 5, 6, 7, 8], [1, 0])
    # Cached: what existed before the request arrived, the documents' full pages in the tier; their tails were
    # computed for it by its standalone prefills (issue 52 item 3).
    assert run(second, prompt) == 2 * 16
    tier = second.profile()["context_cache"]["shared_tier"]
    # The full pages of both documents came over; only their tails were computed again.
    assert tier["loaded_tokens"] == 2 * 16 and tier["corrupt"] == 0
    assert second.profile()["context_cache"]["documents"]["documents_produced"] == 2
    second.close()
