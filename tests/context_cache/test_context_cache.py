"""The context cache alone, no model: keys, pools, planner, eviction simulation and the manager."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.context_cache.eviction import Victim, plan_eviction
from kvforge.runtime.context_cache.index import PageIndex
from kvforge.runtime.context_cache.keys import KeyExtras, page_keys
from kvforge.runtime.context_cache.manager import Admission, ContextCacheManager, Lease
from kvforge.runtime.context_cache.planner import (
    PLAN_FULL_INPUT_REWIND,
    PLAN_NO_REUSABLE_PREFIX,
    PLAN_STANDARD,
    plan_reuse,
)
from kvforge.runtime.context_cache.pools import BASE_KV_PAGES, ResourcePool, ResourcePools
from kvforge.runtime.context_cache.protocol import PublishResult
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.context_cache.types.partial_tails import restore_slot, restore_tokens
from kvforge.runtime.types import LookupPolicy

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


def test_pool_refuses_to_overallocate_and_profile_lists_every_pool_key() -> None:
    pool = ResourcePool(BASE_KV_PAGES, 2)
    assert not pool.can_allocate(3)
    with pytest.raises(AssertionError):  # callers ask first; over-allocation is a bug, not a user error
        pool.allocate(3)
    assert pool.num_free == 2
    profile = ContextCacheManager(2, T, enabled=True).profile()
    assert profile["resource_pools"]["draft_kv_pages"] == {"free": 0, "capacity": 0}
    assert profile["resource_pools"][BASE_KV_PAGES] == {"free": 2, "capacity": 2}


# --- planner ----------------------------------------------------------------------------------------

def test_planner_kinds() -> None:
    miss = plan_reuse(10, T, [])
    assert (miss.kind, miss.reuse_tokens, miss.new_pages) == (PLAN_NO_REUSABLE_PREFIX, 0, 3)
    hit = plan_reuse(10, T, [7, 3])
    assert (hit.kind, hit.reuse_tokens, hit.hit_pages, hit.new_pages) == (PLAN_STANDARD, 8, (7, 3), 1)
    aligned = plan_reuse(8, T, [7, 3])  # fully matched, page aligned: recompute the last page for logits
    assert (aligned.kind, aligned.matched_tokens, aligned.reuse_tokens, aligned.hit_pages) == \
        (PLAN_FULL_INPUT_REWIND, 8, 4, (7,))
    assert aligned.new_pages == 1


def test_index_lookup_stops_at_a_hole_and_verifies_tokens() -> None:
    index = PageIndex()
    ids = np.array(tokens(12), dtype=np.int32)
    keys = page_keys(ids, T, KeyExtras())
    index.insert(keys[0], 5, ids[:4].astype("<i4").tobytes())
    index.insert(keys[2], 6, ids[8:12].astype("<i4").tobytes())
    assert index.lookup_longest(keys, ids, T) == [5]
    forged = PageIndex()  # a key whose stored tokens differ (a collision) is a miss, never a hit
    forged.insert(keys[0], 5, np.array([9, 9, 9, 9], dtype="<i4").tobytes())
    assert forged.lookup_longest(keys, ids, T) == []


# --- eviction simulation ----------------------------------------------------------------------------

def _record(store: RecordStore, pages: tuple[int, ...]) -> Record:
    record = Record(store.new_id(), tuple(bytes([store._next_id, i]) for i in range(len(pages))), pages,
                    (), KeyExtras())
    store.insert(record)
    return record


def test_eviction_shared_ancestor_needs_several_victims_and_plans_are_read_only() -> None:
    pools = ResourcePools(ResourcePool(BASE_KV_PAGES, 3))
    pool = pools.base_kv_pages
    pages = pool.allocate(3)
    store = RecordStore()
    a = _record(store, (pages[0], pages[1]))  # two branches sharing ancestor page 0
    b = _record(store, (pages[0], pages[2]))
    pool.add_cache_ref(a.page_ids)
    pool.add_cache_ref(b.page_ids)
    pool.unpin(pages)
    before = (list(pool.active), list(pool.cache), pool.num_free)
    assert plan_eviction({BASE_KV_PAGES: 1}, pools, store.least_recent_first()) == [Victim(a.record_id)]
    assert plan_eviction({BASE_KV_PAGES: 3}, pools, store.least_recent_first()) == [
        Victim(a.record_id), Victim(b.record_id)]
    assert plan_eviction({BASE_KV_PAGES: 4}, pools, store.least_recent_first()) is None  # infeasible
    assert (list(pool.active), list(pool.cache), pool.num_free) == before  # nothing changed


def test_eviction_takes_only_the_parts_a_type_lets_go_alone() -> None:
    """Issue 53: where every short pool a record holds may lose its part alone (a window checkpoint), the plan takes
    only that part; a record also short of base pages goes whole, and without `alone` every victim is whole."""
    window = "sliding_window_pages"
    pools = ResourcePools(ResourcePool(BASE_KV_PAGES, 2), ResourcePool(window, 2))
    store = RecordStore()
    record = _record(store, tuple(pools[BASE_KV_PAGES].allocate(2)))
    checkpoint = pools[window].allocate(2)
    for name, slots in ((BASE_KV_PAGES, record.page_ids), (window, checkpoint)):
        pools[name].add_cache_ref(slots)
        pools[name].unpin(slots)

    def held(r: Record) -> dict[str, tuple[int, ...]]:
        return {BASE_KV_PAGES: r.page_ids, window: tuple(checkpoint)}

    lru = store.least_recent_first
    assert plan_eviction({window: 1}, pools, lru(), held_by=held, alone={window}) == [
        Victim(record.record_id, frozenset({window}))]
    assert plan_eviction({window: 1}, pools, lru(), held_by=held) == [Victim(record.record_id)]
    assert plan_eviction({window: 1, BASE_KV_PAGES: 1}, pools, lru(), held_by=held, alone={window}) == [
        Victim(record.record_id)]


def test_eviction_never_reclaims_pinned_pages() -> None:
    pools = ResourcePools(ResourcePool(BASE_KV_PAGES, 2))
    pool = pools.base_kv_pages
    pages = pool.allocate(2)
    store = RecordStore()
    record = _record(store, tuple(pages))
    pool.add_cache_ref(record.page_ids)
    pool.unpin([pages[1]])  # page 0 stays pinned by an in-flight request
    assert plan_eviction({BASE_KV_PAGES: 2}, pools, store.least_recent_first()) is None
    assert plan_eviction({BASE_KV_PAGES: 1}, pools, store.least_recent_first()) == [Victim(record.record_id)]


# --- manager ----------------------------------------------------------------------------------------

def make_manager(num_pages: int = 8, max_records: int = 1024) -> ContextCacheManager:
    return ContextCacheManager(num_pages, T, enabled=True, max_records=max_records)


def acquire(manager: ContextCacheManager, ids: list[int], **admission: object) -> Lease:
    lease = manager.try_acquire(Admission(ids, **admission))  # type: ignore[arg-type]
    assert lease is not None
    return lease


def run_request(manager: ContextCacheManager, ids: list[int], salt: str | None = None,
                lookup: LookupPolicy = LookupPolicy.USE_CACHE) -> tuple[int, PublishResult]:
    lease = acquire(manager, ids, extras=KeyExtras(cache_salt=salt), lookup_policy=lookup)
    outcome = manager.publish(lease, ids)
    manager.release(lease)
    manager.check_invariants()
    return lease.reuse_tokens, outcome


def test_manager_hit_after_publish_and_salt_isolation() -> None:
    manager = make_manager()
    assert run_request(manager, tokens(10)) == (0, PublishResult.COMMITTED)
    assert run_request(manager, tokens(10) + [50, 51]) == (8, PublishResult.COMMITTED)
    assert run_request(manager, tokens(10), salt="tenant") == (0, PublishResult.COMMITTED)
    assert run_request(manager, tokens(10), salt="tenant")[0] == 8
    assert run_request(manager, tokens(10), salt="other")[0] == 0
    profile = manager.profile()
    assert profile["hit_sequences"] == 2 and profile["admitted_sequences"] == 5


def test_duplicate_publication_touches_instead_of_adding() -> None:
    manager = make_manager()
    run_request(manager, tokens(8, 100))
    run_request(manager, tokens(8, 200))
    assert run_request(manager, tokens(8, 100))[1] == PublishResult.EXISTING  # now most recently used
    assert len(manager.records) == 2
    oldest = manager.records.least_recent_first().__next__()
    assert oldest.token_ids[:1] == (200,)


def test_bypass_never_looks_up_or_publishes() -> None:
    manager = make_manager()
    run_request(manager, tokens(8))
    assert run_request(manager, tokens(8), lookup=LookupPolicy.BYPASS) == (0, PublishResult.SKIPPED)
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

    def first_try_fails(plan, extras, may_publish, speculative=False):
        calls.append(plan.kind)
        return None if len(calls) == 1 else real_try(plan, extras, may_publish, speculative)

    monkeypatch.setattr(manager, "_try_acquire", first_try_fails)
    lease = acquire(manager, tokens(8) + [1])
    assert calls == [PLAN_STANDARD, "bypass"]
    assert lease.forced_cold and lease.reuse_tokens == 0 and not lease.may_publish
    assert manager.publish(lease, tokens(8) + [1]) == PublishResult.SKIPPED
    manager.release(lease)
    profile = manager.profile()
    assert profile["forced_cold_sequences"] == 1 and profile["lookup_bypass_sequences"] == 1
    manager.check_invariants()


def test_full_pool_answers_none_and_stays_consistent() -> None:
    manager = make_manager(num_pages=3)
    run_request(manager, tokens(8))  # a record holds 2 of 3 pages
    held = acquire(manager, tokens(8, 500))  # evicts it, pins 2 pages
    before = manager.profile()
    assert manager.try_acquire(Admission(tokens(8, 600))) is None  # the scheduler makes it wait
    after = manager.profile()
    before.pop("planning_nanoseconds"), after.pop("planning_nanoseconds")  # asking costs time, nothing else
    assert after == before  # nothing counted, nothing changed
    assert manager.fits_alone(12) and not manager.fits_alone(13)
    manager.check_invariants()
    manager.release(held)
    manager.check_invariants()
    assert manager.pages.num_free == 3


def test_first_committer_owns_the_canonical_page() -> None:
    manager = make_manager()
    first = acquire(manager, tokens(8))
    assert manager.prefix_in_flight(Admission(tokens(8) + [7]))  # the scheduler would make it wait...
    second = acquire(manager, tokens(8) + [7])  # ...but computed concurrently anyway, it still works
    assert manager.publish(first, tokens(8)) == PublishResult.COMMITTED
    assert manager.publish(second, tokens(8) + [7]) == PublishResult.EXISTING  # same endpoint (8 tokens)
    manager.release(first)
    manager.release(second)
    manager.check_invariants()
    assert manager.pages.num_free == manager.pages.capacity - 2  # second's duplicate pages went back


def test_growth_evicts_and_rolls_nothing_back_on_failure() -> None:
    manager = make_manager(num_pages=3)
    lease = acquire(manager, tokens(4))
    assert manager.try_grow(lease, 12)
    assert len(lease.page_ids) == 3
    assert not manager.try_grow(lease, 13)  # the scheduler preempts someone and retries
    assert len(lease.page_ids) == 3
    manager.release(lease)
    manager.check_invariants()


def test_disabled_manager_is_a_plain_allocator() -> None:
    manager = ContextCacheManager(4, T, enabled=False)
    lease = acquire(manager, tokens(8))
    assert manager.publish(lease, tokens(8)) == PublishResult.SKIPPED
    manager.release(lease)
    assert manager.pages.num_free == 4 and len(manager.index) == 0


def test_negative_record_limit_is_rejected() -> None:
    with pytest.raises(KvforgeError) as info:
        ContextCacheManager(4, T, enabled=True, max_records=-1)
    assert info.value.field == "context_cache_max_records"


def test_pages_computed_in_flight_are_hits_and_leave_with_an_unpublished_lease() -> None:
    manager = make_manager(num_pages=12)
    document = tokens(12)
    owner = acquire(manager, document + [90, 91])
    manager.index_computed(owner, document + [90, 91], 8)  # the first chunk (two pages) is done
    waiting = Admission(document + [70])
    assert manager.prefix_in_flight(waiting)  # page 2 is still being computed: wait for it
    manager.index_computed(owner, document + [90, 91], 14)
    assert not manager.prefix_in_flight(waiting)
    reader = acquire(manager, document + [70])
    assert reader.reuse_tokens == 12 and reader.page_ids[:3] == owner.page_ids[:3]
    manager.check_invariants()
    manager.release(owner)  # aborted: never published, but the reader still holds the shared pages
    manager.check_invariants()
    assert len(manager.records) == 0 and len(manager.index) == 3
    manager.release(reader)
    manager.check_invariants()
    assert len(manager.index) == 0 and manager.pages.num_free == 12  # nothing published, nothing left


def test_generated_tokens_are_not_indexed_in_flight() -> None:
    manager = make_manager()
    prompt = tokens(5)
    lease = manager.try_acquire(Admission(prompt + [50, 51, 52], indexable_tokens=len(prompt)))
    assert lease is not None
    manager.index_computed(lease, prompt + [50, 51, 52], 8)
    assert len(manager.index) == 1  # only the prompt's full page
    manager.release(lease)
    manager.check_invariants()


# --- partial-KV snapshots (token-exact reuse) -------------------------------------------------------

class SnapshotCopies:
    """Stands in for the runner's snapshot store: remembers which page each slot was captured from."""

    def __init__(self) -> None:
        self.captured: dict[int, int] = {}

    def capture_partial(self, page: int, slot: int) -> None:
        self.captured[slot] = page

    def capture_recurrent(self, lease: Lease, slot: int) -> None:
        raise AssertionError("an attention-only cache never captures a recurrent state")


