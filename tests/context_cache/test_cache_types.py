"""The cache's resource types on their own (attention pages, partial tails, recurrent checkpoints), the coordinator's
event listener, and the engine fingerprint at the root of the key chain. No model, no manager unless named."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvforge.contract import profile_schema as schema
from kvforge.runtime.context_cache.eviction import Victim, plan_eviction
from kvforge.runtime.context_cache.keys import (
    CHAIN_ROOT,
    KEY_BYTES,
    EngineFingerprint,
    KeyExtras,
    MediaKey,
    chain_root,
    page_keys,
    tail_page_key,
)
from kvforge.runtime.context_cache.lease import Admission, Lease
from kvforge.runtime.context_cache.manager import ContextCacheManager, Deployment
from kvforge.runtime.context_cache.planner import PlanKind, ReusePlan, plan_cold, plan_reuse
from kvforge.runtime.context_cache.pools import ResourcePool, ResourcePools
from kvforge.runtime.context_cache.protocol import Lookup, Publication, PublishResult
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.context_cache.types.attention_pages import AttentionPages
from kvforge.runtime.context_cache.types.document_inputs import document_input
from kvforge.runtime.context_cache.types.partial_tails import PartialTails, restore_slot, restore_tokens
from kvforge.runtime.context_cache.types.recurrent_checkpoints import (
    RecurrentCheckpoints,
    checkpoint_record,
    restore_recurrent_slot,
)

T = 4


def tokens(n: int, offset: int = 0) -> list[int]:
    return list(range(offset, offset + n))


def lookup(ids: list[int], extras: KeyExtras = KeyExtras(), root: bytes = CHAIN_ROOT) -> Lookup:
    return Lookup(np.asarray(ids, dtype=np.int32), page_keys(ids, T, extras, parent=root), extras)


def lease(page_ids: list[int], keys: list[bytes] | None = None) -> Lease:
    return Lease(KeyExtras(), page_ids, 0, 0, PlanKind.NO_REUSABLE_PREFIX, True, keys=list(keys or []))


def record(record_id: int, ids: list[int], page_ids: tuple[int, ...] = (), *, partial_slot: int | None = None,
           recurrent_slot: int | None = None, extras: KeyExtras = KeyExtras()) -> Record:
    """A record of `ids` as the coordinator would build it: a tail key whenever the endpoint is unaligned and kept."""
    keys = page_keys(ids, T, extras)
    full = len(keys) * T
    exact = partial_slot is not None or recurrent_slot is not None
    tail_key = tail_page_key(keys[-1] if keys else CHAIN_ROOT, ids, full, extras) if exact and len(ids) > full else b""
    covered = ids if tail_key else ids[:full]
    parts = {name: slot for name, slot in ((schema.PARTIAL_KV_SNAPSHOTS, partial_slot),
                                           (schema.RECURRENT_SNAPSHOTS, recurrent_slot)) if slot is not None}
    return Record(record_id, tuple(keys), page_ids, tuple(covered), extras, tail_key, recurrent_slot is not None, parts)


class Copies:
    """A SnapshotCopier that only remembers what it was asked to copy."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def capture_partial(self, page: int, slot: int) -> None:
        self.calls.append(("partial", page, slot))

    def capture_recurrent(self, lease: Lease, slot: int) -> None:
        self.calls.append(("recurrent", id(lease), slot))


# --- AttentionPages ------------------------------------------------------------------------------------------


