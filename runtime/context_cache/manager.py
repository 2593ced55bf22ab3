"""The context-cache manager: sole owner of the KV pages; admission asks before it changes anything.

With reuse disabled it is a plain page allocator (no lookup, no index, no records), so both modes run
the same code path. The scheduler talks to it through five calls:

    prefix_in_flight(admission) -> bool     another running sequence is computing this prefix: wait for it
    try_acquire(admission) -> Lease | None  pages for a new sequence, or None when the pool cannot hold it now
    try_grow(lease, num_tokens) -> bool     more pages for a running sequence, or False (the caller preempts)
    index_computed(lease, tokens, n)        pages finished by a prefill chunk become findable at once
    publish(lease, tokens) / release(lease) a record for a finished sequence; return the lease's pages

With a partial-KV snapshot pool (`partial_kv_snapshot_slots` > 0) a publication whose length is not
page-aligned also keeps a copy of its partial tail page, and an admission that extends that exact
prefix gets `lease.restore_slot`: the engine copies the snapshot into the lease's first private page
(the `SnapshotCopier` given at construction and the engine's restore do the copies; this module never
touches K/V bytes) and calls `finish_restore`. A capture that finds no slot, even after evicting records
that hold snapshots, is skipped and counted (`snapshot_pressure_skips`); the publication then keeps only
the full pages.

None of them raises for a full pool: only a request that cannot fit alone in an empty pool is an error,
and that is the engine's call (`fits_alone`).

Hybrid and pure recurrent deployments (`Deployment`) reuse ONLY exact checkpoints: a recurrent layer's state after
L tokens cannot be rebuilt from KV pages, so a page hit without the state is worthless. A checkpoint is a record
of exactly L tokens holding a recurrent snapshot (every recurrent layer's state + conv state, `capture_recurrent`)
and, on a hybrid with L not page-aligned, a partial-KV snapshot of its tail page, plus (hybrid) cache refs on its
floor(L/T) full pages. Token layout of a hybrid lease resuming from a checkpoint of L = h*T + r tokens:

    |<-- reuse_tokens = L ----------------------------------------->|
    | page 0 | ... | page h-1 (hits: the checkpoint's canonical pages)| page h: r restored tokens, computing ->| ... |
                                                                    |<- restore_slot (partial-KV snapshot) ->|
    recurrent + conv state of the sequence <- restore_recurrent_slot (state after exactly L tokens)

Lookup walks the input's own chain keys from the deepest page down: checkpoints are filed by (last full page
key, length), so only lengths hanging off a page this input shares are looked at, and each costs one tail hash
(none when aligned). The longest checkpoint strictly shorter than the input whose exact key, tokens and (hybrid)
canonical pages match wins; no checkpoint means a cold start (`restore_recurrent_slot` None: the engine zeroes the
state). Publication is capture: `publish(lease, tokens)` may be called mid-prefill at every chat-message boundary
or snapshot interval and at the prefill and decode ends, each time with exactly the tokens the lease has computed.
A pure recurrent deployment has no KV pages at all (pool capacity 0, leases hold none); its records still carry
the chain keys of their logical blocks, so content addressing (tokens, adapter, salt, media) is the same. Nothing
is indexed in flight there (a page hit alone is useless), so `prefix_in_flight` is always False.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.paging import pages_for
from kvforge.runtime.context_cache.audit import check_invariants
from kvforge.runtime.context_cache.capture import SnapshotCopier
from kvforge.runtime.context_cache.eviction import plan_eviction
from kvforge.runtime.context_cache.index import PageIndex, page_token_bytes
from kvforge.runtime.context_cache.keys import CHAIN_ROOT, KeyExtras, page_keys, tail_page_key
from kvforge.runtime.context_cache.lease import Admission, Lease
from kvforge.runtime.context_cache.metrics import CacheMetrics
from kvforge.runtime.context_cache.planner import ReusePlan, plan_checkpoint, plan_cold, plan_reuse, with_snapshot
from kvforge.runtime.context_cache.pools import Demand, ResourcePools
from kvforge.runtime.context_cache.records import Record, RecordStore
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
                 max_records: int = DEFAULT_MAX_RECORDS, partial_kv_snapshot_slots: int = 0,
                 recurrent_snapshot_slots: int = 0, deployment: Deployment = Deployment.VANILLA,
                 copier: SnapshotCopier | None = None) -> None:
        """`copier` moves snapshot bytes (the engine's state manager); without one no snapshot is ever captured."""
        if max_records < 0:
            raise InvalidConfig(f"must be >= 0, got {max_records}", "context_cache_max_records")
        deployment = Deployment(deployment)
        checkpoints = deployment is not Deployment.VANILLA
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
        self.checkpoints = checkpoints  # exact-checkpoint reuse only (hybrid, pure recurrent)
        self.paged = deployment is not Deployment.PURE_RECURRENT  # the sequence keeps K/V in pages
        # Budgets a deployment cannot use are dropped (the engine decides whether passing one is an error).
        partial = partial_kv_snapshot_slots if enabled and self.paged else 0
        # A pure recurrent engine's build still names a KV pool size; nothing would ever use it, so its capacity is 0.
        self.pools = ResourcePools(num_pages if self.paged else 0, partial,
                                   recurrent_snapshot_slots if enabled and checkpoints else 0)
        self.pages = self.pools.base_kv_pages
        self.snapshots = self.pools.partial_kv_snapshots
        self.recurrent_snapshots = self.pools.recurrent_snapshots
        self.copier = copier
        self.index = PageIndex()
        self.records = RecordStore()
        self.metrics = CacheMetrics()
        self.pages.on_free = self.index.forget_page
        self.leases: set[Lease] = set()
        self._inflight: dict[bytes, Lease] = {}  # page key -> the running lease computing that page
        self.bookkeeping_nanoseconds = 0  # all calls below, for benchmarks (the profile has planning time)

    @property
    def in_flight(self) -> Mapping[bytes, Lease]:
        """Read-only view of the pages running sequences are computing: page key -> the lease computing it."""
        return MappingProxyType(self._inflight)

    # --- questions (no side effects beyond caching an admission's keys) -----------------------------

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` could run in this pool if nothing else held a page."""
        return not self.paged or pages_for(num_tokens, self.tokens_per_page) <= self.pages.capacity

    @_bookkept
    def prefix_in_flight(self, admission: Admission) -> bool:
        """True when the first page this admission would compute is being computed by a running sequence:
        waiting a few steps turns that page (and the ones after it) into hits instead of duplicate work."""
        if self.checkpoints or not self._looks_up(admission) or not self._inflight:
            return False
        keys = self._keys(admission)
        hits = self.index.lookup_longest(keys, np.asarray(admission.token_ids, dtype=np.int32), self.tokens_per_page)
        return len(hits) < len(keys) and keys[len(hits)] in self._inflight

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
            keys = self._keys(admission)
            if self.checkpoints:
                plan = self._checkpoint_hit(tokens, keys, admission.extras)
            else:
                plan = plan_reuse(len(tokens), self.tokens_per_page,
                                  self.index.lookup_longest(keys, tokens, self.tokens_per_page), admission.extras.media)
                if self.snapshots.capacity:
                    plan = self._snapshot_hit(plan, tokens, keys, admission.extras)
        else:
            plan = plan_cold(len(tokens), self.tokens_per_page, paged=self.paged)
        lease = self._try_acquire(plan, admission.extras, may_publish=lookup)
        if lease is None and plan.hit_pages:
            # Pinned hits can leave too little to evict; a cold run may still fit (evicting those records).
            lease = self._try_acquire(plan_cold(len(tokens), self.tokens_per_page, paged=self.paged), admission.extras,
                                      may_publish=False)
            if lease is not None:
                lease.forced_cold = True
        if lease is not None:
            if not lease.forced_cold:
                lease.keys = list(keys)  # publication reuses the prompt's keys instead of hashing twice
                lease.indexed_pages = len(plan.hit_pages)
            if lease.may_publish and not self.checkpoints:
                indexable = len(tokens) if admission.indexable_tokens is None else admission.indexable_tokens
                lease.indexable_pages = min(indexable, len(tokens)) // self.tokens_per_page
                self._register_inflight(lease)
            self._count_admission(plan, lease, lookup)
        self.metrics.planning_nanoseconds += time.perf_counter_ns() - started
        return lease

    def _looks_up(self, admission: Admission) -> bool:
        return self.enabled and admission.lookup_policy is LookupPolicy.USE_CACHE

    def _keys(self, admission: Admission) -> list[bytes]:
        if admission.keys is None:
            admission.keys = page_keys(admission.token_ids, self.tokens_per_page, admission.extras)
        return admission.keys

    def _snapshot_hit(self, plan: ReusePlan, tokens: np.ndarray, keys: list[bytes], extras: KeyExtras) -> ReusePlan:
        """`plan` extended by the longest snapshot tail that continues its hit pages along `tokens`, leaving at
        least one token to compute (for logits). Candidates follow the last hit page's key; each is checked by
        its tail key (adapter and salt included) and its token ids."""
        base = len(plan.hit_pages)
        start = base * self.tokens_per_page
        parent = keys[base - 1] if base else None
        best: tuple[int, Record] | None = None
        for record in self.records.tails_after(parent):
            tail = len(record.token_ids) - start
            if not 0 < tail < len(tokens) - start or (best is not None and tail <= best[0]):
                continue
            candidate = tokens[start:start + tail]
            if record.page_ids != plan.hit_pages or list(record.token_ids[start:]) != candidate.tolist():
                continue
            if tail_page_key(parent or CHAIN_ROOT, tokens[:start + tail], start, extras) == record.tail_key:
                best = (tail, record)
        if best is None:
            return plan
        assert best[1].partial_slot is not None
        return with_snapshot(plan, best[1].partial_slot, best[0])

    def _checkpoint_hit(self, tokens: np.ndarray, keys: list[bytes], extras: KeyExtras) -> ReusePlan:
        """The longest exact checkpoint strictly shorter than `tokens`, or a cold plan. Walks this input's chain
        keys from the deepest full page down to the root; at each, only the checkpoint lengths filed under that
        page are candidates, each checked by its exact key, its tokens and (hybrid) its canonical pages."""
        T = self.tokens_per_page
        hits: list[int] | None = None  # the index's canonical pages for this input, looked up once if needed
        for depth in range((len(tokens) - 1) // T, -1, -1):
            anchor = keys[depth - 1] if depth else None
            for length in self.records.checkpoint_lengths_after(anchor):
                if length >= len(tokens) or any(m.start < length < m.start + m.length for m in extras.media):
                    continue  # the whole input (one token must compute), or resuming inside a media span
                key = tail_page_key(anchor or CHAIN_ROOT, tokens[:length], depth * T, extras) if length % T \
                    else anchor
                record = self.records.find(key) if key is not None else None
                if record is None or not record.is_checkpoint or record.token_ids != tuple(tokens[:length].tolist()):
                    continue
                if self.paged:
                    if hits is None:
                        hits = self.index.lookup_longest(keys, tokens, T)
                    if tuple(hits[:depth]) != record.page_ids:
                        continue
                return plan_checkpoint(len(tokens), T, paged=self.paged, length=length, hit_pages=record.page_ids,
                                       recurrent_slot=record.recurrent_slot, partial_slot=record.partial_slot,
                                       record_id=record.record_id)
        return plan_checkpoint(len(tokens), T, paged=self.paged)

    def _try_acquire(self, plan: ReusePlan, extras: KeyExtras, may_publish: bool) -> Lease | None:
        self.pages.pin(plan.hit_pages)  # pin before evicting: the plan's own hits are never victims
        restore = () if plan.restore_slot is None else (plan.restore_slot,)
        recurrent = () if plan.restore_recurrent_slot is None else (plan.restore_recurrent_slot,)
        self.snapshots.pin(restore)
        self.recurrent_snapshots.pin(recurrent)
        # The record a snapshot or checkpoint hit resumes from is never a victim of its own admission.
        resumed = plan.checkpoint_record if plan.checkpoint_record is not None else \
            self._snapshot_record(plan.restore_slot).record_id if plan.restore_slot is not None else None
        victims = plan_eviction(Demand(base_kv_pages=plan.new_pages), self.pools, self.records.least_recent_first(),
                                protected=resumed)
        if victims is None:
            self.pages.unpin(plan.hit_pages)
            self.snapshots.unpin(restore)
            self.recurrent_snapshots.unpin(recurrent)
            return None
        self._evict(victims)
        private = self.pages.allocate(plan.new_pages)
        lease = Lease(extras, [*plan.hit_pages, *private], plan.reuse_tokens, plan.matched_tokens, plan.kind,
                      may_publish, restore_slot=plan.restore_slot, restore_tokens=plan.restore_tokens,
                      restore_recurrent_slot=plan.restore_recurrent_slot)
        if resumed is not None:  # the checkpoint or snapshot this request resumes from stays resident longest
            self.records.touch(resumed)
        elif plan.hit_pages:  # a hit refreshes the record it ends on, so reused documents stay resident
            record = self.records.find(self.index.key_of(plan.hit_pages[-1]))
            if record is not None:
                self.records.touch(record.record_id)
        self.leases.add(lease)
        return lease

    def _snapshot_record(self, slot: int) -> Record:
        return next(r for r in self.records.least_recent_first() if r.partial_slot == slot)

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
            self.snapshots.unpin([lease.restore_slot])
            lease.restore_slot = None
        if lease.restore_recurrent_slot is not None:
            self.recurrent_snapshots.unpin([lease.restore_recurrent_slot])
            lease.restore_recurrent_slot = None

    def _register_inflight(self, lease: Lease) -> None:
        """Announce the full pages this lease will compute, so identical prefixes wait instead of duplicating."""
        for key in lease.keys[lease.indexed_pages:lease.indexable_pages]:
            # A full-input rewind recomputes its last matched page: that page is indexed already, not in flight.
            if key not in self._inflight and not self.index.contains(key):
                self._inflight[key] = lease
                lease.inflight_keys.append(key)

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
        if lease.reuse_tokens > 0:
            m.hit_sequences += 1
            m.reused_tokens += lease.reuse_tokens

    # --- grow ---------------------------------------------------------------------------------------

    @_bookkept
    def try_grow(self, lease: Lease, num_tokens: int) -> bool:
        """Make the lease's pages cover positions [0, num_tokens), evicting records if needed; False (and
        nothing changed) when the pool cannot, so the scheduler can preempt another sequence and retry."""
        missing = pages_for(num_tokens, self.tokens_per_page) - len(lease.page_ids)
        if missing <= 0 or not self.paged:
            return True
        victims = plan_eviction(Demand(base_kv_pages=missing), self.pools, self.records.least_recent_first())
        if victims is None:
            return False
        self._evict(victims)
        lease.page_ids.extend(self.pages.allocate(missing))
        return True

    # --- in-flight indexing and publication ---------------------------------------------------------

    @_bookkept
    def index_computed(self, lease: Lease, token_ids: list[int] | np.ndarray, num_computed: int) -> None:
        """Index the lease's full pages among its first `num_computed` tokens (up to its indexable limit), so
        a request arriving mid-prefill hits the chunks already done. No record: the pages stay pinned by
        the lease, and a lease released without publishing takes them back with it."""
        if not (self.enabled and lease.may_publish) or self.checkpoints:
            return  # a checkpoint deployment never uses a bare page hit: its pages are indexed on publication
        upto = min(num_computed // self.tokens_per_page, lease.indexable_pages, len(lease.page_ids))
        if upto <= lease.indexed_pages:
            return
        tokens = np.asarray(token_ids, dtype=np.int32)
        self._extend_keys(lease, tokens, upto)
        for i in range(lease.indexed_pages, upto):
            key = lease.keys[i]
            if self._inflight.get(key) is lease:
                del self._inflight[key]
            token_bytes = page_token_bytes(tokens, i, self.tokens_per_page)
            if not self.index.contains(key) and self.index.key_of(lease.page_ids[i]) == b"":
                self.index.insert(key, lease.page_ids[i], token_bytes)
        lease.indexed_pages = upto

    @_bookkept
    def publish(self, lease: Lease, token_ids: list[int] | np.ndarray, boundary: bool = False) -> str:
        """Publish `token_ids` (tokens whose K/V the lease's pages hold) as one record: its full pages, and
        with a snapshot pool a copy of the partial tail page (an exact checkpoint). On a hybrid or pure
        recurrent deployment every publication is an exact checkpoint (`_publish_checkpoint`); the lease must
        have computed exactly `token_ids` at that moment, so a chunk that runs past a capture point (e.g. a
        recompute after preemption crossing the prompt's end) must not publish that point: the live state would
        be filed under a shorter key. `boundary` marks a mid-sequence capture (metrics only).

        Returns "committed" (new record), "existing" (same endpoint already cached: touched) or
        "skipped" (publication not allowed, nothing to publish, or no snapshot slot for a checkpoint).
        """
        if not (self.enabled and lease.may_publish):
            return "skipped"
        tokens = np.asarray(token_ids, dtype=np.int32)
        if self.checkpoints:
            return self._publish_checkpoint(lease, tokens, boundary)
        T = self.tokens_per_page
        num_pages = min(len(tokens) // T, len(lease.page_ids))
        tail = len(tokens) - num_pages * T if len(lease.page_ids) > num_pages else 0
        snapshot = 0 < tail < T and self.snapshots.capacity > 0 and self.copier is not None
        if num_pages == 0 and not snapshot:
            return "skipped"
        self._extend_keys(lease, tokens, num_pages)
        keys = lease.keys[:num_pages]
        self.metrics.publication_attempts += 1
        tail_key = tail_page_key(keys[-1] if keys else CHAIN_ROOT, tokens, num_pages * T, lease.extras) \
            if snapshot else b""
        existing = self.records.find(tail_key or keys[-1])
        if existing is not None:
            self.records.touch(existing.record_id)
            self.metrics.publications_existing += 1
            return "existing"
        # Reserve the snapshot before projecting onto canonical pages: the eviction it may need must not free
        # a canonical page this record is about to reference.
        slot = self._reserve_snapshot() if snapshot else None
        if snapshot and slot is None:
            self.metrics.snapshot_pressure_skips += 1
            if num_pages == 0:
                return "skipped"
            tail_key = b""
            existing = self.records.find(keys[-1])
            if existing is not None:
                self.records.touch(existing.record_id)
                self.metrics.publications_existing += 1
                return "existing"
        canonical = self._canonical_pages(lease, tokens, keys)
        if len(canonical) < num_pages:  # a key held different tokens (a hash collision): publish the prefix
            if slot is not None:
                self.snapshots.unpin([slot])
                slot, tail_key = None, b""
            if not canonical:
                return "skipped"
            keys = keys[:len(canonical)]
            if self.records.find(keys[-1]) is not None:
                return "existing"
        covered = len(tokens) if slot is not None else len(keys) * T
        record = Record(self.records.new_id(), tuple(keys), tuple(canonical), tuple(int(t) for t in tokens[:covered]),
                        lease.extras, tail_key, slot)
        if slot is not None:
            assert self.copier is not None
            self.copier.capture_partial(lease.page_ids[num_pages], slot)
            self.metrics.capture_synchronizations += 1  # the copy waits for the call that wrote the page
            self.snapshots.add_cache_ref([slot])
            self.snapshots.unpin([slot])
        self.pages.add_cache_ref(record.page_ids)
        self.records.insert(record)
        self.metrics.publications_committed += 1
        while len(self.records) > self.max_records:  # max_records == 0 evicts the new record right away
            self._evict([self.records.oldest_id()])
        return "committed"

    def _publish_checkpoint(self, lease: Lease, tokens: np.ndarray, boundary: bool) -> str:
        """Capture the lease's state after exactly len(tokens) tokens as a checkpoint record: a recurrent snapshot,
        a partial-KV snapshot of the tail page when hybrid and unaligned, and (hybrid) its canonical full pages.
        Snapshot slots are reserved first (evicting LRU records that hold some), so the eviction can never free a
        canonical page this record is about to reference; no slot means skipped and counted, never an error."""
        T = self.tokens_per_page
        full, tail = divmod(len(tokens), T)
        if not len(tokens) or (self.paged and len(lease.page_ids) < pages_for(len(tokens), T)):
            return "skipped"
        self._extend_keys(lease, tokens, full)
        keys = lease.keys[:full]
        key = tail_page_key(keys[-1] if keys else CHAIN_ROOT, tokens, full * T, lease.extras) if tail else keys[-1]
        self.metrics.publication_attempts += 1
        existing = self.records.find(key)
        if existing is not None:
            self.records.touch(existing.record_id)
            self.metrics.publications_existing += 1
            return "existing"
        partial = self.paged and tail > 0
        if not self._reserve(Demand(recurrent_snapshots=1, partial_kv_snapshots=int(partial))):
            self.metrics.snapshot_pressure_skips += 1
            return "skipped"
        [recurrent_slot] = self.recurrent_snapshots.allocate(1)
        partial_slot = self.snapshots.allocate(1)[0] if partial else None
        canonical = self._canonical_pages(lease, tokens, keys) if self.paged else []
        if self.paged and len(canonical) < full:  # a key held different tokens (a hash collision): keep nothing
            self._drop_reserved(recurrent_slot, partial_slot)
            return "skipped"
        assert self.copier is not None, "a checkpoint deployment with reuse is built with a copier"
        self.copier.capture_recurrent(lease, recurrent_slot)
        if partial_slot is not None:
            self.copier.capture_partial(lease.page_ids[full], partial_slot)
        self.metrics.capture_synchronizations += 1  # one wait for the call that wrote the state, whatever it copies
        if boundary:
            self.metrics.boundary_captures += 1
        else:
            self.metrics.endpoint_captures += 1
        record = Record(self.records.new_id(), tuple(keys), tuple(canonical), tuple(tokens.tolist()), lease.extras,
                        key if tail else b"", partial_slot, recurrent_slot)
        self.recurrent_snapshots.add_cache_ref([recurrent_slot])
        self.recurrent_snapshots.unpin([recurrent_slot])
        if partial_slot is not None:
            self.snapshots.add_cache_ref([partial_slot])
            self.snapshots.unpin([partial_slot])
        self.pages.add_cache_ref(record.page_ids)
        self.records.insert(record)
        self.metrics.publications_committed += 1
        while len(self.records) > self.max_records:
            self._evict([self.records.oldest_id()])
        return "committed"

    def _reserve(self, demand: Demand) -> bool:
        """Make `demand` allocatable by evicting least recently used records; False when pins forbid it."""
        victims = plan_eviction(demand, self.pools, self.records.least_recent_first())
        if victims is None:
            return False
        self._evict(victims)
        return True

    def _drop_reserved(self, recurrent_slot: int, partial_slot: int | None) -> None:
        self.recurrent_snapshots.unpin([recurrent_slot])
        if partial_slot is not None:
            self.snapshots.unpin([partial_slot])

    def _reserve_snapshot(self) -> int | None:
        """A free snapshot slot (pinned), evicting the least recently used records holding snapshots if none
        is free; None when every slot is pinned by a restore in flight."""
        if not self._reserve(Demand(partial_kv_snapshots=1)):
            return None
        return self.snapshots.allocate(1)[0]

    def _extend_keys(self, lease: Lease, tokens: np.ndarray, num_pages: int) -> None:
        if len(lease.keys) < num_pages:
            parent = lease.keys[-1] if lease.keys else CHAIN_ROOT
            lease.keys.extend(page_keys(tokens[:num_pages * self.tokens_per_page], self.tokens_per_page,
                                        lease.extras, parent=parent, first_page=len(lease.keys)))

    def _canonical_pages(self, lease: Lease, tokens: np.ndarray, keys: list[bytes]) -> list[int]:
        """First committer wins: a key already indexed maps to its page (projection); new keys index ours."""
        canonical = []
        for i, key in enumerate(keys):
            token_bytes = page_token_bytes(tokens, i, self.tokens_per_page)
            page = self.index.canonical(key, token_bytes)
            if page is None:
                if self.index.contains(key) or self.index.key_of(lease.page_ids[i]) != b"":
                    break
                page = lease.page_ids[i]
                self.index.insert(key, page, token_bytes)
            canonical.append(page)
        return canonical

    # --- release and eviction -----------------------------------------------------------------------

    @_bookkept
    def release(self, lease: Lease) -> None:
        """Return the lease's pages. Pages nobody else holds go back to the free list (and leave the index)."""
        if lease.released:
            return
        lease.released = True
        self.leases.discard(lease)
        for key in lease.inflight_keys:
            if self._inflight.get(key) is lease:
                del self._inflight[key]
        lease.inflight_keys.clear()
        self._unpin_restores(lease)  # admitted but never run: the snapshots were not copied
        self.pages.unpin(lease.page_ids)

    def _evict(self, record_ids: list[int]) -> None:
        for record_id in record_ids:
            record = self.records.remove(record_id)
            for name, slots in record.held().items():
                self.metrics.reclaimed[name] += self.pools[name].drop_cache_ref(slots)
            self.metrics.records_evicted += 1

    # --- reporting and audits -----------------------------------------------------------------------

    def profile(self) -> dict:
        return self.metrics.to_dict(len(self.records), self.pools.to_dict())

    def check_invariants(self) -> None:
        """Audit every refcount, index entry and in-flight key from scratch (tests call this after each step)."""
        check_invariants(self)