def snapshot_manager(slots: int, num_pages: int = 8, max_records: int = 1024) -> ContextCacheManager:
    return ContextCacheManager(num_pages, T, enabled=True, max_records=max_records, partial_kv_snapshot_slots=slots,
                               copier=SnapshotCopies())


def run_restoring(manager: ContextCacheManager, ids: list[int], salt: str | None = None) -> Lease:
    """Admit, restore (as the engine would), publish the whole input and release."""
    lease = acquire(manager, ids, extras=KeyExtras(cache_salt=salt))
    manager.check_invariants()  # a pending restore pins its snapshot
    manager.finish_restore(lease)
    manager.publish(lease, ids)
    manager.release(lease)
    manager.check_invariants()
    return lease


def test_the_snapshot_an_admission_extends_is_never_its_own_eviction_victim() -> None:
    """The record whose tail snapshot an admission restores is LRU-first among the victims its new pages need: it
    must stay (its pages are pinned hits, so evicting it frees nothing), and a newer record goes instead."""
    manager = snapshot_manager(slots=2, num_pages=6)
    run_restoring(manager, tokens(10))  # A: 2 full pages + a snapshot tail, the least recently used record
    run_restoring(manager, tokens(8, offset=100))  # B: 2 more pages; 2 of 6 free
    lease = acquire(manager, tokens(10) + [99] * 11)  # 6 pages: A's 2 hits + 4 new
    assert lease.reuse_tokens == 10 and restore_slot(lease) is not None
    assert manager.metrics.records_evicted == 1 and len(manager.records) == 1  # B, not A
    manager.finish_restore(lease)
    manager.release(lease)
    manager.check_invariants()