def test_attention_pages_longest_hit_is_the_indexed_prefix_and_first_committer_wins() -> None:
    pages = AttentionPages(ResourcePool(schema.BASE_KV_PAGES, 8), T, shares_in_flight=True)
    ids = tokens(9)
    first = lookup(ids)
    writer = lease([3, 5, 6], first.keys[:2])
    publication = Publication(first.tokens, first.keys[:2], b"", exact=False)
    pages.project(writer, publication)
    assert publication.page_ids == [3, 5] and pages.index.key_of(5) == first.keys[1]
    # A second writer of the same content projects onto the first one's pages instead of indexing its own.
    other = Publication(first.tokens, first.keys[:2], b"", exact=False)
    pages.project(lease([1, 2, 4]), other)
    assert other.page_ids == [3, 5] and pages.index.key_of(1) == b""
    plan = pages.find_longest_hit(lookup(ids), plan_cold(len(ids), T))
    assert (plan.kind, plan.hit_pages, plan.reuse_tokens, plan.new_pages) == (PlanKind.STANDARD, (3, 5), 8, 1)
    # The same tokens under another salt share nothing; a fully matched aligned input rewinds one page.
    assert pages.find_longest_hit(lookup(ids, KeyExtras(cache_salt="b")), plan_cold(9, T)).hit_pages == ()
    rewound = pages.find_longest_hit(lookup(tokens(8)), plan_cold(8, T))
    assert (rewound.kind, rewound.hit_pages, rewound.matched_tokens) == (PlanKind.FULL_INPUT_REWIND, (3,), 8)
    assert pages.hit_slots(plan) == (3, 5) and pages.publication_slots(publication) == 0


def test_attention_pages_a_collision_stops_the_projection() -> None:
    pages = AttentionPages(ResourcePool(schema.BASE_KV_PAGES, 8), T, shares_in_flight=True)
    found = lookup(tokens(8))
    pages.index.insert(found.keys[1], 7, b"not these tokens")
    publication = Publication(found.tokens, found.keys, b"", exact=False)
    pages.project(lease([0, 1]), publication)
    assert publication.page_ids == [0]  # page 1's key holds other tokens: the record keeps the prefix only


def test_attention_pages_share_in_flight_and_forget_on_release() -> None:
    pages = AttentionPages(ResourcePool(schema.BASE_KV_PAGES, 8), T, shares_in_flight=True)
    ids = tokens(12)
    found = lookup(ids)
    running = lease([0, 1, 2], found.keys)
    pages.register_in_flight(running, indexable_tokens=len(ids))
    assert running.indexable_pages == 3 and list(pages.in_flight) == found.keys
    assert pages.waits_for(lookup(ids)) and not pages.waits_for(lookup(tokens(12, 50)))
    pages.index_computed(running, found.tokens, 2)  # two pages done: findable, no longer in flight
    assert running.indexed_pages == 2 and list(pages.in_flight) == found.keys[2:]
    assert pages.find_longest_hit(lookup(ids + [1]), plan_cold(13, T)).hit_pages == (0, 1)
    assert pages.waits_for(lookup(ids + [1]))  # page 2 is still being computed
    pages.forget_in_flight(running)
    assert not pages.in_flight and running.inflight_keys == []
    # Freed pages leave the index (the pool tells the type), whatever record held them.
    pages.pool.allocate(3)
    pages.pool.unpin([0])
    assert pages.index.key_of(0) == b"" and pages.find_longest_hit(lookup(ids), plan_cold(12, T)).hit_pages == ()


def test_attention_pages_without_in_flight_sharing_announce_nothing() -> None:
    pages = AttentionPages(ResourcePool(schema.BASE_KV_PAGES, 8), T, shares_in_flight=False)
    running = lease([0, 1], lookup(tokens(8)).keys)
    pages.register_in_flight(running, indexable_tokens=8)
    assert not pages.in_flight and running.indexable_pages == 0 and not pages.waits_for(lookup(tokens(8)))


# --- PartialTails --------------------------------------------------------------------------------------------


