"""The context cache alone, no model: keys, pools, planner, eviction simulation and the manager."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.context_cache.eviction import plan_eviction
from kvforge.runtime.context_cache.index import BlockIndex
from kvforge.runtime.context_cache.keys import KeyExtras, page_keys
from kvforge.runtime.context_cache.manager import BYPASS, Admission, ContextCacheManager
from kvforge.runtime.context_cache.planner import (
    PLAN_FULL_INPUT_REWIND,
    PLAN_NO_REUSABLE_PREFIX,
    PLAN_STANDARD,
    plan_reuse,
)
from kvforge.runtime.context_cache.pools import BASE_KV_PAGES, ResourcePool, ResourcePools
from kvforge.runtime.context_cache.records import Record, RecordStore

T = 4  # tokens per page


def tokens(n: int, offset: int = 0) -> list[int]:
    return list(range(offset, offset + n))


# --- keys -------------------------------------------------------------------------------------------

def test_keys_chain_and_ignore_partial_tail() -> None:
    keys = page_keys(tokens(10), T, KeyExtras())
    assert len(keys) == 2  # 10 tokens: two full pages, the tail is never keyed
    assert page_keys(tokens(8), T, KeyExtras()) == keys
    changed_first = page_keys([99] + tokens(7, 1), T, KeyExtras())
    assert changed_first[0] != keys[0] and changed_first[1] != keys[1]  # a parent change reaches every descendant
    changed_second = page_keys(tokens(4) + [99] + tokens(3, 5), T, KeyExtras())
    assert changed_second[0] == keys[0] and changed_second[1] != keys[1]


def test_keys_isolate_salt_and_adapter_with_domain_separation() -> None:
    ids = tokens(8)
    variants = {
        "none": KeyExtras(), "empty salt": KeyExtras(cache_salt=""), "salt x": KeyExtras(cache_salt="x"),
        "salt y": KeyExtras(cache_salt="y"), "adapter x": KeyExtras(adapter_digest=b"x"),
        "adapter x salt x": KeyExtras(adapter_digest=b"x", cache_salt="x"),
    }
    firsts = {name: page_keys(ids, T, extras)[0] for name, extras in variants.items()}
    assert len(set(firsts.values())) == len(firsts)  # every pair differs: an adapter named like a salt included
    assert page_keys(ids, T, KeyExtras(cache_salt="x")) == page_keys(ids, T, KeyExtras(cache_salt="x"))


def test_keys_resume_from_a_parent() -> None:
    full = page_keys(tokens(16), T, KeyExtras())
    tail = page_keys(tokens(16), T, KeyExtras(), parent=full[1], first_page=2)
    assert full[2:] == tail


# --- pools ------------------------------------------------------------------------------------------

def test_pool_frees_only_when_both_refcounts_are_zero() -> None:
    pool = ResourcePool(BASE_KV_PAGES, 3)
    [page] = pool.allocate(1)
    assert (pool.active[page], pool.cache[page], pool.num_free) == (1, 0, 2)
    pool.add_cache_ref([page])
    pool.unpin([page])
    assert pool.num_free == 2  # still cached
    pool.pin([page])
    assert pool.drop_cache_ref([page]) == 0  # still pinned
    pool.unpin([page])
    assert pool.num_free == 3
    with pytest.raises(AssertionError):
        pool.unpin([page])  # underflow is a bug, never silent


def test_pools_allocate_all_or_nothing() -> None:
    pools = ResourcePools({BASE_KV_PAGES: 2})
    with pytest.raises(KvforgeError):
        pools.allocate({BASE_KV_PAGES: 3})
    assert pools[BASE_KV_PAGES].num_free == 2
    assert pools.to_dict()["draft_kv_pages"] == {"free": 0, "capacity": 0}


# --- planner ----------------------------------------------------------------------------------------

def test_planner_kinds() -> None:
    miss = plan_reuse(10, T, [])
    assert (miss.kind, miss.reuse_tokens, miss.demand[BASE_KV_PAGES]) == (PLAN_NO_REUSABLE_PREFIX, 0, 3)
    hit = plan_reuse(10, T, [7, 3])
    assert (hit.kind, hit.reuse_tokens, hit.hit_pages, hit.demand[BASE_KV_PAGES]) == (PLAN_STANDARD, 8, (7, 3), 1)
    aligned = plan_reuse(8, T, [7, 3])  # fully matched, page aligned: recompute the last page for logits
    assert (aligned.kind, aligned.matched_tokens, aligned.reuse_tokens, aligned.hit_pages) == \
        (PLAN_FULL_INPUT_REWIND, 8, 4, (7,))
    assert aligned.demand[BASE_KV_PAGES] == 1


def test_index_lookup_stops_at_a_hole_and_verifies_tokens() -> None:
    index = BlockIndex()
    ids = np.array(tokens(12), dtype=np.int32)
    keys = page_keys(ids, T, KeyExtras())
    index.insert(keys[0], 5, ids[:4].astype("<i4").tobytes())
    index.insert(keys[2], 6, ids[8:12].astype("<i4").tobytes())
    assert index.lookup_longest(keys, ids, T) == [5]
    forged = BlockIndex()  # a key whose stored tokens differ (a collision) is a miss, never a hit
    forged.insert(keys[0], 5, np.array([9, 9, 9, 9], dtype="<i4").tobytes())
    assert forged.lookup_longest(keys, ids, T) == []


# --- eviction simulation ----------------------------------------------------------------------------

def _record(store: RecordStore, pages: tuple[int, ...]) -> Record:
    record = Record(store.new_id(), tuple(bytes([store._next_id, i]) for i in range(len(pages))), pages,
                    (), KeyExtras())
    store.insert(record)
    return record


def test_eviction_shared_ancestor_needs_several_victims_and_plans_are_read_only() -> None:
    pools = ResourcePools({BASE_KV_PAGES: 3})
    pool = pools[BASE_KV_PAGES]
    pages = pool.allocate(3)
    store = RecordStore()
    a = _record(store, (pages[0], pages[1]))  # two branches sharing ancestor page 0
    b = _record(store, (pages[0], pages[2]))
    pool.add_cache_ref(a.page_ids)
    pool.add_cache_ref(b.page_ids)
    pool.unpin(pages)
    before = (list(pool.active), list(pool.cache), pool.num_free)
    assert plan_eviction({BASE_KV_PAGES: 1}, pools, store.least_recent_first()) == [a.record_id]
    assert plan_eviction({BASE_KV_PAGES: 3}, pools, store.least_recent_first()) == [a.record_id, b.record_id]
    assert plan_eviction({BASE_KV_PAGES: 4}, pools, store.least_recent_first()) is None  # infeasible
    assert (list(pool.active), list(pool.cache), pool.num_free) == before  # nothing changed


def test_eviction_never_reclaims_pinned_pages() -> None:
    pools = ResourcePools({BASE_KV_PAGES: 2})
    pool = pools[BASE_KV_PAGES]
    pages = pool.allocate(2)
    store = RecordStore()
    record = _record(store, tuple(pages))
    pool.add_cache_ref(record.page_ids)
    pool.unpin([pages[1]])  # page 0 stays pinned by an in-flight request
    assert plan_eviction({BASE_KV_PAGES: 2}, pools, store.least_recent_first()) is None
    assert plan_eviction({BASE_KV_PAGES: 1}, pools, store.least_recent_first()) == [record.record_id]


# --- manager ----------------------------------------------------------------------------------------

def make_manager(num_pages: int = 8, max_records: int = 1024) -> ContextCacheManager:
    return ContextCacheManager(num_pages, T, enabled=True, max_records=max_records)


def run_request(manager: ContextCacheManager, ids: list[int], salt: str | None = None,
                lookup: str = "use_cache") -> tuple[int, str]:
    lease = manager.acquire(Admission(ids, KeyExtras(cache_salt=salt), lookup))
    outcome = manager.publish(lease, ids)
    manager.release(lease)
    manager.check_invariants()
    return lease.reuse_tokens, outcome


def test_manager_hit_after_publish_and_salt_isolation() -> None:
    manager = make_manager()
    assert run_request(manager, tokens(10)) == (0, "committed")
    assert run_request(manager, tokens(10) + [50, 51]) == (8, "committed")
    assert run_request(manager, tokens(10), salt="tenant") == (0, "committed")
    assert run_request(manager, tokens(10), salt="tenant")[0] == 8
    assert run_request(manager, tokens(10), salt="other")[0] == 0
    profile = manager.profile()
    assert profile["hit_sequences"] == 2 and profile["admitted_sequences"] == 5


def test_duplicate_publication_touches_instead_of_adding() -> None:
    manager = make_manager()
    run_request(manager, tokens(8, 100))
    run_request(manager, tokens(8, 200))
    assert run_request(manager, tokens(8, 100))[1] == "existing"  # now most recently used
    assert len(manager.records) == 2
    oldest = manager.records.least_recent_first().__next__()
    assert oldest.token_ids[:1] == (200,)


def test_bypass_never_looks_up_or_publishes() -> None:
    manager = make_manager()
    run_request(manager, tokens(8))
    assert run_request(manager, tokens(8), lookup=BYPASS) == (0, "skipped")
    profile = manager.profile()
    assert profile["lookup_bypass_sequences"] == 1
    assert profile["publications"]["attempts"] == 1 and len(manager.records) == 1


def test_record_limit_evicts_lru_and_zero_retains_nothing() -> None:
    manager = make_manager(max_records=2)
    for offset in (0, 100, 200):
        run_request(manager, tokens(4, offset))
    assert len(manager.records) == 2
    assert run_request(manager, tokens(4, 0))[0] == 0  # the first record was the LRU victim
    zero = make_manager(max_records=0)
    run_request(zero, tokens(8))
    assert len(zero.records) == 0 and zero.pages.num_free == zero.pages.capacity
    assert run_request(zero, tokens(8))[0] == 0


def test_eviction_under_pressure_frees_lru_records() -> None:
    manager = make_manager(num_pages=4)
    run_request(manager, tokens(8, 0))  # 2 pages cached
    run_request(manager, tokens(8, 100))  # 2 pages cached: pool full of cache
    run_request(manager, tokens(8, 200))  # needs 2: evicts the LRU record
    assert manager.profile()["records"]["evicted"] == 1
    assert manager.profile()["reclaimed_resources"][BASE_KV_PAGES] == 2
    assert run_request(manager, tokens(8, 100) + [1])[0] == 8  # the newer record survived


def test_hit_that_cannot_get_pages_retries_cold_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """In an attention-only pool a pinned hit never makes a plan infeasible that a cold plan could meet
    (hits are pages the cold plan would need too); snapshot and draft pools can. Force the first try
    to fail and check the retry: cold, no publication, counted."""
    manager = make_manager()
    run_request(manager, tokens(8))
    real_try = manager._try_acquire
    calls = []

    def first_try_fails(plan, extras, may_publish):
        calls.append(plan.kind)
        return None if len(calls) == 1 else real_try(plan, extras, may_publish)

    monkeypatch.setattr(manager, "_try_acquire", first_try_fails)
    lease = manager.acquire(Admission(tokens(8) + [1]))
    assert calls == [PLAN_STANDARD, "bypass"]
    assert lease.forced_cold and lease.reuse_tokens == 0 and not lease.may_publish
    assert manager.publish(lease, tokens(8) + [1]) == "skipped"
    manager.release(lease)
    profile = manager.profile()
    assert profile["forced_cold_sequences"] == 1 and profile["lookup_bypass_sequences"] == 1
    manager.check_invariants()


def test_pool_too_small_fails_cleanly_and_stays_consistent() -> None:
    manager = make_manager(num_pages=3)
    run_request(manager, tokens(8))  # a record holds 2 of 3 pages
    held = manager.acquire(Admission(tokens(8, 500)))  # evicts it, pins 2 pages
    with pytest.raises(KvforgeError, match="maxKVPoolPages"):
        manager.acquire(Admission(tokens(8, 600)))
    manager.check_invariants()
    manager.release(held)
    manager.check_invariants()
    assert manager.pages.num_free == 3


def test_first_committer_owns_the_canonical_page() -> None:
    manager = make_manager()
    first = manager.acquire(Admission(tokens(8)))
    second = manager.acquire(Admission(tokens(8) + [7]))  # same content, computed concurrently
    assert manager.publish(first, tokens(8)) == "committed"
    assert manager.publish(second, tokens(8) + [7]) == "existing"  # same endpoint (8 tokens)
    manager.release(first)
    manager.release(second)
    manager.check_invariants()
    assert manager.pages.num_free == manager.pages.capacity - 2  # second's duplicate pages went back


def test_growth_evicts_and_rolls_nothing_back_on_failure() -> None:
    manager = make_manager(num_pages=3)
    lease = manager.acquire(Admission(tokens(4)))
    manager.grow(lease, 12)
    assert len(lease.page_ids) == 3
    with pytest.raises(KvforgeError, match="decoding"):
        manager.grow(lease, 13)
    assert len(lease.page_ids) == 3
    manager.release(lease)
    manager.check_invariants()


def test_disabled_manager_is_a_plain_allocator() -> None:
    manager = ContextCacheManager(4, T, enabled=False)
    lease = manager.acquire(Admission(tokens(8)))
    assert manager.publish(lease, tokens(8)) == "skipped"
    manager.release(lease)
    assert manager.pages.num_free == 4 and len(manager.index) == 0


def test_negative_record_limit_is_rejected() -> None:
    with pytest.raises(KvforgeError) as info:
        ContextCacheManager(4, T, enabled=True, max_records=-1)
    assert info.value.field == "--contextCacheMaxRecords"