def test_snapshot_extends_reuse_to_the_exact_token() -> None:
    manager = snapshot_manager(slots=2)
    first = run_restoring(manager, tokens(10))  # 2 full pages + a 2-token tail: captured
    copies = manager.copier
    assert isinstance(copies, SnapshotCopies)
    [(slot, page)] = copies.captured.items()
    assert page == first.page_ids[2]  # the page that held the tail
    second = acquire(manager, tokens(10) + [50, 51])
    assert (second.reuse_tokens, second.matched_tokens) == (10, 10)
    assert (restore_slot(second), restore_tokens(second)) == (slot, 2)
    assert second.page_ids[:2] == first.page_ids[:2] and second.page_ids[2] != first.page_ids[2]  # its own page
    assert manager.partial_snapshots.active[slot] == 1  # pinned until the engine copied it
    manager.finish_restore(second)
    assert manager.partial_snapshots.active[slot] == 0
    manager.release(second)
    profile = manager.profile()
    assert profile["hybrid"] == {"restores": 1, "snapshot_pressure_skips": 0, "capture_synchronizations": 1}
    assert profile["resource_pools"]["partial_kv_snapshots"] == {"free": 1, "capacity": 2}
    assert profile["plans"]["standard"] == 1 and profile["reused_tokens"] == 10
    manager.check_invariants()