def test_partial_tails_extend_the_agreed_pages_by_the_longest_matching_tail() -> None:
    copies = Copies()
    tails = PartialTails(ResourcePool(schema.PARTIAL_KV_SNAPSHOTS, 4), T, CHAIN_ROOT, copies)
    short, long = record(1, tokens(5), (3,), partial_slot=0), record(2, tokens(7), (3,), partial_slot=1)
    other = record(3, tokens(4) + [9, 9], (3,), partial_slot=2)  # same parent page, other tail tokens
    for r in (short, long, other):
        tails.on_commit(r)
        assert tails.filed(r)
    ids = tokens(10)
    agreed = plan_reuse(len(ids), T, (3,))
    plan = tails.find_longest_hit(lookup(ids), agreed)
    assert (plan.reuse_tokens, restore_slot(plan), restore_tokens(plan), plan.hit_pages) == (7, 1, 3, (3,))
    assert tails.hit_slots(plan) == (1,) and tails.record_holding(1) is long
    # One token must compute: an input that is exactly the long tail restores all of it but its last token.
    exact = tails.find_longest_hit(lookup(tokens(7)), plan_reuse(7, T, (3,)))
    assert (exact.reuse_tokens, restore_slot(exact), restore_tokens(exact)) == (6, 1, 2)
    # A snapshot serves the prefix of its tail an input shares (here 1 token of `other`'s and the long one's).
    shared = tails.find_longest_hit(lookup(tokens(5) + [7, 7]), plan_reuse(7, T, (3,)))
    assert (shared.reuse_tokens, restore_tokens(shared)) == (5, 1)
    # ... unless a document starts in that page (restored over whole, it would cost the document's pages): then
    # only a whole tail the input extends serves, as before (here `short`'s 1 token instead of 2 of `long`'s).
    ids = tokens(6) + [7]
    assert restore_tokens(tails.find_longest_hit(lookup(ids), plan_reuse(7, T, (3,)))) == 2
    with_document = dataclasses.replace(lookup(ids), inputs=document_input([(6, 1)]))
    assert restore_tokens(tails.find_longest_hit(with_document, plan_reuse(7, T, (3,)))) == 1
    # A tail follows only the pages agreed on: none after a page the plan does not reuse.
    assert restore_slot(tails.find_longest_hit(lookup(ids), plan_reuse(len(ids), T, ()))) is None
    tails.on_evict(long)
    assert tails.record_holding(1) is None and restore_slot(tails.find_longest_hit(lookup(ids), agreed)) == 0
    publication = Publication(np.asarray(tokens(6)), [b"k"], b"t", exact=False,
                              reserved={schema.PARTIAL_KV_SNAPSHOTS: [3]})
    assert tails.publication_slots(publication) == 1 and tails.held(short) == (0,)
    tails.capture(lease([8, 9]), publication)
    assert copies.calls == [("partial", 9, 3)]  # the page after the publication's full pages


def test_partial_tails_without_a_pool_find_nothing_and_capture_nothing() -> None:
    tails = PartialTails(ResourcePool(schema.PARTIAL_KV_SNAPSHOTS, 0), T, CHAIN_ROOT, Copies())
    agreed = plan_reuse(10, T, (3,))
    assert tails.find_longest_hit(lookup(tokens(10)), agreed) is agreed and not tails.captures
    assert not PartialTails(ResourcePool(schema.PARTIAL_KV_SNAPSHOTS, 2), T, CHAIN_ROOT, None).captures


def test_partial_tails_file_a_checkpoints_tail_by_slot_only() -> None:
    """A checkpoint's tail page is restored through its checkpoint, never as a plain tail extending pages."""
    tails = PartialTails(ResourcePool(schema.PARTIAL_KV_SNAPSHOTS, 2), T, CHAIN_ROOT, Copies())
    checkpoint = record(1, tokens(6), (0,), partial_slot=0, recurrent_slot=0)
    tails.on_commit(checkpoint)
    assert tails.filed(checkpoint) and tails.record_holding(0) is checkpoint
    assert restore_slot(tails.find_longest_hit(lookup(tokens(9)), plan_reuse(9, T, (0,)))) is None
    tails.on_evict(checkpoint)
    assert tails.record_holding(0) is None


# --- RecurrentCheckpoints ------------------------------------------------------------------------------------


