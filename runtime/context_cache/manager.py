"""The context-cache manager: sole owner of the KV pages; admission asks before it changes anything.

With reuse disabled it is a plain page allocator (no lookup, no index, no records), so both modes run
the same code path. The scheduler talks to it through five calls:

    prefix_in_flight(admission) -> bool     another running sequence is computing this prefix: wait for it
    try_acquire(admission) -> Lease | None  pages for a new sequence, or None when the pool cannot hold it now
    try_grow(lease, num_tokens) -> bool     more pages for a running sequence, or False (the caller preempts)
    index_computed(lease, tokens, n)        pages finished by a prefill chunk become findable at once
    publish(lease, tokens) / release(lease) a record for a finished sequence; return the lease's pages

None of them raises for a full pool: only a request that cannot fit alone in an empty pool is an error,
and that is the engine's call (`fits_alone`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.paging import pages_for
from kvforge.runtime.context_cache.eviction import plan_eviction
from kvforge.runtime.context_cache.index import PageIndex, page_token_bytes
from kvforge.runtime.context_cache.keys import CHAIN_ROOT, KeyExtras, page_keys
from kvforge.runtime.context_cache.metrics import CacheMetrics
from kvforge.runtime.context_cache.planner import ReusePlan, plan_cold, plan_reuse
from kvforge.runtime.context_cache.pools import BASE_KV_PAGES, ResourcePool
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.types import LookupPolicy

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


@dataclass(slots=True)
class Admission:
    """What a sequence asks the pool for: K/V for every token in `token_ids`.

    `indexable_tokens` caps what may become findable while it runs (the prompt; generated tokens are
    published only when the sequence finishes normally). `keys` caches the chain keys between retries.
    """

    token_ids: list[int]
    extras: KeyExtras = field(default_factory=KeyExtras)
    lookup_policy: LookupPolicy = LookupPolicy.USE_CACHE
    indexable_tokens: int | None = None  # None = all of token_ids
    keys: list[bytes] | None = None


@dataclass(slots=True, eq=False)
class Lease:
    """One sequence's hold on the pool. Token layout of its page-table row (T tokens per page):

        |<-- reuse_tokens: hit pages (shared, pinned) -->|<-- computed here: private pages ---------->|
        | page 0 | page 1 | ...                | page h-1 | page h | ... | partial tail (never shared) |
        |<-- indexed_pages: findable by other sequences (hits + full pages indexed in flight) -->|

    `page_ids` grows with `try_grow`; `keys` are the chain keys of its full pages computed so far.
    """

    extras: KeyExtras
    page_ids: list[int]
    reuse_tokens: int
    matched_tokens: int
    plan_kind: str
    may_publish: bool
    forced_cold: bool = False
    keys: list[bytes] = field(default_factory=list)
    indexed_pages: int = 0
    indexable_pages: int = 0
    inflight_keys: list[bytes] = field(default_factory=list)  # keys this lease registered as being computed
    released: bool = False


class ContextCacheManager:
    def __init__(self, num_pages: int, tokens_per_page: int, *, enabled: bool,
                 max_records: int = DEFAULT_MAX_RECORDS) -> None:
        if max_records < 0:
            raise InvalidConfig(f"must be >= 0, got {max_records}", "context_cache_max_records")
        self.enabled = enabled
        self.tokens_per_page = tokens_per_page
        self.max_records = max_records
        self.pages = ResourcePool(BASE_KV_PAGES, num_pages)
        self.index = PageIndex()
        self.records = RecordStore()
        self.metrics = CacheMetrics()
        self.pages.on_free = self.index.forget_page
        self.leases: set[Lease] = set()
        self._inflight: dict[bytes, Lease] = {}  # page key -> the running lease computing that page
        self.bookkeeping_nanoseconds = 0  # all calls below, for benchmarks (the profile has planning time)

    # --- questions (no side effects beyond caching an admission's keys) -----------------------------

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` could run in this pool if nothing else held a page."""
        return pages_for(num_tokens, self.tokens_per_page) <= self.pages.capacity

    @_bookkept
    def prefix_in_flight(self, admission: Admission) -> bool:
        """True when the first page this admission would compute is being computed by a running sequence:
        waiting a few steps turns that page (and the ones after it) into hits instead of duplicate work."""
        if not self._looks_up(admission) or not self._inflight:
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
            plan = plan_reuse(len(tokens), self.tokens_per_page,
                              self.index.lookup_longest(keys, tokens, self.tokens_per_page), admission.extras.media)
        else:
            plan = plan_cold(len(tokens), self.tokens_per_page)
        lease = self._try_acquire(plan, admission.extras, may_publish=lookup)
        if lease is None and plan.hit_pages:
            # Pinned hits can leave too little to evict; a cold run may still fit (evicting those records).
            lease = self._try_acquire(plan_cold(len(tokens), self.tokens_per_page), admission.extras,
                                      may_publish=False)
            if lease is not None:
                lease.forced_cold = True
        if lease is not None:
            if not lease.forced_cold:
                lease.keys = list(keys)  # publication reuses the prompt's keys instead of hashing twice
                lease.indexed_pages = len(plan.hit_pages)
            if lease.may_publish:
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

    def _try_acquire(self, plan: ReusePlan, extras: KeyExtras, may_publish: bool) -> Lease | None:
        self.pages.pin(plan.hit_pages)  # pin before evicting: the plan's own hits are never victims
        victims = plan_eviction(plan.new_pages, self.pages, self.records.least_recent_first())
        if victims is None:
            self.pages.unpin(plan.hit_pages)
            return None
        self._evict(victims)
        private = self.pages.allocate(plan.new_pages)
        lease = Lease(extras, [*plan.hit_pages, *private], plan.reuse_tokens, plan.matched_tokens, plan.kind,
                      may_publish)
        if plan.hit_pages:  # a hit refreshes the record it ends on, so reused documents stay resident
            record = self.records.find(self.index.key_of(plan.hit_pages[-1]))
            if record is not None:
                self.records.touch(record.record_id)
        self.leases.add(lease)
        return lease

    def _register_inflight(self, lease: Lease) -> None:
        """Announce the full pages this lease will compute, so identical prefixes wait instead of duplicating."""
        for key in lease.keys[lease.indexed_pages:lease.indexable_pages]:
            if key not in self._inflight:
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
        if missing <= 0:
            return True
        victims = plan_eviction(missing, self.pages, self.records.least_recent_first())
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
        if not (self.enabled and lease.may_publish):
            return
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
    def publish(self, lease: Lease, token_ids: list[int] | np.ndarray) -> str:
        """Publish the full pages of `token_ids` (tokens whose K/V the lease's pages hold) as one record.

        Returns "committed" (new record), "existing" (same endpoint already cached: touched) or
        "skipped" (publication not allowed, or no full page).
        """
        if not (self.enabled and lease.may_publish):
            return "skipped"
        tokens = np.asarray(token_ids, dtype=np.int32)
        num_pages = min(len(tokens) // self.tokens_per_page, len(lease.page_ids))
        if num_pages == 0:
            return "skipped"
        self._extend_keys(lease, tokens, num_pages)
        keys = lease.keys[:num_pages]
        self.metrics.publication_attempts += 1
        existing = self.records.find(keys[-1])
        if existing is not None:
            self.records.touch(existing.record_id)
            self.metrics.publications_existing += 1
            return "existing"
        canonical = self._canonical_pages(lease, tokens, keys)
        if len(canonical) < num_pages:  # a key held different tokens (a hash collision): publish the prefix
            if not canonical:
                return "skipped"
            keys = keys[:len(canonical)]
            if self.records.find(keys[-1]) is not None:
                return "existing"
        record = Record(self.records.new_id(), tuple(keys), tuple(canonical),
                        tuple(int(t) for t in tokens[:len(keys) * self.tokens_per_page]), lease.extras)
        self.pages.add_cache_ref(record.page_ids)
        self.records.insert(record)
        self.metrics.publications_committed += 1
        while len(self.records) > self.max_records:  # max_records == 0 evicts the new record right away
            self._evict([self.records.oldest_id()])
        return "committed"

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
        self.pages.unpin(lease.page_ids)

    def _evict(self, record_ids: list[int]) -> None:
        for record_id in record_ids:
            record = self.records.remove(record_id)
            self.metrics.reclaimed[BASE_KV_PAGES] += self.pages.drop_cache_ref(record.page_ids)
            self.metrics.records_evicted += 1

    # --- reporting and audits -----------------------------------------------------------------------

    def profile(self) -> dict:
        return self.metrics.to_dict(len(self.records), {BASE_KV_PAGES: self.pages.to_dict()})

    def check_invariants(self) -> None:
        """Audit every refcount, index entry and in-flight key from scratch (tests call this after each step)."""
        capacity = self.pages.capacity
        active, cache = [0] * capacity, [0] * capacity
        for lease in self.leases:
            for page in lease.page_ids:
                active[page] += 1
        for record in self.records.least_recent_first():
            assert len(record.page_ids) == len(record.keys)
            assert page_keys(record.token_ids, self.tokens_per_page, record.extras) == list(record.keys)
            tokens = np.asarray(record.token_ids, dtype=np.int32)
            for i, (key, page) in enumerate(zip(record.keys, record.page_ids, strict=True)):
                cache[page] += 1
                assert self.index.canonical(key, page_token_bytes(tokens, i, self.tokens_per_page)) == page
        assert active == self.pages.active, "active refcounts disagree with the live leases"
        assert cache == self.pages.cache, "cache refcounts disagree with the records"
        free = self.pages.free_slots()
        assert len(free) == self.pages.num_free, "a page is on the free list twice"
        assert free == {p for p in range(capacity) if active[p] == 0 and cache[p] == 0}
        for _key, entry in self.index.items():
            assert entry.page not in free, "an index entry points at a free page"
        for key, lease in self._inflight.items():
            assert lease in self.leases and not self.index.contains(key), "a stale in-flight key"
        assert len(self.records) <= self.max_records or not self.enabled
