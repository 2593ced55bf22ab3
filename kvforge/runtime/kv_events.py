"""KV events in vLLM's wire format over ZMQ, so routers that index exact pages (vllm-router's kv_aware, llm-d,
Dynamo) know which pages this process holds: a `CacheEvents` listener of the context cache, never the loop.

The format is vLLM's `vllm/distributed/kv_events.py`: PUB frames [topic, 8-byte big-endian sequence, msgpack
batch], the batch `[ts, [events], data_parallel_rank]`, each event a tagged array (`["BlockStored", ...]`).
One BlockStored per run of full pages a committed record adds to the index (a page already indexed under another
record is not announced twice), one BlockRemoved per run of pages no record holds any more, AllBlocksCleared when
the publisher starts (a restarted process holds nothing its predecessor announced) and on `clear()`.

What a subscriber learns: the tokens of every cached page, and which pages belong together. Block hashes are
truncated page keys, which are salted BLAKE2b digests, so they reveal no salt; `extra_keys` carries media digests
only. The tokens are every tenant's prompts in clear: only the operator's router may subscribe
(docs/scale-out.md#kv-events).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.context_cache.protocol import CacheEvents
from kvforge.runtime.context_cache.records import Record

log = logging.getLogger(__name__)

# vLLM says "GPU" for its device pool; kvforge's pool is in host memory. Never the shared tier's name: a page there is
# every replica's, its writes land asynchronously (or are dropped) and the store evicts without telling anyone, so
# no BlockRemoved could ever match (docs/scale-out.md#kv-events).
MEDIUM_CPU = "CPU"
SCHEMES = ("tcp://", "ipc://", "inproc://")
CLOSE_TIMEOUT_S = 2.0  # queued batches still sent at close, at most this long


def _wire_types() -> tuple[type, type, type, type]:
    """vLLM's event classes (msgspec structs, array-like and tagged by class name); built on first use, so the engine
    imports msgspec only when events are asked for."""
    import msgspec

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

    return BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch


def block_hash(key: bytes) -> int:
    """A page key as vLLM's integer block hash: its first 8 bytes, 63 bits (fits a signed and an unsigned int64)."""
    return int.from_bytes(key[:8], "big") >> 1


def check_endpoint(endpoint: str) -> str:
    if not endpoint.startswith(SCHEMES) or endpoint.endswith("://"):
        raise InvalidConfig(f"expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}", "kv_events_endpoint")
    return endpoint