def checkpoints(records: RecordStore, *, with_pages: bool, copier: Copies | None = None) -> RecurrentCheckpoints:
    return RecurrentCheckpoints(ResourcePool(schema.RECURRENT_SNAPSHOTS, 4), records, T, CHAIN_ROOT,
                                with_pages=with_pages, copier=copier)


def test_recurrent_checkpoints_hit_only_an_exact_checkpoint_shorter_than_the_input() -> None:
    store = RecordStore()
    kind = checkpoints(store, with_pages=False)
    for r in (record(1, tokens(6), recurrent_slot=0), record(2, tokens(8), recurrent_slot=1),
              record(3, tokens(3), recurrent_slot=2)):
        store.insert(r)
        kind.on_commit(r)
    assert kind.lengths_after(page_keys(tokens(4), T, KeyExtras())[0]) == [6]
    assert kind.lengths_after(None) == [3]

    def hit(ids: list[int], extras: KeyExtras = KeyExtras()) -> ReusePlan:
        return kind.find_longest_hit(lookup(ids, extras), plan_cold(len(ids), T, paged=False))

    plan = hit(tokens(12))
    assert (plan.kind, plan.reuse_tokens, restore_recurrent_slot(plan), checkpoint_record(plan)) == \
        (PlanKind.STANDARD, 8, 1, 2)
    assert (plan.hit_pages, plan.new_pages) == ((), 0)  # no KV pages on a pure recurrent deployment
    assert hit(tokens(8)).reuse_tokens == 6  # one token must compute
    assert hit(tokens(7) + [99]).reuse_tokens == 6  # the 8-token checkpoint's tokens differ
    assert restore_recurrent_slot(hit(tokens(12), KeyExtras(cache_salt="x"))) is None  # another tenant: cold
    media = KeyExtras(media=(MediaKey(5, 4, b"img"),))
    assert hit(tokens(12), media).reuse_tokens == 3  # 6 falls inside the span; the page before it has no media
    assert kind.hit_slots(plan) == (1,)
    kind.on_evict(store.remove(2))
    assert hit(tokens(12)).reuse_tokens == 6 and kind.lengths_after(page_keys(tokens(8), T, KeyExtras())[1]) == []


def test_recurrent_checkpoints_never_resume_inside_a_media_span() -> None:
    store = RecordStore()
    kind = checkpoints(store, with_pages=False)
    media = KeyExtras(media=(MediaKey(4, 4, b"img"),))
    for r in (record(1, tokens(6), recurrent_slot=0, extras=media), record(2, tokens(3), recurrent_slot=1,
                                                                          extras=media)):
        store.insert(r)
        kind.on_commit(r)
    plan = kind.find_longest_hit(lookup(tokens(12), media), plan_cold(12, T, paged=False))
    assert plan.reuse_tokens == 3  # 6 falls inside [4, 8): the span is recomputed from before it


def test_hybrid_checkpoints_must_agree_with_the_index_on_their_pages() -> None:
    store = RecordStore()
    copies = Copies()
    kind = checkpoints(store, with_pages=True, copier=copies)
    checkpoint = record(1, tokens(6), (2,), partial_slot=0, recurrent_slot=0)
    store.insert(checkpoint)
    kind.on_commit(checkpoint)
    agreeing = lookup(tokens(9))
    agreeing.page_hits = [2, 5]  # what the attention type found for this input
    tails = PartialTails(ResourcePool(schema.PARTIAL_KV_SNAPSHOTS, 4), T, CHAIN_ROOT, copies, records=store)
    tails.on_commit(checkpoint)  # the checkpoint's tail page is the tails type's part, added to the checkpoint's plan
    plan = tails.find_longest_hit(agreeing, kind.find_longest_hit(agreeing, plan_cold(9, T)))
    assert (plan.reuse_tokens, plan.hit_pages, restore_slot(plan), restore_tokens(plan), plan.new_pages) == \
        (6, (2,), 0, 2, 2)
    disagreeing = lookup(tokens(9))
    disagreeing.page_hits = [4]
    assert restore_recurrent_slot(kind.find_longest_hit(disagreeing, plan_cold(9, T))) is None
    publication = Publication(agreeing.tokens, agreeing.keys[:1], b"t", exact=True,
                              reserved={schema.RECURRENT_SNAPSHOTS: [3]})
    running = lease([2, 7])
    kind.capture(running, publication)
    assert kind.publication_slots(publication) == 1 and copies.calls == [("recurrent", id(running), 3)]


