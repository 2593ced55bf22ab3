"""The tier's store I/O off the engine thread: connect, load and write threads, per-call deadlines, the back-off,
the bounded write queue, the keys known to be stored (or known to be bad), flush and close.

Nothing here blocks the engine thread on the store: it only enqueues, and reads what the workers published. A
store that never connects says so once, in one line on the `kvforge.shared_tier` logger (stderr by default).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.sequence import Sequence
from kvforge.runtime.shared_tier.layout import Layout
from kvforge.runtime.shared_tier.store import SharedStore
from kvforge.runtime.shared_tier.values import Decoded, ValueRejected

LOG = logging.getLogger("kvforge.shared_tier")
BATCH_BYTES = 8 << 20  # a get or put batch stays near this size, so one call fits the timeout on a LAN
MAX_PENDING_WRITE_BYTES = 256 << 20  # writes queued past this are dropped (counted): the tier never holds the pool
KNOWN_KEYS = 1 << 16  # keys this process knows the store has (written or loaded): not written again
STALE_KEYS = 1 << 12  # keys whose stored value a read rejected: the next computed value replaces it
BACKOFF_S = (1.0, 30.0)  # after an error or timeout: skip the store this long, doubling up to the second value
FLUSH_TIMEOUT_S = 10.0
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
    corrupt: int = 0  # values rejected: checksum or MAC, size, another engine's root, other tokens or shapes
    skipped_lookups: int = 0  # admissions that did not ask: back-off after a fault, or a request the tier bypasses
    dropped_writes: int = 0  # records not saved: back-off, or the write queue was full

    def to_dict(self) -> dict[str, int | float]:
        return {key: round(getattr(self, key), 3) if key == "load_ms" else getattr(self, key) for key in TIER_KEYS}


@dataclass(slots=True)
class Load:
    """One sequence's load: a worker fills `ready`, the engine thread copies from it and decides when it ends."""

    seq: Sequence
    started: float
    reuse: int  # tokens the sequence had before the load (its local hit)
    checkpoint: bool
    ready: list[tuple[int, Decoded]] = field(default_factory=list)  # (page index, value); -1 = the endpoint
    loaded_tokens: int = 0  # an endpoint load's length once it is complete
    done: bool = False
    abandoned: bool = False
    call_started: float | None = None  # monotonic start of the store call running now (None between calls)
    copied_pages: int = 0


@dataclass(slots=True)
class Write:
    items: list[tuple[bytes, bytes | Callable[[], bytes]]]  # (store key, value or how to encode it off-thread)
    nbytes: int
    directory: tuple[bytes, int] | None = None  # (anchor, length): list an endpoint once its value is stored


class Abandoned(Exception):
    """The engine thread gave up on this load (deadline or abort): stop asking the store for it."""


