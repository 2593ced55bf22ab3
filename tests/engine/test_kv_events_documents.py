"""What KV events announce for documents (issue 53 item 6; docs/scale-out.md#documents-behind-a-router): a
document's standalone prefill is announced as a chain of its own that starts at the document (no parent), and a
request that restores it announces nothing from its first restored document on, so a prefix router never matches a
document inside a prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine_driver import make_engine

pytest.importorskip("msgspec", reason="KV events need msgspec: pip install 'kvforge[cluster]'")
pytest.importorskip("zmq", reason="KV events need pyzmq: pip install 'kvforge[cluster]'")

from test_kv_events import BlockStored, Subscriber  # noqa: E402

from kvforge.runtime.engine.engine import Engine, EngineRequest  # noqa: E402
from kvforge.runtime.media_spans import DocumentSpan  # noqa: E402
from kvforge.runtime.types import SamplingParams  # noqa: E402

T = 16
DOCUMENT = list(range(40, 40 + 2 * T + 5))  # two full pages and a tail


def serve(engine: Engine, system: list[int]) -> None:
    ids = [*system, *DOCUMENT, 9, 10]
    engine.add_request(EngineRequest(ids, SamplingParams(temperature=0, max_generate_length=2),
                                     documents=(DocumentSpan(len(system), len(DOCUMENT)),)))
    while engine.has_unfinished():
        engine.step()


class _Adapter:
    """Subscriber.join clears through `llm.engine.kv_events`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine


def test_documents_are_announced_only_as_their_own_root_chain(tiny_engine_dir: Path) -> None:
    engine = make_engine(tiny_engine_dir, reuse=True, document_reuse=True, document_repair="none",
                         kv_events_endpoint="tcp://127.0.0.1:0")
    subscriber = Subscriber(engine.kv_events.endpoint)
    try:
        subscriber.join(_Adapter(engine))
        serve(engine, [1, 2, 3])  # the system prompt is shorter than a page: no exact prefix page before the document
        serve(engine, [4, 5, 6, 7, 8])  # another prompt restores the stored document
        stored = [e for e in subscriber.events() if isinstance(e, BlockStored)]
        assert engine.profile()["context_cache"]["documents"]["document_hits"] >= 2
        # One announcement, the standalone prefill's: the document's full pages from its first token, no parent.
        [event] = stored
        assert event.parent_block_hash is None and event.token_ids == DOCUMENT[:2 * T]
    finally:
        subscriber.close()
        engine.close()
