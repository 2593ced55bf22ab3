"""The shared tier below the in-process pool: loads a new sequence's missing pages before it computes, saves
committed records after, and never lets a slow, dead, full or corrupt store fail or stall a request.

It is the scheduler's `ExternalLoader` and the cache's `CacheEvents` listener, so it hooks the cache's events and
the WAITING_FOR_REMOTE state, never the loop. Store I/O runs on daemon threads (two load, one writes) so the
engine thread only ever copies bytes between the pool and decoded values; the engine thread also owns every
deadline: a load whose store call runs past `timeout_s` is abandoned (the request computes what it lacks) and the
store is left alone for a back-off, during which lookups are skipped and writes dropped.

What is stored, under the in-process cache's own content-addressed keys (so adapter, salt and media identity carry
over) rooted in the engine fingerprint (so another engine never finds them):

    b"p" + page key           one full KV page of every attention layer (attention-only and hybrid engines)
    b"c" + terminal key       a recurrent checkpoint after exactly L tokens: every recurrent state array, and the
                              K/V of its partial tail page when L is not page-aligned (hybrid, pure recurrent)
    b"n" + anchor + slot i    directory entries (i < DIRECTORY_SLOTS): the lengths of checkpoints whose last full
                              page is `anchor` (the chain root below one page), so a lookup learns which lengths to
                              ask for without hashing every position

A checkpoint's full pages are ordinary page values. A hybrid lookup reads the directory entries of the input's own
pages (one batched get), tries the longest listed length its local hit does not already cover, and loads the
checkpoint value and the pages between the local hit and it; pages alone are worthless to a recurrent model, so a
checkpoint load is all or nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvforge.runtime.context_cache.keys import tail_page_key
from kvforge.runtime.context_cache.records import Record
from kvforge.runtime.execution.backend import KVStorage
from kvforge.runtime.execution.recurrent_state import RecurrentStates
from kvforge.runtime.execution.snapshots import PartialKVSnapshotStore, RecurrentSnapshotStore
from kvforge.runtime.sequence import Sequence
from kvforge.runtime.shared_tier.store import SharedStore, StoreError
from kvforge.runtime.shared_tier.values import Decoded, ValueKind, ValueRejected, decode, encode

PAGE_PREFIX, CHECKPOINT_PREFIX, DIRECTORY_PREFIX = b"p", b"c", b"n"
DIRECTORY_SLOTS = 8  # checkpoint lengths listed per anchor page; more are still stored, only not found
BATCH_BYTES = 8 << 20  # a get or put batch stays near this size, so one call fits the timeout on a LAN
MAX_PENDING_WRITE_BYTES = 256 << 20  # writes queued past this are dropped (counted): the tier never holds the pool
KNOWN_KEYS = 1 << 16  # keys this process knows the store has (written or loaded): not written again
BACKOFF_S = (1.0, 30.0)  # after an error or timeout: skip the store this long, doubling up to the second value
FLUSH_TIMEOUT_S = 10.0
AT_EXIT_FLUSH_S = 3.0  # an interpreter exiting without close(): a short, bounded flush
LOAD_THREADS = 2  # loads of different requests overlap; one hung call does not hold every load up

TIER_KEYS = ("lookups", "hits", "loaded_tokens", "load_ms", "writes", "write_bytes", "errors", "timeouts",
             "corrupt", "skipped_lookups", "dropped_writes")


@dataclass(slots=True)
class TierCounters:
    """The profile's `context_cache.shared_tier` block (TIER_KEYS) and llm_serve's `/metrics` series."""

    lookups: int = 0  # admissions that asked the store
    hits: int = 0  # of them, the ones that loaded something
    loaded_tokens: int = 0
    load_ms: float = 0.0  # from the lookup to the last copy, summed over lookups
    writes: int = 0  # values written
    write_bytes: int = 0
    errors: int = 0  # store calls that failed
    timeouts: int = 0  # loads abandoned at the deadline
    corrupt: int = 0  # values rejected: checksum, another engine's root, other tokens or shapes
    skipped_lookups: int = 0  # admissions that did not ask: back-off after a fault, or a request the tier bypasses
    dropped_writes: int = 0  # records not saved: back-off, or the write queue was full

    def to_dict(self) -> dict[str, int | float]:
        return {key: round(getattr(self, key), 3) if key == "load_ms" else getattr(self, key) for key in TIER_KEYS}


@dataclass(slots=True)
class _Load:
    """One sequence's load: the worker fills `ready`, the engine thread copies from it and decides when it ends."""

    seq: Sequence
    started: float
    reuse: int  # tokens the sequence had before the load (its local hit)
    checkpoint: bool
    ready: list[tuple[int, Decoded]] = field(default_factory=list)  # (page index, value); -1 = the checkpoint
    loaded_tokens: int = 0  # a checkpoint load's length once it is complete
    done: bool = False
    abandoned: bool = False
    call_started: float | None = None  # monotonic start of the store call running now (None between calls)
    copied_pages: int = 0