class TierIO:
    """The threads and shared state between the engine thread and the store. `search` (set by the tier) runs one
    load on a worker (lookup.py); it reports through `call`, `publish`, `rejected` and `remember`."""

    def __init__(self, store: SharedStore, layout: Layout, timeout_s: float) -> None:
        self.store = store
        self.layout = layout
        self.timeout_s = timeout_s
        self.search: Callable[[Load], None] | None = None  # set by the tier before its first load
        self.counters = TierCounters()
        self.lock = threading.Lock()  # the counters the workers bump, the known keys, the back-off
        self.progress = threading.Condition(self.lock)
        self.closed = False
        self.connected = threading.Event()
        self._first_attempt = threading.Event()
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._stale: OrderedDict[bytes, None] = OrderedDict()
        self._down_until = 0.0
        self._backoff = BACKOFF_S[0]
        self._pending_bytes = 0
        self._said_off = False
        self._load_jobs: queue.Queue[Load | None] = queue.Queue()
        self._write_jobs: queue.Queue[Write | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._connect, name="kvforge-tier-connect", daemon=True)]
        self._threads += [threading.Thread(target=self._load_worker, name=f"kvforge-tier-load-{i}", daemon=True)
                          for i in range(LOAD_THREADS)]
        self._threads.append(threading.Thread(target=self._write_worker, name="kvforge-tier-write", daemon=True))
        for thread in self._threads:
            thread.start()

    # --- engine thread ---------------------------------------------------------------------------------

    def available(self) -> bool:
        """Connected and not backing off after a fault: worth asking."""
        return self.connected.is_set() and time.monotonic() >= self._down_until

    def backing_off(self) -> bool:
        return time.monotonic() < self._down_until

    def submit_load(self, load: Load) -> None:
        self._load_jobs.put(load)

    def submit_write(self, job: Write) -> None:
        """Queue `job` unless the queued bytes would pass the bound (then it is dropped, counted)."""
        with self.lock:
            if self._pending_bytes + job.nbytes > MAX_PENDING_WRITE_BYTES:
                self.counters.dropped_writes += 1
                return
            self._pending_bytes += job.nbytes
        self._write_jobs.put(job)

    def wait_connected(self, timeout_s: float) -> bool:
        self._first_attempt.wait(timeout_s)
        return self.connected.is_set()

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until the queued writes are in the store (or dropped); False if they are still going at the end."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.connected.is_set():
                if self._first_attempt.is_set():
                    return False  # the store did not answer: nothing can be written, do not wait for it
                time.sleep(0.005)  # still connecting (a slow set-up on a loaded host): its writes may yet go
                continue
            with self.lock:
                if self._pending_bytes == 0 and self._write_jobs.empty():
                    return True
            time.sleep(0.005)
        return False

    def close(self, flush_timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Flush the writes (bounded), stop the threads, close the store. Idempotent."""
        if self.closed:
            return
        self.flush(flush_timeout_s)
        self.closed = True
        for _ in range(LOAD_THREADS):
            self._load_jobs.put(None)
        self._write_jobs.put(None)
        for thread in self._threads[1:]:  # the connect thread may sit in a slow setup: it is a daemon
            thread.join(timeout=1.0)
        with contextlib.suppress(Exception):  # closing a broken connection must not fail the caller's shutdown
            self.store.close()

    # --- shared state ----------------------------------------------------------------------------------

    def count(self, **amounts: int | float) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self.counters, name, getattr(self.counters, name) + amount)

    def fault(self, *, timeout: bool) -> None:
        """A failed or late store call: count it, stop asking for a while (doubling), forget what it held."""
        with self.lock:
            if timeout:
                self.counters.timeouts += 1
            else:
                self.counters.errors += 1
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_S[1])
            self._known.clear()  # a restarted store holds none of it

    def remember(self, keys: list[bytes]) -> None:
        with self.lock:
            self._backoff = BACKOFF_S[0]  # a call that worked ends the doubling
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > KNOWN_KEYS:
                self._known.popitem(last=False)

    def is_known(self, key: bytes) -> bool:
        with self.lock:
            return key in self._known

    def rejected(self, store_key: bytes) -> None:
        """A read refused the value under `store_key`: count it, and let the next computed value replace it."""
        with self.lock:
            self.counters.corrupt += 1
            self._known.pop(store_key, None)
            self._stale[store_key] = None
            while len(self._stale) > STALE_KEYS:
                self._stale.popitem(last=False)

    def publish(self, load: Load, ready: list[tuple[int, Decoded]]) -> None:
        with self.progress:
            load.ready.extend(ready)
            self.progress.notify_all()

    def call(self, load: Load | None, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One store call, timed for the engine thread's deadline; a load the engine gave up on stops here."""
        if load is not None:
            if load.abandoned:
                raise Abandoned
            load.call_started = time.monotonic()
        try:
            return method(*args, **kwargs)
        finally:
            if load is not None:
                load.call_started = None

    # --- workers -----------------------------------------------------------------------------------------

    def _connect(self) -> None:
        while not self.closed:
            try:
                self.store.connect()
            except Exception as exc:  # counted; tried again after the back-off, which doubles
                self.fault(timeout=False)
                self._say_off(exc)
                self._first_attempt.set()
                time.sleep(max(self._down_until - time.monotonic(), 0.05))
                continue
            self.connected.set()
            self._first_attempt.set()
            return

    def _say_off(self, exc: Exception) -> None:
        """One line, once per tier: requests never fail on the tier, so this is the only sign it is off."""
        if self._said_off:
            return
        self._said_off = True
        text = exc.message if isinstance(exc, KvforgeError) else str(exc)
        reason = (text.strip().splitlines() or [type(exc).__name__])[0].removeprefix(f"{self.store.url}: ")
        LOG.warning("kvforge: shared tier %s is off (%s); requests compute cold while it reconnects in the "
                    "background", self.store.url, reason)

    def _load_worker(self) -> None:
        while (load := self._load_jobs.get()) is not None:
            try:
                assert self.search is not None
                self.search(load)
            except (ValueRejected, Abandoned):
                pass
            except Exception:  # StoreError, or a bug: neither may kill the thread every later load needs
                self.fault(timeout=False)
            finally:
                with self.progress:
                    load.done, load.call_started = True, None
                    self.progress.notify_all()

    def _write_worker(self) -> None:
        while (job := self._write_jobs.get()) is not None:
            try:
                while not self.connected.wait(0.1) and not self.closed:
                    pass
                if self.closed and not self.connected.is_set():
                    continue
                if self.backing_off():
                    self.count(dropped_writes=1)
                    continue
                self._write(job)
            except Exception:  # StoreError, or a bug
                self.fault(timeout=False)
            finally:
                with self.lock:
                    self._pending_bytes -= job.nbytes

    def _write(self, job: Write) -> None:
        """Write what the store lacks, and replace what a read here rejected (the tier heals)."""
        with self.lock:
            stale = {key for key, _ in job.items if key in self._stale}
        fresh = [key for key, _ in job.items if key not in stale]
        present = dict(zip(fresh, self.call(None, self.store.exists, fresh), strict=True)) if fresh else {}
        for replace in (False, True):
            todo = [(k, v) for k, v in job.items if (k in stale) == replace and not present.get(k, False)]
            self._put_batches(todo, replace)
        with self.lock:
            for key in stale:
                self._stale.pop(key, None)
        self.remember([key for key, _ in job.items])
        if job.directory is not None:
            self._list_endpoint(*job.directory)

    def _put_batches(self, items: list[tuple[bytes, bytes | Callable[[], bytes]]], replace: bool) -> None:
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        for key, value in items:
            data = value() if callable(value) else value
            batch.append((key, data))
            size += len(data)
            if size >= BATCH_BYTES:
                self._put(batch, replace)
                batch, size = [], 0
        if batch:
            self._put(batch, replace)

    def _put(self, batch: list[tuple[bytes, bytes]], replace: bool) -> None:
        self.call(None, self.store.put, batch, replace=replace)
        self.count(writes=len(batch), write_bytes=sum(len(value) for _, value in batch))

    def _list_endpoint(self, anchor: bytes, length: int) -> None:
        """Add `length` to the anchor's directory: the first free slot, or one whose entry is damaged (replaced).
        First writer wins; a slot lost to a racing writer only means other processes do not find that endpoint."""
        slots = self.layout.directory_slots(anchor)
        listed = self.call(None, self.store.get, slots, max_bytes=self.layout.length.max_bytes(1, []))
        for slot, value in zip(slots, listed, strict=True):
            damaged = False
            if value is not None:
                try:
                    if self.layout.listed_length(anchor, value) == length:
                        return
                    continue
                except ValueRejected:
                    damaged = True
            self._put([(slot, self.layout.directory_entry(anchor, length))], replace=damaged)
            return

