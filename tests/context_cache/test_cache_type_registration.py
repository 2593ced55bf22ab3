"""A cache type added by one class and one registration, here in the test alone: the coordinator needs no edit."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from kvforge.runtime.context_cache.lease import Admission, Lease, Prerequisite
from kvforge.runtime.context_cache.manager import ContextCacheManager
from kvforge.runtime.context_cache.metrics import CounterBlock, Sample
from kvforge.runtime.context_cache.planner import ReusePlan, plan_resume
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import CacheSetup, CacheTypeBase, Lookup, Publication, PublishResult
from kvforge.runtime.context_cache.records import Record
from kvforge.runtime.context_cache.registry import Registration, register, registered, unregister
from kvforge.runtime.context_cache.types.draft_paths import draft_page_ids
from kvforge.runtime.context_cache.types.partial_tails import partial_slot, restore_slot, restore_tokens
from kvforge.runtime.context_cache.types.recurrent_checkpoints import recurrent_slot

T = 4
NAME = "marker_slots"  # a pool no schema lists: the coordinator must not care
BLOCK = "markers"  # its counters' profile block, which no schema lists either


def marker_samples(cache: Mapping[str, Any]) -> Iterator[Sample]:
    yield Sample("counter", "markers_kept", "Records that kept a marker slot.", cache[BLOCK]["kept"])


COUNTERS = CounterBlock(BLOCK, ("kept", "dropped"), marker_samples)


class MarkerSlots(CacheTypeBase):
    """A trivial type: every record holds one slot of its own pool (a counter of what is kept), so the coordinator's
    reservation, commit, eviction and audit all have something of this type to get right."""

    __slots__ = ("name", "pool", "committed", "evicted", "counts")

    def __init__(self, pool: ResourcePool) -> None:
        self.name = pool.name
        self.pool = pool
        self.committed: list[int] = []
        self.evicted: list[int] = []
        self.counts = COUNTERS.zeros()

    def counters(self) -> dict[str, int]:
        return self.counts

    # Its request input (`inputs[NAME]`, a dict here): "cold" refuses every hit; "first" asks for the input's first
    # tokens to be computed alone beforehand (a prerequisite, as documents ask for their standalone prefills).
    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        cold = lookup.inputs.get(NAME, {}).get("cold")
        return plan_resume(len(lookup.tokens), T, paged=True) if cold else agreed

    def prerequisites(self, admission: Admission) -> list[Prerequisite]:
        first = admission.inputs.get(NAME, {}).get("first", 0)
        return [Prerequisite(bytes(admission.token_ids[:first]), 0, first, {NAME: {"produced": True}})] if first else []

    def publication_slots(self, publication: Publication) -> int:
        return 1

    def record_part(self, publication: Publication) -> int | None:
        slots = publication.reserved.get(self.name)
        return slots[0] if slots else None

    def held(self, record: Record) -> tuple[int, ...]:
        slot = record.parts.get(self.name)
        return () if slot is None else (slot,)

    def on_commit(self, record: Record) -> None:
        self.committed.append(record.record_id)
        self.counts["kept"] += NAME in record.parts

    def on_evict(self, record: Record) -> None:
        self.evicted.append(record.record_id)
        self.counts["dropped"] += 1


def build(setup: CacheSetup, name: str) -> MarkerSlots:
    return MarkerSlots(ResourcePool(name, int(setup.options.get(NAME, 0)) if setup.enabled else 0))


def marker(m: ContextCacheManager) -> MarkerSlots:
    [kind] = [kind for kind in m.types if isinstance(kind, MarkerSlots)]
    return kind


def run(m: ContextCacheManager, ids: list[int]) -> tuple[Lease, PublishResult]:
    lease = m.try_acquire(Admission(ids))
    assert lease is not None
    result = m.publish(lease, ids)
    m.release(lease)
    m.check_invariants()
    return lease, result


def test_a_registered_type_takes_part_in_commits_evictions_and_audits() -> None:
    types = (*registered(), Registration(NAME, build, (NAME,), COUNTERS))
    m = ContextCacheManager(16, T, enabled=True, types=types, marker_slots=2)
    kind = marker(m)
    assert m.profile()["resource_pools"][NAME] == {"free": 2, "capacity": 2}
    documents = [list(range(start, start + 8)) for start in (0, 100, 200)]
    for ids in documents:
        assert run(m, ids)[1] is PublishResult.COMMITTED
    # Two slots: the third publication evicted the least recently used record to reserve its marker.
    first, second, third = 1, 2, 3  # record ids, in publication order
    assert kind.committed == [first, second, third] and kind.evicted == [first]
    assert [r.record_id for r in m.records.least_recent_first()] == [second, third]
    assert sorted(kind.held(r)[0] for r in m.records.least_recent_first()) == [0, 1]
    assert m.profile()["reclaimed_resources"][NAME] == 1
    assert m.profile()[BLOCK] == {"kept": 3, "dropped": 1}  # its own counters, as its own profile block
    # Reuse answers are what they are without the type: the surviving document's pages are a hit.
    lease, result = run(m, documents[2] + [1])
    assert lease.reuse_tokens == 8 and result is PublishResult.EXISTING


def test_a_type_without_a_slot_to_keep_loses_only_its_part() -> None:
    """Capacity 0: a publication cannot reserve the type's slot, so a plain record keeps only its pages (counted)."""
    types = (*registered(), Registration(NAME, build, (NAME,)))
    m = ContextCacheManager(16, T, enabled=True, types=types)
    _, result = run(m, list(range(8)))
    assert result is PublishResult.COMMITTED and m.profile()["hybrid"]["snapshot_pressure_skips"] == 1
    [record] = m.records.least_recent_first()
    assert NAME not in record.parts and marker(m).held(record) == () and len(record.page_ids) == 2