@dataclass(slots=True)
class _Write:
    items: list[tuple[bytes, bytes | Callable[[], bytes]]]  # (store key, value or how to encode it off-thread)
    nbytes: int
    directory: tuple[bytes, int] | None = None  # (anchor, length): list a checkpoint once its value is stored


class SharedTier:
    """`ExternalLoader` + `CacheEvents` over one `SharedStore`. Built by the engine when `--sharedCache` is set."""

    def __init__(self, store: SharedStore, *, root: bytes, tokens_per_page: int, kv: KVStorage | None,
                 states: RecurrentStates | None, state_rows: dict, partial: PartialKVSnapshotStore | None,
                 recurrent: RecurrentSnapshotStore | None, timeout_s: float) -> None:
        """`kv`: the pool (None on a pure recurrent engine); `states`/`state_rows`: running sequences' recurrent
        rows by lease (checkpoint engines); `partial`/`recurrent`: the snapshot stores a committed checkpoint's
        bytes are read from."""
        self.store = store
        self.root = root
        self.tokens_per_page = tokens_per_page
        self.kv = kv
        self.states = states
        self.state_rows = state_rows
        self.partial = partial
        self.recurrent = recurrent
        self.timeout_s = timeout_s
        self.checkpoints = states is not None
        self.counters = TierCounters()
        self._lock = threading.Lock()  # the counters the workers bump, the known keys, the back-off
        self._progress = threading.Condition(self._lock)
        self._loads: dict[int, _Load] = {}  # by id(seq)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._down_until = 0.0
        self._backoff = BACKOFF_S[0]
        self._pending_bytes = 0
        self._load_jobs: queue.Queue[_Load | None] = queue.Queue()
        self._write_jobs: queue.Queue[_Write | None] = queue.Queue()
        self._closed = False
        self._connected = threading.Event()
        self._first_attempt = threading.Event()
        self._threads = [threading.Thread(target=self._connect, name="kvforge-tier-connect", daemon=True)]
        self._threads += [threading.Thread(target=self._load_worker, name=f"kvforge-tier-load-{i}", daemon=True)
                         for i in range(LOAD_THREADS)]
        self._threads.append(threading.Thread(target=self._write_worker, name="kvforge-tier-write", daemon=True))
        for thread in self._threads:
            thread.start()
        # A script that never calls close() still saves what it committed last (the threads are daemons).
        atexit.register(_close_at_exit, weakref.ref(self))

    # --- ExternalLoader (the scheduler, engine thread) -----------------------------------------------

    def start(self, seq: Sequence) -> bool:
        """Begin loading what the local hit lacks, if the store may have it. True: the sequence waits for `poll`."""
        lease = seq.lease
        if lease is None or not lease.may_publish or lease.forced_cold:
            return False  # bypass lookups, and runs retried cold, never look anywhere
        if seq.drafts_with_kv:  # a draft-pool row (EAGLE3, DFlash, DSpark) needs draft K/V too: the tier has none
            self._count(skipped_lookups=1)
            return False
        T, prompt = self.tokens_per_page, seq.prompt_ids
        reuse = seq.num_computed_tokens
        if self.checkpoints:
            if reuse >= len(prompt) - 1:
                return False
        elif reuse % T or reuse // T >= (len(prompt) - 1) // T:
            return False  # mid-page (a snapshot tail) or nothing left a page could cover
        if not self._connected.is_set() or time.monotonic() < self._down_until:
            self._count(skipped_lookups=1)  # not connected yet, or backing off after a fault: compute
            return False
        load = _Load(seq, time.perf_counter(), reuse, self.checkpoints)
        self._loads[id(seq)] = load
        self._count(lookups=1)
        self._load_jobs.put(load)
        return True

    def poll(self, seq: Sequence) -> int | None:
        """None while the load runs; else the tokens now in the sequence's pages (and state) past its reuse point."""
        load = self._loads.get(id(seq))
        if load is None:
            return 0
        with self._lock:
            ready, load.ready = load.ready, []
            done, call_started = load.done, load.call_started
        loaded = self._copy(load, ready)
        if not done:
            now = time.monotonic()
            stuck = call_started is not None and now - call_started > self.timeout_s
            # A load still queued behind another's hung call gives up once that call has tripped the back-off.
            if not stuck and not (call_started is None and now < self._down_until):
                return None
            load.abandoned = True
            if stuck:
                self._fault(timeout=True)
        del self._loads[id(seq)]
        loaded = loaded if done else (0 if load.checkpoint else load.copied_pages * self.tokens_per_page)
        self._count(hits=int(loaded > 0), loaded_tokens=loaded, load_ms=(time.perf_counter() - load.started) * 1e3)
        return loaded

    def cancel(self, seq: Sequence) -> None:
        """The sequence ended while loading (aborted): its pages are going back, so nothing may be copied in."""
        load = self._loads.pop(id(seq), None)
        if load is not None:
            load.abandoned = True

    def wait(self, timeout_s: float) -> None:
        """Block the engine thread up to `timeout_s` for load progress (it has no row to run meanwhile)."""
        with self._progress:
            if not any(load.ready or load.done for load in self._loads.values()):
                self._progress.wait(timeout_s)

    def _copy(self, load: _Load, ready: list[tuple[int, Decoded]]) -> int:
        """Copy decoded values into the sequence's pages and state; a complete checkpoint load's token count."""
        lease = load.seq.lease
        assert lease is not None
        T = self.tokens_per_page
        for page, value in ready:
            if page >= 0:
                assert self.kv is not None
                self.kv.write_page(lease.page_ids[page], value.arrays)
                load.copied_pages += 1
                continue
            # The endpoint: its state arrays (checkpoint engines), then its tail page (when not page-aligned).
            length = int(value.tokens.size)
            num_states = 0
            if self.states is not None:
                num_states = len(self.states.arrays)
                self.states.write(self.state_rows[lease], value.arrays[:num_states])
            if length % T and self.kv is not None:  # a pure recurrent checkpoint has no tail page
                self.kv.write_page(lease.page_ids[length // T], value.arrays[num_states:])
            load.loaded_tokens = length - load.reuse
        if load.checkpoint or load.loaded_tokens:
            return load.loaded_tokens
        return load.copied_pages * T

    # --- CacheEvents (the cache, engine thread) ------------------------------------------------------

    def looked_up(self, keys: Any, hit_pages: int) -> None:
        pass  # the load starts once the sequence holds its pages (`start`), not at the lookup

    def evicted(self, record: Record) -> None:
        pass  # write-through: committed records were saved already

    def committed(self, record: Record) -> None:
        """Save a new record's pages (and checkpoint) the store does not have yet; the bytes are copied now, because
        the pages may be reused once the record is evicted, and encoded and written on the write thread."""
        if time.monotonic() < self._down_until or self._closed:
            self._count(dropped_writes=1)
            return
        T, tokens = self.tokens_per_page, np.asarray(record.token_ids, dtype=np.int32)
        items: list[tuple[bytes, bytes | Callable[[], bytes]]] = []
        nbytes = 0
        for index, (key, page) in enumerate(zip(record.keys, record.page_ids, strict=False)):
            if self._is_known(PAGE_PREFIX + key):
                continue
            assert self.kv is not None
            arrays = [np.array(rows) for rows in self.kv.read_page(page)]  # copies
            items.append((PAGE_PREFIX + key, _encoder(ValueKind.PAGE, self.root, key,
                                                      tokens[index * T:(index + 1) * T], arrays)))
            nbytes += sum(a.nbytes for a in arrays)
        directory = None
        endpoint = record.is_checkpoint or record.partial_slot is not None  # a state or a tail page to save
        if endpoint and not self._is_known(CHECKPOINT_PREFIX + record.terminal_key):
            arrays = []
            if record.is_checkpoint:
                assert self.recurrent is not None and record.recurrent_slot is not None
                arrays = [np.array(array[record.recurrent_slot]) for array in self.recurrent.arrays]
            if record.partial_slot is not None:
                assert self.partial is not None
                arrays += [np.array(layer[record.partial_slot]) for layer in self.partial.layers]
            items.append((CHECKPOINT_PREFIX + record.terminal_key,
                          _encoder(ValueKind.CHECKPOINT, self.root, record.terminal_key, tokens, arrays)))
            nbytes += sum(a.nbytes for a in arrays)
            directory = (record.parent_key or self.root, len(tokens))
        if not items:
            return
        with self._lock:
            if self._pending_bytes + nbytes > MAX_PENDING_WRITE_BYTES:
                self.counters.dropped_writes += 1
                return
            self._pending_bytes += nbytes
        self._write_jobs.put(_Write(items, nbytes, directory))

    # --- lifecycle ------------------------------------------------------------------------------------

    def wait_connected(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for the first connection attempt to end (the engine waits at start-up, so the
        first requests can use the tier); True if it connected. A store that is down only makes requests cold."""
        self._first_attempt.wait(timeout_s)
        return self._connected.is_set()

    def _connect(self) -> None:
        while not self._closed:
            try:
                self.store.connect()
            except Exception:  # counted; tried again after the back-off, which doubles
                self._fault(timeout=False)
                self._first_attempt.set()
                time.sleep(max(self._down_until - time.monotonic(), 0.05))
                continue
            self._connected.set()
            self._first_attempt.set()
            return

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until the queued writes are in the store (or dropped); False if they are still going at the end."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._connected.is_set():
                return False  # nothing can be written before the store answers once: do not wait for it
            with self._lock:
                if self._pending_bytes == 0 and self._write_jobs.empty():
                    return True
            time.sleep(0.005)
        return False

    def close(self, flush_timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Flush the writes (bounded), stop both threads, close the store. Idempotent."""
        if self._closed:
            return
        self.flush(flush_timeout_s)
        self._closed = True
        for _ in range(LOAD_THREADS):
            self._load_jobs.put(None)
        self._write_jobs.put(None)
        for thread in self._threads[1:]:  # the connect thread may sit in a slow setup: it is a daemon
            thread.join(timeout=1.0)
        with contextlib.suppress(Exception):  # closing a broken connection must not fail the caller's shutdown
            self.store.close()

    def profile(self) -> dict[str, int | float]:
        with self._lock:
            return self.counters.to_dict()

    # --- workers ---------------------------------------------------------------------------------------

    def _load_worker(self) -> None:
        while (load := self._load_jobs.get()) is not None:
            try:
                if load.checkpoint:
                    self._load_checkpoint(load)
                else:
                    self._load_pages(load)
            except (StoreError, ValueRejected, _Abandoned) as exc:
                if isinstance(exc, StoreError):
                    self._fault(timeout=False)
            except Exception:  # a bug must not kill the thread that every later load needs
                self._fault(timeout=False)
            finally:
                with self._progress:
                    load.done, load.call_started = True, None
                    self._progress.notify_all()

    def _call(self, load: _Load | None, method: Callable[..., Any], *args: Any) -> Any:
        if load is not None:
            if load.abandoned:
                raise _Abandoned
            load.call_started = time.monotonic()
        try:
            return method(*args)
        finally:
            if load is not None:
                load.call_started = None

    def _publish_ready(self, load: _Load, ready: list[tuple[int, Decoded]]) -> None:
        with self._progress:
            load.ready.extend(ready)
            self._progress.notify_all()

    def _load_pages(self, load: _Load) -> None:
        seq, T = load.seq, self.tokens_per_page
        lease = seq.lease
        assert lease is not None and self.kv is not None
        first, last = load.reuse // T, (len(seq.prompt_ids) - 1) // T
        keys = [PAGE_PREFIX + key for key in lease.keys[first:last]]
        present = self._call(load, self.store.exists, keys)
        count = next((i for i, there in enumerate(present) if not there), len(keys))
        like = self.kv.read_page(0)
        per_batch = max(1, BATCH_BYTES // max(1, sum(a.nbytes for a in like)))
        prompt = np.asarray(seq.prompt_ids, dtype=np.int32)
        for begin in range(0, count, per_batch):
            batch = keys[begin:min(begin + per_batch, count)]
            values = self._call(load, self.store.get, batch)
            ready = []
            for offset, value in enumerate(values):
                page = first + begin + offset
                if value is None:
                    break
                try:
                    ready.append((page, decode(value, root=self.root, key=batch[offset][1:], kind=ValueKind.PAGE,
                                               like=like, tokens=prompt[page * T:(page + 1) * T])))
                except ValueRejected:
                    self._count(corrupt=1)
                    break
            self._publish_ready(load, ready)
            if len(ready) < len(batch):
                return
            self._remember(batch)
        self._load_tail(load, first + count, prompt, like)

    def _load_tail(self, load: _Load, depth: int, prompt: np.ndarray, like: list[np.ndarray]) -> None:
        """After the full pages: a partial-KV tail the store lists past them (a record not ending on a page)."""
        lease, T = load.seq.lease, self.tokens_per_page
        assert lease is not None
        if depth * T >= len(prompt) - 1:
            return
        anchor = lease.keys[depth - 1] if depth else self.root
        for length in self._listed_lengths(load, [anchor], load.seq, lambda n: n // T == depth):
            terminal = tail_page_key(anchor, prompt[:length], depth * T, lease.extras)
            [value] = self._call(load, self.store.get, [CHECKPOINT_PREFIX + terminal])
            if value is None:
                continue
            try:
                tail = decode(value, root=self.root, key=terminal, kind=ValueKind.CHECKPOINT, like=like,
                              tokens=prompt[:length])
            except ValueRejected:
                self._count(corrupt=1)
                continue
            self._publish_ready(load, [(-1, tail)])
            return

    def _listed_lengths(self, load: _Load, anchors: list[bytes], seq: Sequence,
                        accept: Callable[[int], bool] = lambda n: True) -> list[int]:
        """The endpoint lengths the directory lists under `anchors` that this sequence could resume from (past its
        local hit, short of its prompt, not inside a media span), longest first."""
        slots = [(anchor, DIRECTORY_PREFIX + anchor + bytes([i])) for anchor in anchors for i in range(DIRECTORY_SLOTS)]
        listed = self._call(load, self.store.get, [slot for _, slot in slots])
        lengths: set[int] = set()
        media = seq.lease.extras.media if seq.lease is not None else ()
        for (anchor, _), value in zip(slots, listed, strict=True):
            if value is None:
                continue
            try:
                entry = decode(value, root=self.root, key=anchor, kind=ValueKind.LENGTH)
            except ValueRejected:
                self._count(corrupt=1)
                continue
            length = int(entry.tokens[0]) if entry.tokens.size == 1 else -1
            if load.reuse < length < len(seq.prompt_ids) and accept(length) and \
                    not any(m.start < length < m.start + m.length for m in media):
                lengths.add(length)
        return sorted(lengths, reverse=True)

    def _load_checkpoint(self, load: _Load) -> None:
        seq, T = load.seq, self.tokens_per_page
        lease = seq.lease
        assert lease is not None and self.states is not None
        prompt = np.asarray(seq.prompt_ids, dtype=np.int32)
        keys, extras = lease.keys, lease.extras
        depths = range(min(len(keys), (len(prompt) - 1) // T), load.reuse // T - 1, -1)
        anchors = [keys[depth - 1] if depth else self.root for depth in depths]
        lengths = self._listed_lengths(load, anchors, seq)
        state_like = [array[0] for array in self.states.arrays.values()]
        tail_like = self.kv.read_page(0) if self.kv is not None else []
        for length in lengths:
            depth = length // T
            anchor = keys[depth - 1] if depth else self.root
            terminal = tail_page_key(anchor, prompt[:length], depth * T, extras) if length % T else anchor
            first = load.reuse // T if self.kv is not None else depth  # pages the local hit lacks
            page_keys = [PAGE_PREFIX + key for key in keys[first:depth]] if self.kv is not None else []
            values = self._call(load, self.store.get, [CHECKPOINT_PREFIX + terminal])
            if values[0] is None:
                continue
            try:
                checkpoint = decode(values[0], root=self.root, key=terminal, kind=ValueKind.CHECKPOINT,
                                    like=state_like + (tail_like if length % T else []), tokens=prompt[:length])
            except ValueRejected:
                self._count(corrupt=1)
                continue
            pages = self._get_pages(load, page_keys, first, prompt, tail_like)
            if pages is None:
                continue  # a page of it is gone: a shorter checkpoint may still be whole
            self._publish_ready(load, [*pages, (-1, checkpoint)])
            self._remember(page_keys + [CHECKPOINT_PREFIX + terminal])
            return

    def _get_pages(self, load: _Load, page_keys: list[bytes], first: int, prompt: np.ndarray,
                   like: list[np.ndarray]) -> list[tuple[int, Decoded]] | None:
        """Every page of `page_keys` (from page index `first`), or None if one is missing or rejected."""
        if not page_keys:
            return []
        T = self.tokens_per_page
        per_batch = max(1, BATCH_BYTES // max(1, sum(a.nbytes for a in like)))
        pages = []
        for begin in range(0, len(page_keys), per_batch):
            batch = page_keys[begin:begin + per_batch]
            for offset, value in enumerate(self._call(load, self.store.get, batch)):
                page = first + begin + offset
                if value is None:
                    return None
                try:
                    pages.append((page, decode(value, root=self.root, key=batch[offset][1:], kind=ValueKind.PAGE,
                                               like=like, tokens=prompt[page * T:(page + 1) * T])))
                except ValueRejected:
                    self._count(corrupt=1)
                    return None
        return pages

    def _write_worker(self) -> None:
        while (job := self._write_jobs.get()) is not None:
            try:
                while not self._connected.wait(0.1) and not self._closed:
                    pass
                if self._closed and not self._connected.is_set():
                    continue
                if time.monotonic() < self._down_until:
                    self._count(dropped_writes=1)
                    continue
                self._write(job)
            except StoreError:
                self._fault(timeout=False)
            except Exception:
                self._fault(timeout=False)
            finally:
                with self._lock:
                    self._pending_bytes -= job.nbytes

    def _write(self, job: _Write) -> None:
        keys = [key for key, _ in job.items]
        present = self._call(None, self.store.exists, keys)
        missing = [(key, value) for (key, value), there in zip(job.items, present, strict=True) if not there]
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        for key, value in missing:
            data = value() if callable(value) else value
            batch.append((key, data))
            size += len(data)
            if size >= BATCH_BYTES:
                self._put(batch)
                batch, size = [], 0
        if batch:
            self._put(batch)
        self._remember(keys)
        if job.directory is not None:
            self._list_checkpoint(*job.directory)

    def _put(self, batch: list[tuple[bytes, bytes]]) -> None:
        self._call(None, self.store.put, batch)
        self._count(writes=len(batch), write_bytes=sum(len(value) for _, value in batch))

    def _list_checkpoint(self, anchor: bytes, length: int) -> None:
        """Add `length` to the anchor's directory: the first free slot (first writer wins; a slot lost to a racing
        writer only means that checkpoint is not found by other processes)."""
        slots = [DIRECTORY_PREFIX + anchor + bytes([i]) for i in range(DIRECTORY_SLOTS)]
        listed = self._call(None, self.store.get, slots)
        for slot, value in zip(slots, listed, strict=True):
            if value is None:  # an entry's header names its anchor (the slot number needs no check)
                self._put([(slot, encode(ValueKind.LENGTH, self.root, anchor, [length], []))])
                return
            try:
                if int(decode(value, root=self.root, key=anchor, kind=ValueKind.LENGTH).tokens[0]) == length:
                    return
            except (ValueRejected, IndexError):
                continue

    # --- shared state ------------------------------------------------------------------------------------

    def _count(self, **amounts: int | float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self.counters, name, getattr(self.counters, name) + amount)

    def _fault(self, *, timeout: bool) -> None:
        """A failed or late store call: count it, stop asking for a while (doubling), forget what it held."""
        with self._lock:
            if timeout:
                self.counters.timeouts += 1
            else:
                self.counters.errors += 1
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_S[1])
            self._known.clear()  # a restarted store holds none of it

    def _remember(self, keys: list[bytes]) -> None:
        with self._lock:
            self._backoff = BACKOFF_S[0]  # a call that worked ends the doubling
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > KNOWN_KEYS:
                self._known.popitem(last=False)

    def _is_known(self, key: bytes) -> bool:
        with self._lock:
            return key in self._known


def _close_at_exit(tier: weakref.ref[SharedTier]) -> None:
    alive = tier()
    if alive is not None:
        alive.close(flush_timeout_s=AT_EXIT_FLUSH_S)


class _Abandoned(Exception):
    """The engine thread gave up on this load (deadline or abort): stop asking the store for it."""


def _encoder(kind: ValueKind, root: bytes, key: bytes, tokens: np.ndarray,
             arrays: list[np.ndarray]) -> Callable[[], bytes]:
    return lambda: encode(kind, root, key, tokens, arrays)
