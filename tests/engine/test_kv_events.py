"""KV events (issue 54 item 2): kvforge.LLM(kv_events_endpoint=...) publishes, on 127.0.0.1, what vLLM's
`vllm/distributed/kv_events.py` publishes, decoded here with msgspec against vLLM's own class definitions (written
out below from that file; the events are tagged maps as there, the batch the array `[ts, events, dp_rank]` that
vLLM's subscriber example, Dynamo and vllm-router decode). tests/server/test_server_kv_router.py runs a real
consumer, vllm-router's kv_aware policy, against llm_serve.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec", reason="KV events need msgspec: pip install 'kvforge[cluster]'")
zmq = pytest.importorskip("zmq", reason="KV events need pyzmq: pip install 'kvforge[cluster]'")

from kvforge import LLM, SamplingParams  # noqa: E402
from kvforge.contract.errors import InvalidConfig  # noqa: E402
from kvforge.runtime.kv_events import block_hash  # noqa: E402

T = 16  # the tiny engine's tokens per page


# --- vLLM's definitions (vllm/distributed/kv_events.py), ExternalBlockHash as int ---------------------------------

class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        # Linger 0: a subscriber that is garbage-collected unclosed (a failed fixture) must not block its context's
        # term() forever on a subscription message to a publisher that has gone (it hung an xdist worker once).
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.frames: list[list[bytes]] = []

    def join(self, llm: LLM) -> None:
        """Wait out ZMQ's slow joiner: announce a clear until one arrives (the subscription has reached the PUB)."""
        deadline = time.monotonic() + 10
        while True:
            llm.engine.kv_events.clear()
            if self.socket.poll(200):
                [cleared] = DECODER.decode(self.socket.recv_multipart()[2]).events
                assert isinstance(cleared, AllBlocksCleared)
                while self.socket.poll(100):  # earlier clears that were on their way
                    self.socket.recv_multipart()
                return
            assert time.monotonic() < deadline, "the subscriber never received a batch"

    def events(self, settle_ms: int = 300) -> list[Any]:
        out = []
        while self.socket.poll(settle_ms):
            frames = self.socket.recv_multipart()
            self.frames.append(frames)
            out.extend(DECODER.decode(frames[2]).events)
        return out

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def llm(tiny_engine_dir: Path) -> Any:
    with LLM(tiny_engine_dir, num_threads=1, kv_events_endpoint="tcp://127.0.0.1:0", kv_events_topic="kv",
             context_cache_max_records=2) as engine:
        yield engine


@pytest.fixture
def subscriber(llm: LLM) -> Any:
    sub = Subscriber(llm.engine.kv_events.endpoint, b"kv")
    try:
        sub.join(llm)
        yield sub
    finally:
        sub.close()


def run(llm: LLM, prompt: list[int], salt: str | None = None) -> list[int]:
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_generate_length=2), cache_salt=salt)
    return prompt + list(out.token_ids)


def stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def test_stored_pages_carry_their_tokens_and_chain(llm: LLM, subscriber: Subscriber) -> None:
    shared = [(7 * i) % 200 + 10 for i in range(3 * T)]
    first = run(llm, shared + [1, 2, 3, 4])
    [event] = stored(subscriber.events())
    pages = len(event.block_hashes)
    assert pages >= 3 and event.token_ids == first[:pages * T] and event.block_size == T
    assert event.parent_block_hash is None and event.medium == "CPU" and event.lora_name is None
    assert event.extra_keys is None  # a text page: no media; the salt is never sent
    keys = [r.keys for r in llm.engine.cache.records.least_recent_first()][0]
    assert event.block_hashes == [block_hash(k) for k in keys[:pages]]

    run(llm, shared + [9] * T)  # diverges after 3 shared pages
    [second] = stored(subscriber.events())
    # Only the page after the shared ones is new, chained to the last shared page.
    assert second.parent_block_hash == event.block_hashes[2]
    assert second.token_ids[:T] == [9] * T and len(second.block_hashes) >= 1
    topics, seqs = zip(*[(f[0], int.from_bytes(f[1], "big")) for f in subscriber.frames], strict=True)
    assert set(topics) == {b"kv"} and list(seqs) == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_the_announced_pages_are_exactly_the_cached_ones(llm: LLM, subscriber: Subscriber) -> None:
    """Stored minus removed equals the pages the cache's records hold, after every request, while
    context_cache_max_records=2 evicts records (and with them pages no other record holds)."""
    held: set[int] = set()
    removals = 0
    for base in (20, 60, 100, 20, 140):
        run(llm, [base + i for i in range(2 * T + 3)])
        for event in subscriber.events():
            if isinstance(event, BlockStored):
                assert held.isdisjoint(event.block_hashes)  # a page is announced once while held
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert event.medium == "CPU" and set(event.block_hashes) <= held
                held.difference_update(event.block_hashes)
                removals += 1
        cached = {block_hash(k) for r in llm.engine.cache.records.least_recent_first()
                  for k in r.keys[:len(r.page_ids)]}
        assert held == cached
    assert removals >= 2


def test_salted_pages_are_other_blocks_and_the_salt_is_never_sent(llm: LLM, subscriber: Subscriber) -> None:
    prompt = [(3 * i) % 150 + 30 for i in range(2 * T + 1)]
    run(llm, prompt, salt="tenant-secret-123")
    run(llm, prompt, salt=None)
    salted, plain = stored(subscriber.events())
    assert salted.token_ids == plain.token_ids  # the same tokens ...
    assert set(salted.block_hashes).isdisjoint(plain.block_hashes)  # ... under another salt are other pages
    assert all(b"tenant-secret" not in frame for frames in subscriber.frames for frame in frames)


def test_a_bad_endpoint_names_the_field(tiny_engine_dir: Path) -> None:
    with pytest.raises(InvalidConfig, match="tcp://HOST:PORT") as info:
        LLM(tiny_engine_dir, num_threads=1, kv_events_endpoint="127.0.0.1:5557")
    assert info.value.field == "kv_events_endpoint"