def test_snapshot_of_a_prompt_shorter_than_a_page_and_its_isolation() -> None:
    manager = snapshot_manager(slots=4)
    run_restoring(manager, tokens(3))  # no full page at all: a record holding only a snapshot
    assert len(manager.records) == 1 and manager.pages.num_free == manager.pages.capacity
    assert run_restoring(manager, tokens(3) + [9]).reuse_tokens == 3
    assert run_restoring(manager, tokens(3) + [9], salt="tenant").reuse_tokens == 0  # salt: another chain
    assert run_restoring(manager, [1, 1, 2, 7]).reuse_tokens == 0  # different tokens
    assert run_restoring(manager, tokens(3)).reuse_tokens == 2  # the whole input: all but the token to compute
    assert run_restoring(manager, tokens(2) + [9]).reuse_tokens == 2  # the tail's prefix it shares, to the token
    assert run_restoring(manager, tokens(2) + [9], salt="tenant").reuse_tokens == 0  # a prefix is isolated too
    manager.check_invariants()


def test_a_snapshot_serves_the_prefix_an_input_shares_and_restores_the_page() -> None:
    """A shared system prompt: the first request's tail snapshot holds it and its own question; the second request
    shares only the system prompt's tokens and restores exactly those (the rest of the page is computed over)."""
    manager = snapshot_manager(slots=2)
    first = run_restoring(manager, tokens(7))  # 1 full page + a 3-token tail: captured
    copies = manager.copier
    assert isinstance(copies, SnapshotCopies)
    [(slot, _)] = copies.captured.items()
    second = acquire(manager, tokens(5) + [40, 41, 42])  # page 0 and 1 of the tail's 3 tokens shared
    assert (second.reuse_tokens, restore_slot(second), restore_tokens(second)) == (5, slot, 1)
    assert second.page_ids[0] == first.page_ids[0] and second.page_ids[1] != first.page_ids[1]  # its own tail page
    manager.finish_restore(second)
    manager.release(second)
    manager.check_invariants()


