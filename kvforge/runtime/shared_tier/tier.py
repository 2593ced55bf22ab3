"""The shared tier below the in-process pool, as the engine thread sees it: the scheduler's `ExternalLoader` and the
cache's `CacheEvents` listener, so it hooks the cache's events and the WAITING_FOR_REMOTE state, never the loop.

It loads a new sequence's missing pages before it computes and saves committed records after, and never lets a
slow, dead, full, corrupt or forged store fail or stall a request. The engine thread only copies bytes between the
pool and decoded values and owns every deadline: a load whose store call runs past `timeout_s` is abandoned (the
request computes what it lacks) and the store is left alone for a back-off. The rest is split by concern: io.py
(threads, deadlines, back-off, writes), layout.py (keys and per-type codecs), lookup.py (the searches on the
worker threads), secret.py (the optional MAC and encryption), stores/ (one module per store).
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvforge.contract.profile_schema import PARTIAL_KV_SNAPSHOTS, RECURRENT_SNAPSHOTS
from kvforge.runtime.context_cache.records import Record
from kvforge.runtime.context_cache.registry import tier_values
from kvforge.runtime.execution.backend import KVStorage
from kvforge.runtime.execution.recurrent_state import RecurrentStates
from kvforge.runtime.execution.snapshots import PartialKVSnapshotStore, RecurrentSnapshotStore
from kvforge.runtime.sequence import Sequence
from kvforge.runtime.shared_tier.io import FLUSH_TIMEOUT_S, Load, TierIO, Write
from kvforge.runtime.shared_tier.layout import Codec, Layout
from kvforge.runtime.shared_tier.lookup import TierSearch
from kvforge.runtime.shared_tier.secret import TierSecret
from kvforge.runtime.shared_tier.store import SharedStore
from kvforge.runtime.shared_tier.values import Decoded

AT_EXIT_FLUSH_S = 3.0  # an interpreter exiting without close(): a short, bounded flush


class SharedTier:
    """`ExternalLoader` + `CacheEvents` over one `SharedStore`. Built by the engine when `--sharedCache` is set."""

    def __init__(self, store: SharedStore, *, root: bytes, tokens_per_page: int, kv: KVStorage | None,
                 states: RecurrentStates | None, state_rows: dict, partial: PartialKVSnapshotStore | None,
                 recurrent: RecurrentSnapshotStore | None, timeout_s: float, secret: TierSecret | None = None) -> None:
        """`kv`: the pool (None on a pure recurrent engine); `states`/`state_rows`: running sequences' recurrent
        rows by lease (checkpoint engines); `partial`/`recurrent`: the snapshot stores a committed checkpoint's
        bytes are read from; `secret`: the tier secret (MAC, and encryption if asked), None without one."""
        self.store = store
        self.root = root
        self.tokens_per_page = tokens_per_page
        self.kv = kv
        self.states = states
        self.state_rows = state_rows
        # The storage each type's tier values are read from (TierValue.source): a copy of one slot's arrays.
        self.sources: dict[str, Callable[[int], list[np.ndarray]]] = {}
        if recurrent is not None:
            self.sources[RECURRENT_SNAPSHOTS] = lambda slot: [np.array(array[slot]) for array in recurrent.arrays]
        if partial is not None:
            self.sources[PARTIAL_KV_SNAPSHOTS] = lambda slot: [np.array(layer[slot]) for layer in partial.layers]
        self.timeout_s = timeout_s
        self.checkpoints = states is not None
        self.layout = Layout(root, secret)
        self._loads: dict[int, Load] = {}  # by id(seq)
        self.io = TierIO(store, self.layout, timeout_s)
        # Handed to the io, not reached through this object: the worker threads hold no reference to the tier.
        self.io.search = TierSearch(self.io, self.layout, tokens_per_page=tokens_per_page, kv=kv, states=states)
        self.counters = self.io.counters
        # A script that never calls close() still saves what it committed last (the threads are daemons).
        atexit.register(_close_at_exit, weakref.ref(self))

    # --- ExternalLoader (the scheduler, engine thread) -----------------------------------------------

    def start(self, seq: Sequence) -> bool:
        """Begin loading what the local hit lacks, if the store may have it. True: the sequence waits for `poll`."""
        lease = seq.lease
        if lease is None or not lease.may_publish or lease.forced_cold:
            return False  # bypass lookups, and runs retried cold, never look anywhere
        if seq.drafts_with_kv:  # a draft-pool row (EAGLE3, DFlash, DSpark) needs draft K/V too: the tier has none
            self.io.count(skipped_lookups=1)
            return False
        T, prompt = self.tokens_per_page, seq.prompt_ids
        reuse = seq.num_computed_tokens
        if self.checkpoints:
            if reuse >= len(prompt) - 1:
                return False
        elif reuse % T or reuse // T >= (len(prompt) - 1) // T:
            return False  # mid-page (a snapshot tail) or nothing left a page could cover
        if not self.io.available():
            self.io.count(skipped_lookups=1)  # not connected yet, or backing off after a fault: compute
            return False
        load = Load(seq, time.perf_counter(), reuse, self.checkpoints)
        self._loads[id(seq)] = load
        self.io.count(lookups=1)
        self.io.submit_load(load)
        return True

    def poll(self, seq: Sequence) -> int | None:
        """None while the load runs; else the tokens now in the sequence's pages (and state) past its reuse point."""
        load = self._loads.get(id(seq))
        if load is None:
            return 0
        with self.io.lock:
            ready, load.ready = load.ready, []
            done, call_started = load.done, load.call_started
        loaded = self._copy(load, ready)
        if not done:
            now = time.monotonic()
            stuck = call_started is not None and now - call_started > self.timeout_s
            # A load still queued behind another's hung call gives up once that call has tripped the back-off.
            if not stuck and not (call_started is None and self.io.backing_off()):
                return None
            load.abandoned = True
            if stuck:
                self.io.fault(timeout=True)
        del self._loads[id(seq)]
        loaded = loaded if done else (0 if load.checkpoint else load.copied_pages * self.tokens_per_page)
        self.io.count(hits=int(loaded > 0), loaded_tokens=loaded, load_ms=(time.perf_counter() - load.started) * 1e3)
        return loaded

    def cancel(self, seq: Sequence) -> None:
        """The sequence ended while loading (aborted): its pages are going back, so nothing may be copied in."""
        load = self._loads.pop(id(seq), None)
        if load is not None:
            load.abandoned = True

    def wait(self, timeout_s: float) -> None:
        """Block the engine thread up to `timeout_s` for load progress (it has no row to run meanwhile)."""
        with self.io.progress:
            if not any(load.ready or load.done for load in self._loads.values()):
                self.io.progress.wait(timeout_s)

    def _copy(self, load: Load, ready: list[tuple[int, Decoded]]) -> int:
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
        """Save a new record's values the store does not have yet (`record_values`); the bytes are copied now,
        because the pages may be reused once the record is evicted, and encoded and written on the write thread."""
        if self.io.backing_off() or self.io.closed:
            self.io.count(dropped_writes=1)
            return
        job = record_values(record, self.layout, self.tokens_per_page, kv=self.kv, sources=self.sources,
                            known=self.io.is_known)
        if job is not None:
            self.io.submit_write(job)

    # --- lifecycle ------------------------------------------------------------------------------------

    def wait_connected(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for the first connection attempt to end (the engine waits at start-up, so the
        first requests can use the tier); True if it connected. A store that is down only makes requests cold."""
        return self.io.wait_connected(timeout_s)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until the queued writes are in the store (or dropped); False if they are still going at the end."""
        return self.io.flush(timeout_s)

    def close(self, flush_timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Flush the writes (bounded), stop the threads, close the store. Idempotent."""
        self.io.close(flush_timeout_s)

    def profile(self) -> dict[str, int | float]:
        with self.io.lock:
            return self.counters.to_dict()


def record_values(record: Record, layout: Layout, tokens_per_page: int, *, kv: KVStorage | None,
                  sources: Mapping[str, Callable[[int], list[np.ndarray]]],
                  known: Callable[[bytes], bool]) -> Write | None:
    """What a committed record saves: each full page the store is not `known` to hold, and its endpoint (what each
    cache type exports for it, `tier_values`: a checkpoint's recurrent state, then its partial tail page) with the
    directory entry that finds it, each value's arrays copied from its `sources` storage. None when there is
    nothing to save."""
    T, tokens = tokens_per_page, np.asarray(record.token_ids, dtype=np.int32)
    items: list[tuple[bytes, bytes | Callable[[], bytes]]] = []
    nbytes = 0
    for index, (key, page) in enumerate(zip(record.keys, record.page_ids, strict=False)):
        if known(layout.page.store_key(key)):
            continue
        assert kv is not None
        arrays = [np.array(rows) for rows in kv.read_page(page)]  # copies
        items.append((layout.page.store_key(key), _encoder(layout.page, key, tokens[index * T:(index + 1) * T],
                                                           arrays)))
        nbytes += sum(a.nbytes for a in arrays)
    directory = None
    values = tier_values(record)
    assert values or not record.is_checkpoint, "a checkpoint without its recurrent state"
    if values and not known(layout.checkpoint.store_key(record.terminal_key)):
        arrays = [array for value in values for array in sources[value.source](value.slot)]
        items.append((layout.checkpoint.store_key(record.terminal_key),
                      _encoder(layout.checkpoint, record.terminal_key, tokens, arrays)))
        nbytes += sum(a.nbytes for a in arrays)
        directory = (record.parent_key or layout.root, len(tokens))
    return Write(items, nbytes, directory) if items else None


def _close_at_exit(tier: weakref.ref[SharedTier]) -> None:
    alive = tier()
    if alive is not None:
        alive.close(flush_timeout_s=AT_EXIT_FLUSH_S)


def _encoder(codec: Codec, key: bytes, tokens: np.ndarray, arrays: list[np.ndarray]) -> Callable[[], bytes]:
    return lambda: codec.encode(key, tokens, arrays)