class KvEventPublisher:
    """A `CacheEvents` listener that announces the pages the cache indexes and drops, on a ZMQ PUB socket it binds.

    The cache calls it on the engine thread; it builds the events there (cheap: slices of the record) and a sender
    thread batches whatever is queued into one message, so a slow subscriber never stalls a step (ZMQ's high-water
    mark drops what a subscriber cannot take; the sequence numbers show the gap)."""

    def __init__(self, endpoint: str, *, tokens_per_page: int, topic: str = "",
                 lora_name: Callable[[bytes], str | None] = lambda digest: None, data_parallel_rank: int = 0) -> None:
        import zmq

        check_endpoint(endpoint)  # before any socket exists: a context with an open socket blocks at exit
        self.stored_type, self.removed_type, self.cleared_type, self.batch_type = _wire_types()
        import msgspec

        self.encoder = msgspec.msgpack.Encoder()
        self.tokens_per_page = tokens_per_page
        self.topic = topic.encode("utf-8")
        self.lora_name = lora_name
        self.rank = data_parallel_rank
        self.holders: dict[bytes, int] = {}  # page key -> records holding it (announced while > 0)
        self.sequence = 0
        self.sent_batches = 0
        self.queue: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.socket.close()
            self.context.term()
            raise InvalidConfig(f"cannot bind {endpoint}: {exc}", "kv_events_endpoint") from None
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when 0 was asked for
        self.closed = False
        self.thread = threading.Thread(target=self._send_loop, name="kvforge-kv-events", daemon=True)
        self.thread.start()
        self.clear()

    # --- CacheEvents (the cache, engine thread) ------------------------------------------------------

    def looked_up(self, keys: Sequence[bytes], hit_pages: int) -> None:
        pass  # a lookup changes nothing a router indexes

    def committed(self, record: Record) -> None:
        fresh = []
        for index, key in enumerate(self._pages(record)):
            count = self.holders.get(key, 0)
            self.holders[key] = count + 1
            if count == 0:
                fresh.append(index)
        self._emit([self._stored(record, run) for run in _runs(fresh, record, self._lora_of)])

    def evicted(self, record: Record) -> None:
        gone = []
        for key in self._pages(record):
            count = self.holders.get(key, 0) - 1
            if count > 0:
                self.holders[key] = count
            elif count == 0:
                del self.holders[key]
                gone.append(block_hash(key))
            # -1: a page held since before a clear(), never announced after it: nothing to remove
        if gone:
            self._emit([self.removed_type(block_hashes=gone, medium=MEDIUM_CPU)])

    # --- lifecycle ------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Announce that this process holds no page: at start (a consumer drops what a predecessor on this endpoint
        announced). Called later, pages already cached are announced again only when a new record stores them."""
        self.holders.clear()
        self._emit([self.cleared_type()])

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued (bounded), stop the thread, close the socket. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.queue.put(None)
        self.thread.join(timeout_s)
        self.socket.close(linger=0)
        self.context.term()

    # --- helpers --------------------------------------------------------------------------------------

    def _pages(self, record: Record) -> tuple[bytes, ...]:
        # A pure recurrent record keys its blocks but holds no page: nothing for a page index.
        return record.keys[:len(record.page_ids)]

    def _lora_of(self, record: Record, index: int) -> str | None:
        extras = record.extras
        if not extras.adapter_digest or (index + 1) * self.tokens_per_page <= extras.adapter_start:
            return None  # a base page (an activated adapter's pages before its invocation are the base model's)
        return self.lora_name(extras.adapter_digest) or extras.adapter_digest.hex()

    def _stored(self, record: Record, run: tuple[int, int, str | None]) -> Any:
        start, end, lora = run
        T = self.tokens_per_page
        extra = [_extra_keys(record, index, T) for index in range(start, end)]
        return self.stored_type(
            block_hashes=[block_hash(key) for key in record.keys[start:end]],
            parent_block_hash=block_hash(record.keys[start - 1]) if start else None,
            token_ids=list(record.token_ids[start * T:end * T]), block_size=T, lora_id=None, medium=MEDIUM_CPU,
            lora_name=lora, extra_keys=extra if any(e is not None for e in extra) else None)

    def _emit(self, events: list[Any]) -> None:
        if events and not self.closed:
            self.queue.put(events)

    def _send_loop(self) -> None:
        done = False
        while not done:
            events = self.queue.get()
            if events is None:
                break
            while True:  # everything queued meanwhile goes in the same batch
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    done = True
                    break
                events.extend(more)
            batch = self.batch_type(ts=time.time(), events=events, data_parallel_rank=self.rank)
            try:
                self.socket.send_multipart((self.topic, self.sequence.to_bytes(8, "big"), self.encoder.encode(batch)))
            except Exception as exc:  # noqa: BLE001 - a send error must not end the thread; the gap shows in seq
                log.warning("kv events: batch %d not sent: %s", self.sequence, exc)
            self.sequence += 1
            self.sent_batches += 1


def _runs(indices: list[int], record: Record,
          lora_of: Callable[[Record, int], str | None]) -> list[tuple[int, int, str | None]]:
    """Consecutive page indices with one LoRA name as [start, end) runs: one BlockStored each."""
    runs: list[tuple[int, int, str | None]] = []
    for index in indices:
        lora = lora_of(record, index)
        if runs and runs[-1][1] == index and runs[-1][2] == lora:
            runs[-1] = (runs[-1][0], index + 1, lora)
        else:
            runs.append((index, index + 1, lora))
    return runs


def _extra_keys(record: Record, index: int, tokens_per_page: int) -> tuple[Any, ...] | None:
    """One page's extra keys: the digests of the media items whose placeholder span touches it (a router hashes
    them with the tokens, as vLLM's mm hashes); None for a text page. The salt is never among them: a router cannot
    compute llm_serve's tenant salts (HMACs of the API key's tenant), so a salt in the keys would make every one of
    its lookups miss; tenants stay apart in the engine, whose page keys are salted."""
    start, end = index * tokens_per_page, (index + 1) * tokens_per_page
    media = [item.digest.hex()[:32] for item in record.extras.media if item.start < end and item.start + item.length
             > start]
    return tuple(media) or None


class CacheListeners:
    """Several `CacheEvents` listeners as one (the shared tier and the KV event publisher), called in order."""

    __slots__ = ("listeners",)

    def __init__(self, listeners: Sequence[CacheEvents]) -> None:
        self.listeners = tuple(listeners)

    def looked_up(self, keys: Sequence[bytes], hit_pages: int) -> None:
        for listener in self.listeners:
            listener.looked_up(keys, hit_pages)

    def committed(self, record: Record) -> None:
        for listener in self.listeners:
            listener.committed(record)

    def evicted(self, record: Record) -> None:
        for listener in self.listeners:
            listener.evicted(record)


def listeners(*candidates: CacheEvents | None) -> CacheEvents | None:
    """The listeners that exist, as one: None for none, the listener itself for one."""
    present = [c for c in candidates if c is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else CacheListeners(present)