# --- the coordinator's small costs ---------------------------------------------------------------------------


def test_eviction_plan_that_needs_no_victim_never_reads_the_lru_order() -> None:
    store = RecordStore()
    store.insert(record(1, tokens(4), (0,)))
    read = []

    def lru() -> Iterator[Record]:
        read.append(True)
        yield from store.least_recent_first()

    pools = ResourcePools(ResourcePool(schema.BASE_KV_PAGES, 4))
    pools.base_kv_pages.allocate(1)
    assert plan_eviction({schema.BASE_KV_PAGES: 3}, pools, lru()) == [] and not read
    pools.base_kv_pages.allocate(3)
    pools.base_kv_pages.add_cache_ref([0])
    pools.base_kv_pages.unpin([0])
    assert plan_eviction({schema.BASE_KV_PAGES: 1}, pools, lru()) == [Victim(1)] and read


def test_enums_keep_the_profile_keys_and_the_old_strings() -> None:
    assert [kind.value for kind in PlanKind][:3] == [schema.PLAN_STANDARD, schema.PLAN_NO_REUSABLE_PREFIX,
                                                     schema.PLAN_FULL_INPUT_REWIND]
    assert set(schema.PLAN_KINDS) <= {kind.value for kind in PlanKind}
    assert PublishResult.COMMITTED == "committed" and PublishResult.EXISTING == schema.PUBLICATIONS_EXISTING


# --- CacheEvents ---------------------------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def looked_up(self, keys: Sequence[bytes], hit_pages: int) -> None:
        self.events.append(("looked_up", (list(keys), hit_pages)))

    def committed(self, record: Record) -> None:
        self.events.append(("committed", record))

    def evicted(self, record: Record) -> None:
        self.events.append(("evicted", record))


def test_events_fire_once_per_lookup_commit_and_eviction() -> None:
    heard = Recorder()
    m = ContextCacheManager(3, T, enabled=True, max_records=1, events=heard)
    ids = tokens(8)
    first = m.try_acquire(Admission(ids))
    assert first is not None and heard.events == [("looked_up", (page_keys(ids, T, KeyExtras()), 0))]
    assert m.publish(first, ids) is PublishResult.COMMITTED
    m.release(first)
    [record] = m.records.least_recent_first()
    assert heard.events[1:] == [("committed", record)]
    second = m.try_acquire(Admission(ids + [1]))
    assert second is not None and heard.events[2:] == [("looked_up", (page_keys(ids, T, KeyExtras()), 2))]
    assert m.publish(second, ids + [1]) is PublishResult.EXISTING  # same full pages, no tail pool: touched
    m.release(second)
    assert len(heard.events) == 3  # nothing committed, nothing evicted
    # A new record over max_records evicts the old one.
    third = m.try_acquire(Admission(tokens(4, 100)))
    assert third is not None and m.publish(third, tokens(4, 100)) is PublishResult.COMMITTED
    m.release(third)
    [newest] = m.records.least_recent_first()
    assert [name for name, _ in heard.events[3:]] == ["looked_up", "committed", "evicted"]
    assert heard.events[4] == ("committed", newest) and heard.events[5] == ("evicted", record)
    m.check_invariants()


