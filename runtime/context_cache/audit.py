"""The cache's audit: every refcount, index entry and in-flight key recomputed from the leases and records.

Tests call it after every step; it only reads (a failing assertion names what disagrees).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvforge.runtime.context_cache.index import PageIndex, page_token_bytes
from kvforge.runtime.context_cache.keys import page_keys, tail_page_key
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.pools import BASE_KV_PAGES, DRAFT_KV_PAGES, ResourcePool, ResourcePools
from kvforge.runtime.context_cache.records import RecordStore

if TYPE_CHECKING:
    from kvforge.runtime.context_cache.draft_paths import DraftPaths
    from kvforge.runtime.context_cache.partial_tails import PartialTails
    from kvforge.runtime.context_cache.recurrent_checkpoints import RecurrentCheckpoints


class AuditedCache(Protocol):
    """The public state of ContextCacheManager the audit reads. Not the manager class itself: the manager imports
    this module (its check_invariants method calls the function below), so the audit imports only downward."""

    enabled: bool
    tokens_per_page: int
    max_records: int
    chain_root: bytes
    pools: ResourcePools
    pages: ResourcePool
    partial_snapshots: ResourcePool
    recurrent_snapshots: ResourcePool
    index: PageIndex
    records: RecordStore
    leases: set[Lease]
    tails: PartialTails | None
    recurrent: RecurrentCheckpoints | None
    drafts: DraftPaths | None

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
        for page in lease.page_ids:
            active[BASE_KV_PAGES][page] += 1
        for page in lease.draft_page_ids or ():
            active[DRAFT_KV_PAGES][page] += 1
        if lease.draft_page_ids is not None:
            assert len(lease.draft_page_ids) * T >= lease.draft_computed_tokens, "draft K/V past the draft pages"
        if lease.restore_slot is not None:
            active[manager.partial_snapshots.name][lease.restore_slot] += 1
        if lease.restore_recurrent_slot is not None:
            active[manager.recurrent_snapshots.name][lease.restore_recurrent_slot] += 1
    for record in manager.records.least_recent_first():
        assert len(record.page_ids) == (len(record.keys) if manager.paged else 0)
        assert page_keys(record.token_ids, T, record.extras, parent=manager.chain_root) == list(record.keys)
        tokens = np.asarray(record.token_ids, dtype=np.int32)
        for i, (key, page) in enumerate(zip(record.keys, record.page_ids, strict=False)):
            assert manager.index.canonical(key, page_token_bytes(tokens, i, T)) == page
        tail = len(tokens) - len(record.keys) * T
        assert record.is_checkpoint == manager.checkpoints, "checkpoint deployments keep only checkpoints"
        if manager.checkpoints:  # an exact checkpoint: keyed at its exact length, partial slot iff hybrid unaligned
            assert 0 <= tail < T and (record.partial_slot is not None) == (manager.paged and tail > 0)
            assert len(record.keys) + bool(record.tail_key) > 0 and bool(record.tail_key) == (tail > 0)
            assert manager.recurrent is not None
            assert len(tokens) in manager.recurrent.lengths_after(record.parent_key)
        elif record.partial_slot is None:
            assert tail == 0 and not record.tail_key
        else:
            assert 0 < tail < T, "a snapshot holds a partial tail page"
        if record.partial_slot is not None:
            assert manager.tails is not None and manager.tails.filed(record), "a snapshot tail lookups cannot find"
        if record.tail_key:
            parent = record.keys[-1] if record.keys else manager.chain_root
            assert record.tail_key == tail_page_key(parent, tokens, len(tokens) - tail, record.extras)
        assert manager.records.find(record.terminal_key) is record
        if record.draft_tail is not None:  # a hybrid MTP checkpoint: the base's states past its shared draft pages
            shared = (len(tokens) - 1) // T
            assert manager.checkpoints and record.draft_tail.start == shared * T
            assert len(record.draft_tail.hidden) == len(tokens) - shared * T and len(record.draft_page_ids) >= shared
        for name, slots in record.held().items():
            for slot in slots:
                cache[name][slot] += 1
    if manager.drafts is not None:
        for key, (record_id, covered) in manager.drafts.boundaries().items():
            record = manager.records.get(record_id)
            assert record is not None, "a draft path boundary names an evicted record"
            assert len(record.draft_page_ids) >= covered and record.keys[covered - 1] == key
    for pool in manager.pools:
        assert active[pool.name] == pool.active, f"{pool.name}: active refcounts disagree with the live leases"
        assert cache[pool.name] == pool.cache, f"{pool.name}: cache refcounts disagree with the records"
        free = pool.free_slots()
        assert len(free) == pool.num_free, f"{pool.name}: a slot is on the free list twice"
        assert free == {p for p in range(pool.capacity) if pool.active[p] == 0 and pool.cache[p] == 0}
    free = manager.pages.free_slots()
    for _key, entry in manager.index.items():
        assert entry.page not in free, "an index entry points at a free page"
    for key, lease in manager.in_flight.items():
        assert lease in manager.leases and not manager.index.contains(key), "a stale in-flight key"
    assert manager.paged or (len(manager.index) == 0 and manager.pages.capacity == 0), "pure recurrent: no KV pages"
    assert not manager.checkpoints or not manager.in_flight, "checkpoint deployments index nothing in flight"
    assert len(manager.records) <= manager.max_records or not manager.enabled