def test_register_adds_a_type_to_every_new_manager_until_unregistered() -> None:
    from kvforge.runtime.engine import cache_samples  # what llm_serve's /metrics iterates

    entry = register(NAME, build, (NAME,), counters=COUNTERS)
    try:
        m = ContextCacheManager(16, T, enabled=True, marker_slots=1)
        assert run(m, list(range(8)))[1] is PublishResult.COMMITTED and marker(m).committed == [1]
        assert [s.name for s in cache_samples(m.profile())][-1] == "markers_kept"
        # A deployment whose factory builds no such type still lists its block, as zeros.
        assert ContextCacheManager(16, T, enabled=True, types=(*registered()[:-1], Registration(
            NAME, lambda setup, name: None, (), COUNTERS))).profile()[BLOCK] == {"kept": 0, "dropped": 0}
        with pytest.raises(ValueError, match="registered already"):
            register(NAME, build)
    finally:
        unregister(entry)
    assert not any(isinstance(kind, MarkerSlots) for kind in ContextCacheManager(16, T, enabled=True).types)
    with pytest.raises(TypeError, match="marker_slots"):  # an option no registered type reads
        ContextCacheManager(16, T, enabled=True, marker_slots=1)


def test_typed_handles_read_a_part_or_its_default_and_holders_have_no_views() -> None:
    m = ContextCacheManager(16, T, enabled=True, partial_kv_snapshot_slots=0)
    lease, _ = run(m, list(range(8)))
    assert restore_slot(lease) is None and restore_tokens(lease) == 0 and draft_page_ids(lease) == ()
    [record] = m.records.least_recent_first()
    assert partial_slot(record) is None and draft_page_ids(record) == () and recurrent_slot(record) is None
    for holder, attr in ((record, "partial_slot"), (lease, "restore_slot"), (lease, "draft_page_ids")):
        with pytest.raises(AttributeError, match=attr):  # a part is read through its type's handle only
            getattr(holder, attr)


def test_a_type_reads_its_own_request_input_and_queues_its_prerequisites() -> None:
    """The scheduler queues what the type asks for ahead of the request, and the request reaches the type's lookup."""
    from kvforge.runtime.engine.scheduler import Scheduler
    from kvforge.runtime.sampling.sampler import Sampler
    from kvforge.runtime.sequence import EngineRequest, Sequence
    from kvforge.runtime.types import SamplingParams

    types = (*registered(), Registration(NAME, build, (NAME,), COUNTERS))
    m = ContextCacheManager(16, T, enabled=True, types=types, marker_slots=4)
    ids = list(range(8))
    run(m, ids)
    assert m.try_acquire(Admission(ids + [1])).reuse_tokens == 8  # type: ignore[union-attr]
    assert m.try_acquire(Admission(ids + [1], inputs={NAME: {"cold": True}})).reuse_tokens == 0  # type: ignore[union-attr]
    scheduler = Scheduler(m, max_batch_size=4, max_num_tokens=64, prefill_chunk_tokens=64)
    sampling = SamplingParams(temperature=0.0, max_generate_length=1)
    request = EngineRequest([5, 6, 7, 8, 9, 10], sampling, cache_inputs={NAME: {"first": 4}})
    seq = Sequence("r", request, Sampler(sampling), arrival=0)
    scheduler.add(seq)
    scheduler.add(Sequence("again", request, Sampler(sampling), arrival=1))  # the same key: queued once
    producer, first, second = scheduler.waiting
    assert (first, second.request_id) == (seq, "again") and producer.internal
    assert producer.prompt_ids == [5, 6, 7, 8] and producer.request.cache_inputs == {NAME: {"produced": True}}
    assert producer.next_admission().inputs[NAME] == {"produced": True}


def test_a_type_exports_its_own_tier_value() -> None:
    """A record's marker slot is saved in its shared-tier endpoint value, read from the storage the value names."""
    import numpy as np

    from kvforge.runtime.context_cache.keys import CHAIN_ROOT
    from kvforge.runtime.context_cache.registry import tier_values
    from kvforge.runtime.context_cache.types.partial_tails import TierValue
    from kvforge.runtime.shared_tier.layout import Layout
    from kvforge.runtime.shared_tier.tier import record_values

    def marker_value(record: Record) -> TierValue | None:
        slot = record.parts.get(NAME)
        return None if slot is None else TierValue(NAME, slot)

    entry = register(NAME, build, (NAME,), tier_value=marker_value)
    try:
        m = ContextCacheManager(16, T, enabled=True, marker_slots=2)
        run(m, list(range(8)))
        [record] = m.records.least_recent_first()
        assert tier_values(record) == [TierValue(NAME, record.parts[NAME])]
        layout = Layout(CHAIN_ROOT, None)
        endpoint = layout.checkpoint.store_key(record.terminal_key)
        storage = {NAME: lambda slot: [np.full(3, 10 + slot, dtype=np.int32)]}
        job = record_values(record, layout, T, kv=None, sources=storage, known=lambda key: key != endpoint)
    finally:
        unregister(entry)
    assert job is not None and [key for key, _ in job.items] == [endpoint]
    encoded = job.items[0][1]
    value = layout.checkpoint.decode(encoded() if callable(encoded) else encoded, record.terminal_key,
                                     like=[np.zeros(3, dtype=np.int32)],
                                     tokens=np.asarray(record.token_ids, dtype=np.int32))
    assert [a.tolist() for a in value.arrays] == [[10 + record.parts[NAME]] * 3]
    assert tier_values(record) == []  # unregistered: a plain record saves only its pages