def test_events_hear_checkpoint_commits_and_evictions_on_a_pure_recurrent_deployment() -> None:
    heard = Recorder()
    copies = Copies()
    m = ContextCacheManager(0, T, enabled=True, recurrent_snapshot_slots=1, deployment=Deployment.PURE_RECURRENT,
                            copier=copies, events=heard)
    for ids in (tokens(6), tokens(6, 50)):
        running = m.try_acquire(Admission(ids))
        assert running is not None and m.publish(running, ids) is PublishResult.COMMITTED
        m.release(running)
    # One slot: the second checkpoint's reservation evicted the first before it was committed.
    names = [name for name, _ in heard.events]
    assert names == ["looked_up", "committed", "looked_up", "evicted", "committed"]
    assert heard.events[3][1] is heard.events[1][1] and heard.events[4][1] is next(m.records.least_recent_first())
    m.check_invariants()


# --- the engine fingerprint ----------------------------------------------------------------------------------


FINGERPRINT = EngineFingerprint("sha256:weights", "float16", T, "attention*24")


def test_chain_root_is_the_constant_without_a_fingerprint_and_a_digest_of_every_field_with_one() -> None:
    assert chain_root(None) == CHAIN_ROOT
    root = chain_root(FINGERPRINT)
    assert len(root) == KEY_BYTES and root != CHAIN_ROOT and chain_root(dataclasses.replace(FINGERPRINT)) == root
    changed = [dataclasses.replace(FINGERPRINT, weights_digest="sha256:other"),
               dataclasses.replace(FINGERPRINT, kv_cache_dtype="fp8"),
               dataclasses.replace(FINGERPRINT, tokens_per_page=2 * T),
               dataclasses.replace(FINGERPRINT, layer_layout="attention*12"),
               dataclasses.replace(FINGERPRINT, chain_version=2)]
    assert len({root, *(chain_root(f) for f in changed)}) == 1 + len(changed)
    # Length prefixes: moving characters between fields never gives the same root.
    assert chain_root(EngineFingerprint("ab", "c", T, "x")) != chain_root(EngineFingerprint("a", "bc", T, "x"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        FINGERPRINT.chain_version = 3  # type: ignore[misc]


def cached(deployment: Deployment, root: bytes, ids: list[int]) -> ContextCacheManager:
    """A manager keyed from `root` that has published `ids`."""
    m = ContextCacheManager(16, T, enabled=True, partial_kv_snapshot_slots=2, recurrent_snapshot_slots=2,
                            deployment=deployment, copier=Copies(), chain_root=root)
    writer = m.try_acquire(Admission(list(ids)))
    assert writer is not None and m.publish(writer, ids) is PublishResult.COMMITTED
    m.release(writer)
    m.check_invariants()  # the audit derives every key from the manager's own root
    return m


@pytest.mark.parametrize("deployment", [Deployment.VANILLA, Deployment.HYBRID])
def test_managers_with_different_roots_never_hit_each_others_pages(deployment: Deployment) -> None:
    """Two engines publishing the same tokens file them under different keys, so a store they shared (a tier
    between processes) would never serve one's K/V to the other; the same root gives the same keys."""
    ids = tokens(10)
    root, other_root = chain_root(FINGERPRINT), chain_root(dataclasses.replace(FINGERPRINT, kv_cache_dtype="fp8"))
    m = cached(deployment, root, ids)
    [published] = m.records.least_recent_first()
    assert published.terminal_key == next(cached(deployment, root, ids).records.least_recent_first()).terminal_key
    assert published.terminal_key != next(cached(deployment, other_root, ids).records.least_recent_first()).terminal_key
    assert set(published.keys).isdisjoint(page_keys(ids, T, KeyExtras(), parent=other_root))
    # Every type this deployment has, asked with the other engine's keys for the same tokens, finds nothing.
    for kind in m.types:
        assert kind.find_longest_hit(lookup(ids + [1], root=other_root), plan_cold(11, T)).reuse_tokens == 0
    assert m.attention is not None and m.attention.matching_pages(lookup(ids + [1], root=other_root)) == []
    reader = m.try_acquire(Admission(ids + [1]))  # under its own root the manager hits: pages and the tail
    assert reader is not None and reader.reuse_tokens == len(ids)
    m.release(reader)
    m.check_invariants()
