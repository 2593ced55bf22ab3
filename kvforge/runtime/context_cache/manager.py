"""The context-cache coordinator: sole owner of the KV pages; admission asks before it changes anything.

With reuse disabled it is a plain page allocator (no lookup, no index, no records), so both modes run
the same code path. The scheduler talks to it through these calls:

    prerequisites(admission) -> list        requests the types need computed first (a document's prefill)
    prefix_in_flight(admission) -> bool     another running sequence is computing this prefix: wait for it
    try_acquire(admission) -> Lease | None  pages for a new sequence, or None when the pool cannot hold it now
    try_grow(lease, num_tokens) -> bool     more pages for a running sequence, or False (the caller preempts)
    index_computed(lease, tokens, n)        pages finished by a prefill chunk become findable at once
    publish(lease, tokens) / release(lease) a record for a finished sequence; return the lease's pages
    restore(lease) / finish_restore(lease)  copy an admitted lease's hits in (each type's copier), then unpin them
    restored_spans(lease) -> list           prompt ranges restored in place (a document's): computing skips them

The coordinator knows records, leases and eviction; what each kind of state is, how its hits are found, what a lease
or record holds of it, its request input and its counters live in one class per type behind the `CacheType`
protocol (protocol.py), registered in registry.py. Each registered factory decides from the `Deployment` (and the
keyword options it reads) whether its type is:

    VANILLA         AttentionPages (page index, in-flight sharing) + PartialTails (snapshots of tail pages)
    HYBRID          AttentionPages + RecurrentCheckpoints + PartialTails (a checkpoint's tail page)
    PURE_RECURRENT  RecurrentCheckpoints (no KV pages at all: pool capacity 0, leases hold none)

plus, on any paged deployment, the types a speculative decoder registers (a second pool beside the base pages).
There is one lookup point (`_find_longest_hit`: the types in lookup order, each narrowing or extending what the ones
before it agreed on), one commit tail (`_commit`) and one eviction point (`_evict`); each tells the `CacheEvents`
listener given at construction (an external tier), once per event. Keys chain from `chain_root` (keys.py: an
engine fingerprint's digest, or CHAIN_ROOT within one process).

With a partial-KV snapshot pool a publication that is not page-aligned also keeps a copy of its tail page, and an
admission extending that exact prefix restores it into its first private page (the types' copiers move the bytes;
this module never touches K/V) before `finish_restore`. A capture that finds no slot, even after evicting, is
skipped and counted (`snapshot_pressure_skips`): the record keeps its full pages only. No call raises for a full
pool: only a request that cannot fit alone in empty pools is an error (the engine's `fits_alone`).

Hybrid and pure recurrent deployments reuse ONLY exact checkpoints (a recurrent state cannot be rebuilt from
pages): every publication there is one, of exactly the tokens the lease computed (types/recurrent_checkpoints.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.paging import pages_for
from kvforge.contract.profile_schema import BASE_KV_PAGES, PARTIAL_KV_SNAPSHOTS, RECURRENT_SNAPSHOTS
from kvforge.runtime.context_cache.audit import check_invariants
from kvforge.runtime.context_cache.capture import Copiers, SnapshotCopier, snapshot_copiers
from kvforge.runtime.context_cache.eviction import Victim, plan_eviction, refile
from kvforge.runtime.context_cache.index import PageIndex
from kvforge.runtime.context_cache.keys import CHAIN_ROOT, KeyExtras, page_keys, tail_page_key
from kvforge.runtime.context_cache.lease import NO_INPUTS, Admission, Inputs, Lease, Prerequisite
from kvforge.runtime.context_cache.metrics import CacheMetrics
from kvforge.runtime.context_cache.planner import ReusePlan, plan_cold
from kvforge.runtime.context_cache.pools import Demand, ResourcePool, ResourcePools
from kvforge.runtime.context_cache.protocol import (
    CacheEvents,
    CacheSetup,
    CacheType,
    Lookup,
    NoEvents,
    Publication,
    PublishResult,
)
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.context_cache.registry import Registration, registered
from kvforge.runtime.context_cache.types.attention_pages import AttentionPages
from kvforge.runtime.types import Deployment, LookupPolicy  # Deployment is re-exported for the engine

DEFAULT_MAX_RECORDS = 1024
F = TypeVar("F", bound=Callable[..., Any])


def _bookkept(method: F) -> F:
    """Adds the call's wall time to `bookkeeping_nanoseconds`: what reuse costs a request besides compute."""
    @functools.wraps(method)
    def timed(self: ContextCacheManager, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.bookkeeping_nanoseconds += time.perf_counter_ns() - started
    return timed  # type: ignore[return-value]


class ContextCacheManager:
    def __init__(self, num_pages: int, tokens_per_page: int, *, enabled: bool,
                 max_records: int = DEFAULT_MAX_RECORDS, deployment: Deployment = Deployment.VANILLA,
                 copier: SnapshotCopier | None = None, copiers: Copiers | None = None, chain_root: bytes = CHAIN_ROOT,
                 events: CacheEvents | None = None, types: Sequence[Registration] | None = None,
                 **options: Any) -> None:
        """`copiers`: what moves each type's bytes, by type name; `copier` is the snapshot types' (the engine's state
        manager): without one no snapshot is ever captured. `chain_root` roots every key (keys.chain_root of an
        engine fingerprint); `events` hears lookups, commits and evictions (an external tier). `types`: the cache
        types to build (default: every registered one); `options`: what they read (budgets such as
        `partial_kv_snapshot_slots`: see each type's module); a name no type reads is an error."""
        if max_records < 0:
            raise InvalidConfig(f"must be >= 0, got {max_records}", "context_cache_max_records")
        registrations = registered() if types is None else tuple(types)
        if unknown := set(options) - {name for entry in registrations for name in entry.options}:
            raise TypeError(f"ContextCacheManager got options no cache type reads: {sorted(unknown)}")
        self.enabled = enabled
        self.tokens_per_page = tokens_per_page
        self.max_records = max_records
        self.deployment = Deployment(deployment)
        self.chain_root = chain_root
        self.events: CacheEvents = NoEvents() if events is None else events
        self.copier = copier
        copiers = {**snapshot_copiers(copier), **(copiers or {})}
        self.records = RecordStore()
        self.metrics = CacheMetrics()
        self.leases: set[Lease] = set()
        self.bookkeeping_nanoseconds = 0  # all calls below, for benchmarks (the profile has planning time)
        setup = CacheSetup(enabled, self.deployment, num_pages, tokens_per_page, chain_root, copiers, self.records,
                           self.metrics, options, self._reserve_timed, self.page_tables)
        # The deployment picks the types (each factory decides); everything below asks the types, never the
        # deployment. A type the deployment does not use still lists its pool, empty, in the profile.
        built = [(entry, entry.factory(setup, entry.name)) for entry in registrations]
        self.types: tuple[CacheType, ...] = tuple(kind for _entry, kind in built if kind is not None)
        self.pools = ResourcePools(*(ResourcePool(entry.name, 0) if kind is None else kind.pool
                                     for entry, kind in built))
        self._counted = [(entry.counters, kind) for entry, kind in built if entry.counters]  # absent: zeros
        # The page table's type, if any: its index answers the audits and which record a page hit ends on.
        self.attention = next((kind for kind in self.types if isinstance(kind, AttentionPages)), None)
        self.index = PageIndex() if self.attention is None else self.attention.index
        self._alone = frozenset(kind.name for kind in self.types if kind.part_drops_alone)  # see plan_eviction

    @property
    def pages(self) -> ResourcePool:
        return self.pools[BASE_KV_PAGES]

    @property
    def partial_snapshots(self) -> ResourcePool:
        return self.pools[PARTIAL_KV_SNAPSHOTS]

    @property
    def recurrent_snapshots(self) -> ResourcePool:
        return self.pools[RECURRENT_SNAPSHOTS]

    @property
    def paged(self) -> bool:
        """Whether sequences keep K/V in pages (not on a pure recurrent engine)."""
        return self.deployment is not Deployment.PURE_RECURRENT

    @property
    def checkpoints(self) -> bool:
        """Whether reuse is by exact checkpoint only (hybrid, pure recurrent)."""
        return self.deployment is not Deployment.VANILLA

    @property
    def in_flight(self) -> Mapping[bytes, Lease]:
        """Read-only view of the pages running sequences are computing: page key -> the lease computing it."""
        return {key: lease for kind in self.types for key, lease in kind.in_flight_pages().items()}

    # --- questions (no side effects beyond caching an admission's keys) -----------------------------

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` could run in these pools if nothing else held a slot."""
        return all(kind.fits_alone(num_tokens) for kind in self.types)

    @_bookkept
    def prefix_in_flight(self, admission: Admission) -> bool:
        """True when the first page this admission would compute is being computed by a running sequence:
        waiting a few steps turns that page (and the ones after it) into hits instead of duplicate work."""
        if not self._looks_up(admission) or not any(kind.in_flight_pages() for kind in self.types):
            return False
        lookup = self._lookup(admission, np.asarray(admission.token_ids, dtype=np.int32))
        return any(kind.waits_for(lookup) for kind in self.types)

    def prerequisites(self, admission: Admission) -> list[Prerequisite]:
        """What the types need computed before `admission` can use it (the scheduler queues these first)."""
        return [need for kind in self.types for need in kind.prerequisites(admission)] if self._looks_up(
            admission) else []

    # --- acquire ------------------------------------------------------------------------------------

    @_bookkept
    def try_acquire(self, admission: Admission) -> Lease | None:
        """Slots for a new sequence (canonical hits for the matched prefix, private pages for the rest), or
        None when the pools cannot hold it now. All-or-nothing; metrics count only admitted sequences."""
        started = time.perf_counter_ns()
        tokens = np.asarray(admission.token_ids, dtype=np.int32)
        lookup = self._looks_up(admission)
        keys: list[bytes] = []
        if lookup:
            found = self._lookup(admission, tokens)
            keys = found.keys
            plan = self._find_longest_hit(found)
        else:
            plan = self._cold(len(tokens))
        lease = self._try_acquire(plan, admission.extras, lookup, admission.inputs)
        if lease is None and plan.hit_pages:
            # Pinned hits can leave too little to evict; a cold run may still fit (evicting those records).
            lease = self._try_acquire(self._cold(len(tokens)), admission.extras, False, admission.inputs)
            if lease is not None:
                lease.forced_cold = True
        if lease is not None:
            if not lease.forced_cold:
                lease.keys = list(keys)  # publication reuses the prompt's keys instead of hashing twice
                lease.indexed_pages = len(plan.hit_pages)
            for kind in self.types:
                kind.on_admitted(lease, admission, len(tokens))
            self.metrics.count_admission(plan, lease, lookup)
        self.metrics.planning_nanoseconds += time.perf_counter_ns() - started
        return lease

    def _looks_up(self, admission: Admission) -> bool:
        return self.enabled and admission.lookup_policy is LookupPolicy.USE_CACHE

    def _lookup(self, admission: Admission, tokens: np.ndarray) -> Lookup:
        if admission.keys is None:
            admission.keys = page_keys(admission.token_ids, self.tokens_per_page, admission.extras,
                                       parent=self.chain_root)
        return Lookup(tokens, admission.keys, admission.extras, inputs=admission.inputs)

    def _cold(self, num_tokens: int) -> ReusePlan:
        return plan_cold(num_tokens, self.tokens_per_page, paged=self.paged)

    def _find_longest_hit(self, lookup: Lookup) -> ReusePlan:
        """The one lookup point: every type in lookup order agrees on the hit (for a hybrid, the longest checkpoint
        whose pages the index serves), then the listener hears which keys hit."""
        plan = self._cold(len(lookup.tokens))  # nothing agreed yet: the first type decides alone
        for kind in self.types:
            plan = kind.find_longest_hit(lookup, plan)
        self.events.looked_up(lookup.keys, len(plan.hit_pages))
        return plan

    def _try_acquire(self, plan: ReusePlan, extras: KeyExtras, may_publish: bool,
                     inputs: Inputs = NO_INPUTS) -> Lease | None:
        reused = [(kind.pool, kind.hit_slots(plan)) for kind in self.types]
        for pool, slots in reused:
            pool.pin(slots)  # pin before evicting: the plan's own hits are never victims
        # The record a snapshot or checkpoint hit resumes from is never a victim of its own admission.
        needs = [kind.admission_slots(plan, inputs) for kind in self.types]
        victims = plan_eviction({kind.name: n for kind, n in zip(self.types, needs, strict=True) if n}, self.pools,
                                self.records.least_recent_first(), protected=plan.resumes, held_by=self._held,
                                alone=self._alone)
        if victims is None:
            for pool, slots in reused:
                pool.unpin(slots)
            return None
        self._evict(victims)
        lease = Lease(extras, [], plan.reuse_tokens, plan.matched_tokens, plan.kind, may_publish)
        for kind, n in zip(self.types, needs, strict=True):
            kind.admit(lease, plan, inputs, kind.pool.allocate(n))
        if plan.resumes is not None:  # the checkpoint or snapshot this request resumes from stays resident longest
            self.records.touch(plan.resumes)
        elif plan.hit_pages:  # a hit refreshes the record it ends on, so reused documents stay resident
            record = self.records.find(self.index.key_of(plan.hit_pages[-1]))
            if record is not None:
                self.records.touch(record.record_id)
        self.leases.add(lease)
        return lease

    @_bookkept
    def restore(self, lease: Lease) -> None:
        """Copy the lease's hits in, type by type through each one's copier (the scheduler calls it once the
        sequence holds its pages and state row), then `finish_restore`."""
        for kind in self.types:
            kind.restore(lease)

    @_bookkept
    def finish_restore(self, lease: Lease) -> None:
        """The lease's snapshots were copied in: unpin them (their record keeps them). One restore per request."""
        self.metrics.restores += any([kind.finish_restore(lease) for kind in self.types])  # a list: every type

    @_bookkept
    def try_grow(self, lease: Lease, num_tokens: int) -> bool:
        """Make the lease's slots cover positions [0, num_tokens), evicting records if needed; False (nothing
        changed) when the pools cannot: the scheduler preempts another sequence and retries."""
        needs = [kind.growth_slots(lease, num_tokens) for kind in self.types]
        if not any(needs):
            return True
        # least_recent_first is lazy: the LRU order is copied only when some record must go.
        if not self._reserve({kind.name: n for kind, n in zip(self.types, needs, strict=True) if n}):
            return False
        for kind, n in zip(self.types, needs, strict=True):
            if n:
                kind.grow(lease, kind.pool.allocate(n))
        for kind in self.types:
            kind.on_grown(lease)  # e.g. a restored document's rows into the new window pages
        return True

    # --- in-flight indexing and publication ---------------------------------------------------------

    @_bookkept
    def index_computed(self, lease: Lease, token_ids: list[int] | np.ndarray, num_computed: int) -> None:
        """Index the lease's full pages among its first `num_computed` tokens (up to its indexable limit), so a
        request arriving mid-prefill hits the chunks already done (no record: the lease pins them). Nothing on a
        checkpoint deployment: there a page is indexed on publication, with its checkpoint."""
        if not (self.enabled and lease.may_publish):
            return
        upto = min(num_computed // self.tokens_per_page, lease.indexable_pages, len(lease.page_ids))
        if upto <= lease.indexed_pages:
            return
        tokens = np.asarray(token_ids, dtype=np.int32)
        self._extend_keys(lease, tokens, upto)
        for kind in self.types:
            kind.index_computed(lease, tokens, upto)

    @_bookkept
    def publish(self, lease: Lease, token_ids: list[int] | np.ndarray, boundary: bool = False) -> PublishResult:
        """Publish `token_ids` (tokens whose K/V the lease's pages hold) as one record: its full pages, and
        with a snapshot pool a copy of the partial tail page (an exact checkpoint). On a hybrid or pure
        recurrent deployment every publication is an exact checkpoint (all or nothing); the lease must have
        computed exactly `token_ids` at that moment, so a chunk that runs past a capture point (e.g. a
        recompute after preemption crossing the prompt's end) must not publish that point: the live state would
        be filed under a shorter key. `boundary` marks a mid-sequence capture (metrics only).

        Snapshot slots are reserved first (evicting LRU records), so no eviction frees a page this record is about
        to reference. No slot: a checkpoint is skipped, a plain record keeps its full pages (counted, no error).
        """
        if not (self.enabled and lease.may_publish):
            return PublishResult.SKIPPED
        tokens = np.asarray(token_ids, dtype=np.int32)[:lease.exact_tokens]  # approximate K/V is never published
        publication = self._endpoint(lease, tokens)
        if publication is None:
            return PublishResult.SKIPPED
        self.metrics.publication_attempts += 1
        if self._touch_existing(publication.terminal_key, lease):
            return PublishResult.EXISTING
        if not self._reserve_slots(publication):
            self.metrics.snapshot_pressure_skips += 1
            if publication.exact or not publication.keys:
                return PublishResult.SKIPPED
            publication = publication.full_pages_only()
            if self._touch_existing(publication.terminal_key, lease):
                return PublishResult.EXISTING
        for kind in self.types:
            kind.project(lease, publication)
            if self.paged and len(publication.page_ids) < len(publication.keys):  # a key held other tokens: collision
                self._drop_reserved(publication)
                if publication.exact or not publication.page_ids:
                    return PublishResult.SKIPPED
                pages = publication.page_ids
                publication = publication.full_pages_only(len(pages))  # publish the prefix the collision left
                publication.page_ids = pages
                if self.records.find(publication.terminal_key) is not None:
                    return PublishResult.EXISTING
        self._capture(lease, publication, boundary)
        return self._commit(lease, publication)

    def _endpoint(self, lease: Lease, tokens: np.ndarray) -> Publication | None:
        """What publishing `tokens` keeps, or None when there is nothing to keep. With checkpoints the endpoint is
        exact (the lease must hold every token's page); else its full pages, and its tail page if a type keeps one."""
        T = self.tokens_per_page
        if self.checkpoints:
            full, tail = divmod(len(tokens), T)
            if not len(tokens) or (self.paged and len(lease.page_ids) < pages_for(len(tokens), T)):
                return None
            keys = self._extend_keys(lease, tokens, full)
            return Publication(tokens, keys, self._tail_key(keys, tokens, lease.extras) if tail else b"", exact=True)
        full = min(len(tokens) // T, len(lease.page_ids))
        tail = len(tokens) - full * T if len(lease.page_ids) > full else 0
        partial = 0 < tail < T and any(kind.keeps_tail or kind.keeps_tail_of(lease) for kind in self.types)
        if full == 0 and not partial:
            return None
        keys = self._extend_keys(lease, tokens, full)
        return Publication(tokens, keys, self._tail_key(keys, tokens, lease.extras) if partial else b"", exact=False)

    def _touch_existing(self, terminal_key: bytes, lease: Lease) -> bool:
        if (existing := self.records.find(terminal_key)) is None:
            return False
        self.records.touch(existing.record_id)
        self.metrics.publications_existing += 1
        self._upgrade(existing, lease)
        return True

    def _upgrade(self, existing: Record, lease: Lease) -> None:
        """A publication of an endpoint already cached may give the record a better part of some type (each type
        decides): the record is swapped in place, its references moved, and every type refiles it."""
        record = existing
        for kind in self.types:
            record = kind.upgrade(record, lease) or record
        if record is not existing:
            refile(self.types, self.records, existing, record)

    def _reserve_slots(self, publication: Publication) -> bool:
        """Free (evicting LRU records) and pin the snapshot slots `publication` needs; False when pins forbid it."""
        needs = {kind.name: n for kind in self.types if (n := kind.publication_slots(publication))}
        if not needs:
            return True
        if not self._reserve(needs):
            return False
        for name, n in needs.items():
            publication.reserved[name] = self.pools[name].allocate(n)
        return True

    def _drop_reserved(self, publication: Publication) -> None:
        for name in list(publication.reserved):
            self.pools[name].unpin(publication.reserved.pop(name))

    def _capture(self, lease: Lease, publication: Publication, boundary: bool) -> None:
        """Copy the reserved snapshots, type by type (a checkpoint's recurrent state first): one wait."""
        copied = [kind.capture(lease, publication) for kind in self.types]  # a list: every type copies
        if publication.exact and any(copied):
            if boundary:
                self.metrics.boundary_captures += 1
            else:
                self.metrics.endpoint_captures += 1
        if any(copied):
            self.metrics.capture_synchronizations += 1

    @_bookkept
    def _reserve_timed(self, demand: Demand) -> bool:
        """`_reserve` for a type's own growth (pages its handle asks for), timed like every coordinator call."""
        return self._reserve(demand)

    def _reserve(self, demand: Demand) -> bool:
        """Make `demand` allocatable by evicting least recently used records; False when pins forbid it."""
        victims = plan_eviction(demand, self.pools, self.records.least_recent_first(), held_by=self._held,
                                alone=self._alone)
        if victims is None:
            return False
        self._evict(victims)
        return True

    def _held(self, record: Record) -> dict[str, tuple[int, ...]]:
        return {kind.name: kind.held(record) for kind in self.types}

    def _commit(self, lease: Lease, publication: Publication) -> PublishResult:
        """The one commit tail: the record takes a cache reference on what each type holds of it, the reserved
        slots are unpinned (the record alone keeps them), and the listener hears of it."""
        covered = len(publication.tokens) if publication.tail_key else len(publication.keys) * self.tokens_per_page
        parts = {kind.name: part for kind in self.types if (part := kind.record_part(publication)) is not None}
        record = Record(self.records.new_id(), tuple(publication.keys), tuple(publication.page_ids),
                        tuple(publication.tokens[:covered].tolist()), lease.extras, publication.tail_key,
                        publication.exact, parts)
        for kind in self.types:
            kind.pool.add_cache_ref(kind.held(record))
            kind.pool.unpin(publication.reserved.get(kind.name, ()))
            kind.on_commit(record)
        self.records.insert(record)
        self.metrics.publications_committed += 1
        self.events.committed(record)
        while len(self.records) > self.max_records:  # max_records == 0 evicts the new record right away
            self._evict([Victim(self.records.oldest_id())])
        return PublishResult.COMMITTED

    def _extend_keys(self, lease: Lease, tokens: np.ndarray, num_pages: int) -> list[bytes]:
        """The lease's chain keys of its first `num_pages` pages, hashing only those it has not hashed yet."""
        if len(lease.keys) < num_pages:
            parent = lease.keys[-1] if lease.keys else self.chain_root
            lease.keys.extend(page_keys(tokens[:num_pages * self.tokens_per_page], self.tokens_per_page,
                                        lease.extras, parent=parent, first_page=len(lease.keys)))
        return lease.keys[:num_pages]

    def _tail_key(self, keys: list[bytes], tokens: np.ndarray, extras: KeyExtras) -> bytes:
        return tail_page_key(keys[-1] if keys else self.chain_root, tokens, len(keys) * self.tokens_per_page, extras)

    # --- release and eviction -----------------------------------------------------------------------

    @_bookkept
    def release(self, lease: Lease) -> None:
        """Return the lease's slots. Slots nobody else holds go back to the free list (pages leave the index)."""
        if lease.released:
            return
        lease.released = True
        self.leases.discard(lease)
        for kind in self.types:
            kind.release(lease)

    def _evict(self, victims: Sequence[Victim | int]) -> None:
        """The one eviction point: each type drops its references (a victim's `parts` alone: the record stays)."""
        for victim in victims:
            record_id, parts = victim if isinstance(victim, Victim) else Victim(victim)
            if parts and (record := self.records.get(record_id)) is not None:  # refiled: no eviction event
                freed = refile(self.types, self.records, record, record.without(parts))
            else:
                record = self.records.remove(record_id)
                freed = {kind.name: kind.pool.drop_cache_ref(kind.held(record)) for kind in self.types}
                for kind in self.types:
                    kind.on_evict(record)
                self.metrics.records_evicted += 1
                self.events.evicted(record)
            for name, count in freed.items():
                self.metrics.reclaimed[name] = self.metrics.reclaimed.get(name, 0) + count

    # --- reporting, audits, the types' views of a lease (their second pass: protocol.py, issue 53) ---------

    def restored_spans(self, lease: Lease) -> list[tuple[int, int]]:  # restored at admission: computing skips them
        return sorted(span for kind in self.types for span in kind.restored_spans(lease))

    def repair_pass(self, lease: Lease, computed: int) -> tuple[int, int]:
        return min((kind.repair_pass(lease, computed) for kind in self.types), key=lambda p: (not p[1], p))

    def page_tables(self, lease: Lease) -> dict[str, list[int]]:  # the groups beside the global one, by owner
        return {group: table for kind in self.types for group, table in kind.page_tables(lease).items()}

    def profile(self) -> dict:
        blocks = {block.name: block.zeros() if kind is None else kind.counters() for block, kind in self._counted}
        return self.metrics.to_dict(len(self.records), self.pools.to_dict(), blocks)

    # Audit every refcount, index entry and in-flight key from scratch (tests call this after each step).
    check_invariants = check_invariants
