"""The context-cache coordinator: sole owner of the KV pages; admission asks before it changes anything.

With reuse disabled it is a plain page allocator (no lookup, no index, no records), so both modes run
the same code path. The scheduler talks to it through five calls:

    prefix_in_flight(admission) -> bool     another running sequence is computing this prefix: wait for it
    try_acquire(admission) -> Lease | None  pages for a new sequence, or None when the pool cannot hold it now
    try_grow(lease, num_tokens) -> bool     more pages for a running sequence, or False (the caller preempts)
    index_computed(lease, tokens, n)        pages finished by a prefill chunk become findable at once
    publish(lease, tokens) / release(lease) a record for a finished sequence; return the lease's pages

The coordinator knows records, leases and eviction; what each kind of state is and how its hits are found lives
in one class per resource type behind the `CacheType` protocol (protocol.py). `Deployment` only picks which types
are present:

    VANILLA         AttentionPages (page index, in-flight sharing) + PartialTails (snapshots of tail pages)
    HYBRID          AttentionPages + PartialTails (a checkpoint's tail page) + RecurrentCheckpoints
    PURE_RECURRENT  RecurrentCheckpoints (no KV pages at all: pool capacity 0, leases hold none)

There is one lookup point (`_find_longest_hit`: the types in lookup order, each narrowing or extending what the ones
before it agreed on), one commit tail (`_commit`) and one eviction point (`_evict`); each tells the `CacheEvents`
listener given at construction (an external tier), once per event. Keys chain from `chain_root` (keys.py: an
engine fingerprint's digest, or CHAIN_ROOT within one process).

With a partial-KV snapshot pool (`partial_kv_snapshot_slots` > 0) a publication whose length is not
page-aligned also keeps a copy of its partial tail page, and an admission that extends that exact
prefix gets `lease.restore_slot`: the engine copies the snapshot into the lease's first private page
(the `SnapshotCopier` given at construction and the engine's restore do the copies; this module never
touches K/V bytes) and calls `finish_restore`. A capture that finds no slot, even after evicting records
that hold snapshots, is skipped and counted (`snapshot_pressure_skips`); the publication then keeps only
the full pages.

None of them raises for a full pool: only a request that cannot fit alone in an empty pool is an error,
and that is the engine's call (`fits_alone`).

Hybrid and pure recurrent deployments reuse ONLY exact checkpoints: a recurrent layer's state after L tokens cannot
be rebuilt from KV pages, so a page hit without the state is worthless. A checkpoint is a record of exactly L tokens
holding a recurrent snapshot (every recurrent layer's state + conv state, `capture_recurrent`) and, on a hybrid with
L not page-aligned, a partial-KV snapshot of its tail page, plus (hybrid) cache refs on its floor(L/T) full pages.
Token layout of a hybrid lease resuming from a checkpoint of L = h*T + r tokens:

    |<-- reuse_tokens = L ----------------------------------------->|
    | page 0 | ... | page h-1 (hits: the checkpoint's canonical pages)| page h: r restored tokens, computing ->| ... |
                                                                    |<- restore_slot (partial-KV snapshot) ->|
    recurrent + conv state of the sequence <- restore_recurrent_slot (state after exactly L tokens)

The hybrid lookup asks AttentionPages for the index's matching pages, then RecurrentCheckpoints for the longest
checkpoint those pages agree with: checkpoints are filed by (last full page key, length), so only lengths hanging
off a page this input shares are looked at, and each costs one tail hash (none when aligned). The longest checkpoint
strictly shorter than the input whose exact key, tokens and (hybrid) canonical pages match wins; no checkpoint
means a cold start (`restore_recurrent_slot` None: the engine zeroes the state). Publication is capture:
`publish(lease, tokens)` may be called mid-prefill at every chat-message boundary or snapshot interval and at the
prefill and decode ends, each time with exactly the tokens the lease has computed. A pure recurrent record still
carries the chain keys of its logical blocks, so content addressing (tokens, adapter, salt, media) is the same.
Nothing is indexed in flight on a checkpoint deployment (a page hit alone is useless), so `prefix_in_flight` is
always False there.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.paging import pages_for
from kvforge.runtime.context_cache.attention_pages import AttentionPages
from kvforge.runtime.context_cache.audit import check_invariants
from kvforge.runtime.context_cache.capture import SnapshotCopier
from kvforge.runtime.context_cache.draft_paths import DraftPaths
from kvforge.runtime.context_cache.eviction import plan_eviction
from kvforge.runtime.context_cache.index import PageIndex
from kvforge.runtime.context_cache.keys import CHAIN_ROOT, KeyExtras, page_keys, tail_page_key
from kvforge.runtime.context_cache.lease import Admission, Lease
from kvforge.runtime.context_cache.metrics import CacheMetrics
from kvforge.runtime.context_cache.partial_tails import PartialTails
from kvforge.runtime.context_cache.planner import ReusePlan, plan_cold
from kvforge.runtime.context_cache.pools import Demand, ResourcePools
from kvforge.runtime.context_cache.protocol import CacheEvents, CacheType, Lookup, NoEvents, Publication, PublishResult
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.context_cache.recurrent_checkpoints import RecurrentCheckpoints
from kvforge.runtime.types import Deployment, LookupPolicy  # Deployment is re-exported for the engine

DEFAULT_MAX_RECORDS = 1024
F = TypeVar("F", bound=Callable[..., Any])
_NOTHING_IN_FLIGHT: Mapping[bytes, Lease] = MappingProxyType({})


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
                 max_records: int = DEFAULT_MAX_RECORDS, partial_kv_snapshot_slots: int = 0,
                 recurrent_snapshot_slots: int = 0, deployment: Deployment = Deployment.VANILLA,
                 copier: SnapshotCopier | None = None, chain_root: bytes = CHAIN_ROOT,
                 events: CacheEvents | None = None, draft_pages: int = 0, draft_replays: bool = True) -> None:
        """`copier` moves snapshot bytes (the engine's state manager); without one no snapshot is ever captured.
        `chain_root` roots every key (keys.chain_root of an engine fingerprint); `events` hears lookups, commits
        and evictions (an external tier). `draft_pages`: a draft's own KV pool (speculative admissions take a page
        there beside each base page); `draft_replays`: whether a hit replays its final page (EAGLE3: the draft at p
        reads token p + 1) or not (block drafts: their K/V at p depend on the base at p alone)."""
        if max_records < 0:
            raise InvalidConfig(f"must be >= 0, got {max_records}", "context_cache_max_records")
        deployment = Deployment(deployment)
        checkpoints = deployment is not Deployment.VANILLA  # exact-checkpoint reuse only (hybrid, pure recurrent)
        paged = deployment is not Deployment.PURE_RECURRENT  # the sequence keeps K/V in pages
        # The engine checks budgets against the slot sizes first (its message names bytes); this guards the core.
        if enabled and checkpoints and recurrent_snapshot_slots < 1:
            raise InvalidConfig(f"a {deployment.value} deployment reuses only exact checkpoints and needs at least one "
                                "recurrent snapshot slot", "context_cache_recurrent_snapshot_pool_bytes")
        if enabled and deployment is Deployment.HYBRID and partial_kv_snapshot_slots < 1:
            raise InvalidConfig("a hybrid deployment needs at least one partial-KV snapshot slot for checkpoints that "
                                "end inside a page", "context_cache_partial_kv_snapshot_pool_bytes")
        self.enabled = enabled
        self.tokens_per_page = tokens_per_page
        self.max_records = max_records
        self.deployment = deployment
        self.chain_root = chain_root
        self.events: CacheEvents = NoEvents() if events is None else events
        # Budgets a deployment cannot use are dropped (the engine decides whether passing one is an error).
        partial = partial_kv_snapshot_slots if enabled and paged else 0
        # A pure recurrent engine's build still names a KV pool size; nothing would ever use it, so its capacity is 0.
        if draft_pages and not paged:
            raise InvalidConfig("a draft with its own KV pool needs a base with attention layers (the support matrix "
                                "rejects pure-recurrent speculative decoding)", "spec_decode")
        self.pools = ResourcePools(num_pages if paged else 0, partial,
                                   recurrent_snapshot_slots if enabled and checkpoints else 0, draft_pages)
        self.pages = self.pools.base_kv_pages
        self.partial_snapshots = self.pools.partial_kv_snapshots
        self.recurrent_snapshots = self.pools.recurrent_snapshots
        self.copier = copier
        self.records = RecordStore()
        self.metrics = CacheMetrics()
        self.leases: set[Lease] = set()
        self.bookkeeping_nanoseconds = 0  # all calls below, for benchmarks (the profile has planning time)
        # The deployment picks the resource types; everything below asks the types, never the deployment.
        T = tokens_per_page
        self.attention = AttentionPages(self.pages, T, shares_in_flight=not checkpoints) if paged else None
        self.tails = PartialTails(self.partial_snapshots, T, chain_root, copier) if paged else None
        self.recurrent = RecurrentCheckpoints(self.recurrent_snapshots, self.records, T, chain_root,
                                              with_pages=paged, copier=copier) if checkpoints else None
        self.drafts = DraftPaths(self.pools.draft_kv_pages, T, replays=draft_replays,
                                 records=self.records if checkpoints else None) if draft_pages else None
        self.types: tuple[CacheType, ...] = tuple(
            t for t in (self.attention, self.tails, self.recurrent, self.drafts) if t is not None)
        # Lookup order: each type narrows or extends the hit of the ones before it. A checkpoint brings its own
        # tail page, so on a checkpoint deployment the tails extend nothing: the checkpoints have the last word. The
        # draft paths come last: a speculative admission's hit is one coherent path, never a snapshot tail.
        self._lookup_order: tuple[CacheType, ...] = tuple(
            t for t in (self.attention, None if checkpoints else self.tails, self.recurrent, self.drafts)
            if t is not None)
        self.index = self.attention.index if self.attention is not None else PageIndex()

    @property
    def paged(self) -> bool:
        """Whether sequences keep K/V in pages (an attention type is present; not on a pure recurrent engine)."""
        return self.attention is not None

    @property
    def checkpoints(self) -> bool:
        """Whether reuse is by exact checkpoint only (a recurrent type is present: hybrid, pure recurrent)."""
        return self.recurrent is not None

    @property
    def in_flight(self) -> Mapping[bytes, Lease]:
        """Read-only view of the pages running sequences are computing: page key -> the lease computing it."""
        return self.attention.in_flight if self.attention is not None else _NOTHING_IN_FLIGHT

    # --- questions (no side effects beyond caching an admission's keys) -----------------------------

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` could run in this pool if nothing else held a page."""
        needed = pages_for(num_tokens, self.tokens_per_page)
        if self.drafts is not None and needed > self.pools.draft_kv_pages.capacity:
            return False  # a speculative request takes as many draft pages
        return self.attention is None or needed <= self.pages.capacity

    @_bookkept
    def prefix_in_flight(self, admission: Admission) -> bool:
        """True when the first page this admission would compute is being computed by a running sequence:
        waiting a few steps turns that page (and the ones after it) into hits instead of duplicate work."""
        attention = self.attention
        if attention is None or not attention.in_flight or not self._looks_up(admission):
            return False
        return attention.waits_for(self._lookup(admission, np.asarray(admission.token_ids, dtype=np.int32)))

    # --- acquire ------------------------------------------------------------------------------------

    @_bookkept
    def try_acquire(self, admission: Admission) -> Lease | None:
        """Pages for a new sequence (canonical hits for the matched prefix, private pages for the rest), or
        None when the pool cannot hold it now. All-or-nothing; metrics count only admitted sequences."""
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
        speculative = admission.speculative and self.drafts is not None
        lease = self._try_acquire(plan, admission.extras, may_publish=lookup, speculative=speculative)
        if lease is None and plan.hit_pages:
            # Pinned hits can leave too little to evict; a cold run may still fit (evicting those records).
            lease = self._try_acquire(self._cold(len(tokens)), admission.extras, may_publish=False,
                                      speculative=speculative)
            if lease is not None:
                lease.forced_cold = True
        if lease is not None:
            if not lease.forced_cold:
                lease.keys = list(keys)  # publication reuses the prompt's keys instead of hashing twice
                lease.indexed_pages = len(plan.hit_pages)
            if lease.may_publish and self.attention is not None:
                indexable = len(tokens) if admission.indexable_tokens is None else admission.indexable_tokens
                self.attention.register_in_flight(lease, min(indexable, len(tokens)))
            self._count_admission(plan, lease, lookup)
        self.metrics.planning_nanoseconds += time.perf_counter_ns() - started
        return lease

    def _looks_up(self, admission: Admission) -> bool:
        return self.enabled and admission.lookup_policy is LookupPolicy.USE_CACHE

    def _lookup(self, admission: Admission, tokens: np.ndarray) -> Lookup:
        if admission.keys is None:
            admission.keys = page_keys(admission.token_ids, self.tokens_per_page, admission.extras,
                                       parent=self.chain_root)
        return Lookup(tokens, admission.keys, admission.extras, speculative=admission.speculative)

    def _cold(self, num_tokens: int) -> ReusePlan:
        return plan_cold(num_tokens, self.tokens_per_page, paged=self.attention is not None)

    def _find_longest_hit(self, lookup: Lookup) -> ReusePlan:
        """The one lookup point: every type in lookup order agrees on the hit (for a hybrid, the longest checkpoint
        whose pages the index serves), then the listener hears which keys hit."""
        plan = self._cold(len(lookup.tokens))  # nothing agreed yet: the first type decides alone
        for kind in self._lookup_order:
            plan = kind.find_longest_hit(lookup, plan)
        self.events.looked_up(lookup.keys, len(plan.hit_pages))
        return plan

    def _try_acquire(self, plan: ReusePlan, extras: KeyExtras, may_publish: bool,
                     speculative: bool = False) -> Lease | None:
        reused = [(kind.pool, kind.hit_slots(plan)) for kind in self.types]
        for pool, slots in reused:
            pool.pin(slots)  # pin before evicting: the plan's own hits are never victims
        # The record a snapshot or checkpoint hit resumes from is never a victim of its own admission.
        resumed = plan.checkpoint_record if plan.checkpoint_record is not None else \
            self._record_holding(plan.restore_slot) if plan.restore_slot is not None else None
        draft_pages = len(plan.hit_pages) + plan.new_pages - len(plan.draft_hit_pages) if speculative else 0
        victims = plan_eviction(Demand(base_kv_pages=plan.new_pages, draft_kv_pages=draft_pages), self.pools,
                                self.records.least_recent_first(), protected=resumed)
        if victims is None:
            for pool, slots in reused:
                pool.unpin(slots)
            return None
        self._evict(victims)
        private = self.pages.allocate(plan.new_pages)
        lease = Lease(extras, [*plan.hit_pages, *private], plan.reuse_tokens, plan.matched_tokens, plan.kind,
                      may_publish, restore_slot=plan.restore_slot, restore_tokens=plan.restore_tokens,
                      restore_recurrent_slot=plan.restore_recurrent_slot)
        if speculative:
            lease.draft_page_ids = [*plan.draft_hit_pages, *self.pools.draft_kv_pages.allocate(draft_pages)]
            lease.draft_computed_tokens = plan.reuse_tokens
            if plan.draft_tail is not None:  # the drafter replays the checkpoint's tail first (the successor boundary)
                lease.draft_computed_tokens = plan.draft_tail.start
                lease.draft_hidden, lease.draft_hidden_start = plan.draft_tail.hidden.copy(), plan.draft_tail.start
        if resumed is not None:  # the checkpoint or snapshot this request resumes from stays resident longest
            self.records.touch(resumed)
        elif plan.hit_pages:  # a hit refreshes the record it ends on, so reused documents stay resident
            record = self.records.find(self.index.key_of(plan.hit_pages[-1]))
            if record is not None:
                self.records.touch(record.record_id)
        self.leases.add(lease)
        return lease

    def _record_holding(self, partial_slot: int) -> int:
        assert self.tails is not None, "a partial-KV restore needs the tails type"
        record = self.tails.record_holding(partial_slot)
        assert record is not None, "a restore slot is always some record's snapshot"
        return record.record_id

    @_bookkept
    def finish_restore(self, lease: Lease) -> None:
        """The engine copied the lease's snapshots (partial page, recurrent state) in: unpin them (their record
        keeps them). One restore per request, whatever it copied."""
        if lease.restore_slot is None and lease.restore_recurrent_slot is None:
            return
        self._unpin_restores(lease)
        self.metrics.restores += 1

    def _unpin_restores(self, lease: Lease) -> None:
        if lease.restore_slot is not None:
            self.partial_snapshots.unpin([lease.restore_slot])
            lease.restore_slot = None
        if lease.restore_recurrent_slot is not None:
            self.recurrent_snapshots.unpin([lease.restore_recurrent_slot])
            lease.restore_recurrent_slot = None

    def _count_admission(self, plan: ReusePlan, lease: Lease, lookup: bool) -> None:
        m = self.metrics
        m.admitted_sequences += 1
        if lease.extras.media:
            m.media_aware_sequences += 1
        if not lookup or lease.forced_cold:
            m.lookup_bypass_sequences += 1
        if lease.forced_cold:
            m.forced_cold_sequences += 1
        if lookup:
            m.plans[plan.kind] += 1
            m.matched_tokens += plan.matched_tokens
        if plan.replayed_page and not lease.forced_cold:
            m.full_page_replays += 1
        if lease.reuse_tokens > 0:
            m.hit_sequences += 1
            m.reused_tokens += lease.reuse_tokens

    # --- grow ---------------------------------------------------------------------------------------

    @_bookkept
    def try_grow(self, lease: Lease, num_tokens: int) -> bool:
        """Make the lease's pages cover positions [0, num_tokens), evicting records if needed; False (and
        nothing changed) when the pool cannot, so the scheduler can preempt another sequence and retry."""
        if self.attention is None:
            return True
        pages = pages_for(num_tokens, self.tokens_per_page)
        return self._grow(lease, pages - len(lease.page_ids), self._draft_missing(lease, pages))

    @_bookkept
    def try_grow_draft(self, lease: Lease, num_tokens: int) -> bool:
        """Draft pages (only) covering positions [0, num_tokens) of a speculative lease: where a drafter writes the
        K/V of its own proposals before the base verifies them. False (nothing changed) when the pool cannot."""
        return self._grow(lease, 0, self._draft_missing(lease, pages_for(num_tokens, self.tokens_per_page)))

    def _draft_missing(self, lease: Lease, pages: int) -> int:
        return 0 if lease.draft_page_ids is None else max(pages - len(lease.draft_page_ids), 0)

    def _grow(self, lease: Lease, base: int, draft: int) -> bool:
        base = max(base, 0)
        if not base and not draft:
            return True
        # least_recent_first is lazy: the LRU order is copied only when some record must go.
        victims = plan_eviction(Demand(base_kv_pages=base, draft_kv_pages=draft), self.pools,
                                self.records.least_recent_first())
        if victims is None:
            return False
        self._evict(victims)
        lease.page_ids.extend(self.pages.allocate(base))
        if draft:
            assert lease.draft_page_ids is not None
            lease.draft_page_ids.extend(self.pools.draft_kv_pages.allocate(draft))
        return True

    # --- in-flight indexing and publication ---------------------------------------------------------

    @_bookkept
    def index_computed(self, lease: Lease, token_ids: list[int] | np.ndarray, num_computed: int) -> None:
        """Index the lease's full pages among its first `num_computed` tokens (up to its indexable limit), so
        a request arriving mid-prefill hits the chunks already done. No record: the pages stay pinned by
        the lease, and a lease released without publishing takes them back with it. Nothing on a checkpoint
        deployment: there a page is indexed on publication, with its checkpoint."""
        attention = self.attention
        if not (self.enabled and lease.may_publish) or attention is None or not attention.shares_in_flight:
            return
        upto = min(num_computed // self.tokens_per_page, lease.indexable_pages, len(lease.page_ids))
        if upto <= lease.indexed_pages:
            return
        tokens = np.asarray(token_ids, dtype=np.int32)
        self._extend_keys(lease, tokens, upto)
        attention.index_computed(lease, tokens, upto)

    @_bookkept
    def publish(self, lease: Lease, token_ids: list[int] | np.ndarray, boundary: bool = False) -> PublishResult:
        """Publish `token_ids` (tokens whose K/V the lease's pages hold) as one record: its full pages, and
        with a snapshot pool a copy of the partial tail page (an exact checkpoint). On a hybrid or pure
        recurrent deployment every publication is an exact checkpoint (all or nothing); the lease must have
        computed exactly `token_ids` at that moment, so a chunk that runs past a capture point (e.g. a
        recompute after preemption crossing the prompt's end) must not publish that point: the live state would
        be filed under a shorter key. `boundary` marks a mid-sequence capture (metrics only).

        Snapshot slots are reserved first (evicting LRU records that hold some), so the eviction can never free a
        canonical page this record is about to reference. No slot: a checkpoint is skipped, a plain record keeps
        only its full pages; both are counted, never an error.
        """
        if not (self.enabled and lease.may_publish):
            return PublishResult.SKIPPED
        tokens = np.asarray(token_ids, dtype=np.int32)
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
        if self.attention is not None:
            self.attention.project(lease, publication)
            if len(publication.page_ids) < len(publication.keys):  # a key held other tokens (a hash collision)
                self._drop_reserved(publication)
                if publication.exact or not publication.page_ids:
                    return PublishResult.SKIPPED
                pages = publication.page_ids
                publication = publication.full_pages_only(len(pages))  # publish the prefix the collision left
                publication.page_ids = pages
                if self.records.find(publication.terminal_key) is not None:
                    return PublishResult.EXISTING
        if self.drafts is not None and lease.draft_page_ids is not None:
            self.drafts.project(lease.draft_page_ids, lease.draft_computed_tokens, publication, lease.draft_hidden,
                                lease.draft_hidden_start)
        self._capture(lease, publication, boundary)
        return self._commit(lease, publication)

    def _endpoint(self, lease: Lease, tokens: np.ndarray) -> Publication | None:
        """What publishing `tokens` keeps, or None when there is nothing to keep. With checkpoints the endpoint
        is exact (the lease must hold every token's page); otherwise its full pages, plus its tail page when the
        tails can capture one."""
        T = self.tokens_per_page
        if self.recurrent is not None:
            full, tail = divmod(len(tokens), T)
            if not len(tokens) or (self.attention is not None and len(lease.page_ids) < pages_for(len(tokens), T)):
                return None
            keys = self._extend_keys(lease, tokens, full)
            return Publication(tokens, keys, self._tail_key(keys, tokens, lease.extras) if tail else b"", exact=True,
                               partial=self.attention is not None and tail > 0, recurrent=True)
        full = min(len(tokens) // T, len(lease.page_ids))
        tail = len(tokens) - full * T if len(lease.page_ids) > full else 0
        partial = 0 < tail < T and self.tails is not None and self.tails.captures
        if full == 0 and not partial:
            return None
        keys = self._extend_keys(lease, tokens, full)
        return Publication(tokens, keys, self._tail_key(keys, tokens, lease.extras) if partial else b"", exact=False,
                           partial=partial, recurrent=False)

    def _touch_existing(self, terminal_key: bytes, lease: Lease) -> bool:
        existing = self.records.find(terminal_key)
        if existing is None:
            return False
        self.records.touch(existing.record_id)
        self.metrics.publications_existing += 1
        self._upgrade(existing, lease)
        return True

    def _upgrade(self, existing: Record, lease: Lease) -> None:
        """A speculative publication of an endpoint already cached with a shorter draft path (base-only, or one
        published before the draft caught up) gives the record its path: speculative requests can use it from now."""
        drafts = self.drafts
        if drafts is None or lease.draft_page_ids is None:
            return
        probe = Publication(np.asarray(existing.token_ids, dtype=np.int32), list(existing.keys), b"", False, False,
                            False, page_ids=list(existing.page_ids))
        drafts.project(lease.draft_page_ids, lease.draft_computed_tokens, probe, lease.draft_hidden,
                       lease.draft_hidden_start)
        if drafts.records is not None:  # a checkpoint: worth a path only with its tail, which it lacked
            if existing.draft_tail is not None or probe.draft_tail is None:
                return
        elif len(probe.draft_page_ids) <= len(existing.draft_page_ids):
            return
        upgraded = replace(existing, draft_page_ids=tuple(probe.draft_page_ids), draft_tail=probe.draft_tail)
        drafts.pool.add_cache_ref(upgraded.draft_page_ids)
        drafts.pool.drop_cache_ref(existing.draft_page_ids)
        refiled = [kind for kind in (drafts, self.tails) if kind is not None]  # the types that file record objects
        for kind in refiled:
            kind.on_evict(existing)
        self.records.replace(upgraded)
        for kind in refiled:
            kind.on_commit(upgraded)
        self.metrics.pair_publications += 1

    def _reserve_slots(self, publication: Publication) -> bool:
        """Free (evicting LRU records) and pin the snapshot slots `publication` needs; False when pins forbid it."""
        needs = {kind.pool.name: kind.publication_slots(publication) for kind in self.types}
        if not any(needs.values()):
            return True
        if not self._reserve(Demand(**needs)):
            return False
        if publication.recurrent:
            [publication.recurrent_slot] = self.recurrent_snapshots.allocate(1)
        if publication.partial:
            [publication.partial_slot] = self.partial_snapshots.allocate(1)
        return True

    def _drop_reserved(self, publication: Publication) -> None:
        if publication.recurrent_slot is not None:
            self.recurrent_snapshots.unpin([publication.recurrent_slot])
            publication.recurrent_slot = None
        if publication.partial_slot is not None:
            self.partial_snapshots.unpin([publication.partial_slot])
            publication.partial_slot = None

    def _capture(self, lease: Lease, publication: Publication, boundary: bool) -> None:
        """Copy the reserved snapshots: the recurrent state, then the tail page. One wait for the call that wrote
        them, whatever it copies."""
        if publication.recurrent_slot is not None:
            assert self.recurrent is not None
            self.recurrent.capture(lease, publication)
            if boundary:
                self.metrics.boundary_captures += 1
            else:
                self.metrics.endpoint_captures += 1
        if publication.partial_slot is not None:
            assert self.tails is not None
            self.tails.capture(lease, publication)
        if publication.recurrent_slot is not None or publication.partial_slot is not None:
            self.metrics.capture_synchronizations += 1

    def _reserve(self, demand: Demand) -> bool:
        """Make `demand` allocatable by evicting least recently used records; False when pins forbid it."""
        victims = plan_eviction(demand, self.pools, self.records.least_recent_first())
        if victims is None:
            return False
        self._evict(victims)
        return True

    def _commit(self, lease: Lease, publication: Publication) -> PublishResult:
        """The one commit tail: the record takes a cache reference on what each type holds of it, the reserved
        snapshot slots are unpinned (the record alone keeps them), and the listener hears of it."""
        covered = len(publication.tokens) if publication.tail_key else len(publication.keys) * self.tokens_per_page
        record = Record(self.records.new_id(), tuple(publication.keys), tuple(publication.page_ids),
                        tuple(publication.tokens[:covered].tolist()), lease.extras, publication.tail_key,
                        publication.partial_slot, publication.recurrent_slot, tuple(publication.draft_page_ids),
                        draft_tail=publication.draft_tail)
        if record.draft_page_ids:
            self.metrics.pair_publications += 1
        for kind in self.types:
            held = kind.held(record)
            kind.pool.add_cache_ref(held)
            if kind.publication_slots(publication):
                kind.pool.unpin(held)
            kind.on_commit(record)
        self.records.insert(record)
        self.metrics.publications_committed += 1
        self.events.committed(record)
        while len(self.records) > self.max_records:  # max_records == 0 evicts the new record right away
            self._evict([self.records.oldest_id()])
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
        """Return the lease's pages. Pages nobody else holds go back to the free list (and leave the index)."""
        if lease.released:
            return
        lease.released = True
        self.leases.discard(lease)
        if self.attention is not None:
            self.attention.forget_in_flight(lease)
        self._unpin_restores(lease)  # admitted but never run: the snapshots were not copied
        self.pages.unpin(lease.page_ids)
        if lease.draft_page_ids is not None:
            self.pools.draft_kv_pages.unpin(lease.draft_page_ids)

    def _evict(self, record_ids: list[int]) -> None:
        """The one eviction point: each type drops the record's cache references and forgets it."""
        for record_id in record_ids:
            record = self.records.remove(record_id)
            for kind in self.types:
                self.metrics.reclaimed[kind.pool.name] += kind.pool.drop_cache_ref(kind.held(record))
                kind.on_evict(record)
            self.metrics.records_evicted += 1
            self.events.evicted(record)

    # --- reporting and audits -----------------------------------------------------------------------

    def profile(self) -> dict:
        return self.metrics.to_dict(len(self.records), self.pools.to_dict())

    def check_invariants(self) -> None:
        """Audit every refcount, index entry and in-flight key from scratch (tests call this after each step)."""
        check_invariants(self)
