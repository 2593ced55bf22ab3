"""The cache's audit: every refcount, index entry and in-flight key recomputed from the leases and records.

Tests call it after every step; it only reads (a failing assertion names what disagrees). What only one type knows
(its own part of a lease or record, its lookup structures) that type asserts (`CacheType.audit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from kvforge.runtime.context_cache.index import PageIndex, page_token_bytes
from kvforge.runtime.context_cache.keys import page_keys, tail_page_key
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.pools import ResourcePool, ResourcePools
from kvforge.runtime.context_cache.protocol import CacheType
from kvforge.runtime.context_cache.records import RecordStore


class AuditedCache(Protocol):
    """The public state of ContextCacheManager the audit reads. Not the manager class itself: the manager imports
    this module (its check_invariants method calls the function below), so the audit imports only downward."""

    enabled: bool
    tokens_per_page: int
    max_records: int
    chain_root: bytes
    pools: ResourcePools
    index: PageIndex
    records: RecordStore
    leases: set[Lease]
    types: tuple[CacheType, ...]

    @property
    def pages(self) -> ResourcePool: ...

    @property
    def checkpoints(self) -> bool: ...

    @property
    def paged(self) -> bool: ...

    @property
    def in_flight(self) -> Mapping[bytes, Lease]: ...


def check_invariants(manager: AuditedCache) -> None:
    """Audit every refcount, index entry and in-flight key from scratch (tests call this after each step)."""
    T = manager.tokens_per_page
    active = {pool.name: [0] * pool.capacity for pool in manager.pools}
    cache = {pool.name: [0] * pool.capacity for pool in manager.pools}
    for lease in manager.leases:
        assert manager.paged or not lease.page_ids, "a pure recurrent lease holds no pages"
        for kind in manager.types:
            for slot in kind.pinned(lease):
                active[kind.name][slot] += 1
    records = list(manager.records.least_recent_first())
    for record in records:
        assert len(record.page_ids) == (len(record.keys) if manager.paged else 0)
        assert page_keys(record.token_ids, T, record.extras, parent=manager.chain_root) == list(record.keys)
        tokens = np.asarray(record.token_ids, dtype=np.int32)
        for i, (key, page) in enumerate(zip(record.keys, record.page_ids, strict=False)):
            assert manager.index.canonical(key, page_token_bytes(tokens, i, T)) == page
        tail = len(tokens) - len(record.keys) * T
        assert record.exact == manager.checkpoints, "checkpoint deployments keep only checkpoints"
        if manager.checkpoints:  # an exact checkpoint: keyed at its exact length (its types check what it holds)
            assert 0 <= tail < T
            assert len(record.keys) + bool(record.tail_key) > 0 and bool(record.tail_key) == (tail > 0)
        if record.tail_key:
            parent = record.keys[-1] if record.keys else manager.chain_root
            assert record.tail_key == tail_page_key(parent, tokens, len(tokens) - tail, record.extras)
        assert manager.records.find(record.terminal_key) is record
        for kind in manager.types:
            for slot in kind.held(record):
                cache[kind.name][slot] += 1
    for kind in manager.types:
        kind.audit(records, manager.leases)
    for pool in manager.pools:
        assert active[pool.name] == pool.active, f"{pool.name}: active refcounts disagree with the live leases"
        assert cache[pool.name] == pool.cache, f"{pool.name}: cache refcounts disagree with the records"
        free = pool.free_slots()
        assert len(free) == pool.num_free, f"{pool.name}: a slot is on the free list twice"
        assert free == {p for p in range(pool.capacity) if pool.active[p] == 0 and pool.cache[p] == 0}
    for key, lease in manager.in_flight.items():
        assert lease in manager.leases and not manager.index.contains(key), "a stale in-flight key"
    assert manager.paged or (len(manager.index) == 0 and manager.pages.capacity == 0), "pure recurrent: no KV pages"
    assert not manager.checkpoints or not manager.in_flight, "checkpoint deployments index nothing in flight"
    assert len(manager.records) <= manager.max_records or not manager.enabled