def test_page_aligned_fully_matched_input_rewinds_into_a_snapshot() -> None:
    manager = snapshot_manager(slots=2)
    run_restoring(manager, tokens(6))  # page 0 + 2-token tail
    run_restoring(manager, tokens(8))  # both pages indexed
    lease = acquire(manager, tokens(8))  # aligned and fully matched: rewind page 1, then restore its tail
    assert (lease.plan_kind, lease.reuse_tokens, restore_tokens(lease)) == (PLAN_FULL_INPUT_REWIND, 6, 2)
    manager.finish_restore(lease)
    manager.release(lease)
    manager.check_invariants()


def test_evicting_a_record_frees_its_snapshot_slot() -> None:
    manager = snapshot_manager(slots=4, max_records=2)
    for offset in (0, 100, 200):
        run_restoring(manager, tokens(6, offset))
    assert len(manager.records) == 2
    profile = manager.profile()
    assert profile["resource_pools"]["partial_kv_snapshots"] == {"free": 2, "capacity": 4}
    assert profile["reclaimed_resources"]["partial_kv_snapshots"] == 1
    assert profile["reclaimed_resources"][BASE_KV_PAGES] == 1


def test_tight_budget_evicts_the_lru_snapshot_record_not_plain_ones() -> None:
    manager = snapshot_manager(slots=1, num_pages=12)
    run_restoring(manager, tokens(8, 500))  # page-aligned: no snapshot, oldest record
    run_restoring(manager, tokens(6, 0))  # takes the only slot
    run_restoring(manager, tokens(6, 100))  # needs it: evicts the 0 record only
    assert {r.token_ids[0] for r in manager.records.least_recent_first()} == {500, 100}
    assert run_restoring(manager, tokens(6, 100) + [1]).reuse_tokens == 6
    assert run_restoring(manager, tokens(8, 500) + [1]).reuse_tokens == 8


def test_capture_without_a_free_slot_is_skipped_and_counted() -> None:
    manager = snapshot_manager(slots=1)
    run_restoring(manager, tokens(6))
    pending = acquire(manager, tokens(6) + [7])  # restores the only slot: pinned until finish_restore
    other = acquire(manager, tokens(10, 100))
    assert manager.publish(other, tokens(10, 100)) == PublishResult.COMMITTED  # full pages only: never an error
    manager.release(other)
    profile = manager.profile()
    assert profile["hybrid"]["snapshot_pressure_skips"] == 1
    assert len(manager.records) == 2
    short = acquire(manager, tokens(3, 300))
    assert manager.publish(short, tokens(3, 300)) == PublishResult.SKIPPED  # no full page and no slot: nothing to keep
    manager.release(short)
    manager.finish_restore(pending)
    manager.release(pending)
    manager.check_invariants()
    assert manager.profile()["hybrid"]["snapshot_pressure_skips"] == 2


def test_released_lease_unpins_a_snapshot_it_never_restored() -> None:
    manager = snapshot_manager(slots=1)
    run_restoring(manager, tokens(6))
    lease = acquire(manager, tokens(6) + [7])
    manager.release(lease)  # aborted before its first step
    manager.check_invariants()
    assert manager.partial_snapshots.active == [0] and manager.profile()["hybrid"]["restores"] == 0


def test_disabled_manager_has_no_snapshot_slots() -> None:
    manager = ContextCacheManager(4, T, enabled=False, partial_kv_snapshot_slots=3)
    assert manager.partial_snapshots.capacity == 0


def test_a_full_input_rewind_announces_no_in_flight_page_that_is_indexed() -> None:
    """The rewound page is recomputed privately but its key is findable already: announcing it as in flight left a
    stale key (found by the model-free engine test: two identical one-page prompts, the second admitted after the
    first's page was indexed)."""
    manager = ContextCacheManager(8, T, enabled=True)
    first = acquire(manager, tokens(T))
    manager.index_computed(first, tokens(T), T)
    second = acquire(manager, tokens(T))
    assert second.plan_kind == "full_input_rewind" and second.reuse_tokens == 0
    assert not manager.in_flight
    manager.check_invariants()
    manager.release(second)
    manager.release(first)
    manager.check_invariants()


def test_a_publication_that_indexes_a_page_in_flight_ends_its_announcement() -> None:
    """A finished answer published with the same content as a page another request is computing (a chat turn that
    extends a still-running answer) makes that page findable: it is no longer announced as in flight."""
    manager = ContextCacheManager(8, T, enabled=True)
    extending = acquire(manager, tokens(2 * T))  # announces both its pages
    assert len(manager.in_flight) == 2
    running = acquire(manager, tokens(2 * T, offset=100))  # other content: no hit, its own pages
    manager.publish(running, tokens(2 * T, offset=100))
    publisher = acquire(manager, tokens(T) + [7] * T, indexable_tokens=T)
    assert publisher.reuse_tokens == 0  # the page is in flight, not indexed: nothing to hit yet
    manager.publish(publisher, tokens(T) + [7] * T)
    assert list(manager.in_flight) == [extending.keys[1]]  # page 0 is findable now
    manager.check_invariants()
    for lease in (publisher, running, extending):
        manager.release(lease)
    manager.check_invariants()
