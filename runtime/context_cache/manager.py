"""The context-cache manager: acquire → grow → publish → release, each step all-or-nothing.

It owns every page of the KV pool. With reuse disabled it is a plain page allocator (no lookup, no
publication, no records), so both modes run the same code path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.contract.paging import pages_for
from kvforge.runtime.context_cache.eviction import plan_eviction
from kvforge.runtime.context_cache.index import BlockIndex, page_token_bytes
from kvforge.runtime.context_cache.keys import CHAIN_ROOT, KeyExtras, page_keys
from kvforge.runtime.context_cache.metrics import CacheMetrics
from kvforge.runtime.context_cache.planner import ReusePlan, plan_cold, plan_reuse
from kvforge.runtime.context_cache.pools import BASE_KV_PAGES, ResourcePools
from kvforge.runtime.context_cache.records import Record, RecordStore

USE_CACHE = "use_cache"
BYPASS = "bypass"
INCLUDING_GENERATED_TOKENS = "including_generated_tokens"
PREFILL_STATE_ONLY = "prefill_state_only"
DEFAULT_MAX_RECORDS = 1024


@dataclass(slots=True)
class Admission:
    token_ids: list[int]
    extras: KeyExtras = field(default_factory=KeyExtras)
    lookup_policy: str = USE_CACHE


@dataclass(slots=True, eq=False)
class Lease:
    """One sequence's hold on the pool: the page ids its page-table row uses and what it may publish."""

    extras: KeyExtras
    page_ids: list[int]
    reuse_tokens: int
    matched_tokens: int
    plan_kind: str
    may_publish: bool
    forced_cold: bool = False
    keys: list[bytes] = field(default_factory=list)  # chain keys of full pages computed so far
    released: bool = False


class ContextCacheManager:
    def __init__(self, num_pages: int, tokens_per_page: int, *, enabled: bool,
                 max_records: int = DEFAULT_MAX_RECORDS) -> None:
        if max_records < 0:
            raise KvforgeError(f"must be >= 0, got {max_records}", "--contextCacheMaxRecords")
        self.enabled = enabled
        self.tokens_per_page = tokens_per_page
        self.max_records = max_records
        self.pools = ResourcePools({BASE_KV_PAGES: num_pages})
        self.index = BlockIndex()
        self.records = RecordStore()
        self.metrics = CacheMetrics()
        self.pages.on_free = self.index.forget_page
        self.leases: set[Lease] = set()

    @property
    def pages(self):
        return self.pools[BASE_KV_PAGES]

    # --- acquire ------------------------------------------------------------------------------------

    def acquire(self, admission: Admission) -> Lease:
        """Pages for a new sequence: canonical hits for the matched prefix, private pages for the rest."""
        started = time.perf_counter_ns()
        tokens = np.asarray(admission.token_ids, dtype=np.int32)
        lookup = self.enabled and admission.lookup_policy == USE_CACHE
        keys: list[bytes] = []
        if lookup:
            keys = page_keys(tokens, self.tokens_per_page, admission.extras)
            plan = plan_reuse(len(tokens), self.tokens_per_page,
                              self.index.lookup_longest(keys, tokens, self.tokens_per_page))
        else:
            plan = plan_cold(len(tokens), self.tokens_per_page)
        lease = self._try_acquire(plan, admission.extras, may_publish=lookup)
        forced_cold = False
        if lease is None and plan.hit_pages:
            # Pinned hits can leave too little to evict; a cold run may still fit (evicting those records).
            forced_cold = True
            lease = self._try_acquire(plan_cold(len(tokens), self.tokens_per_page), admission.extras, may_publish=False)
        if lease is None:
            need = pages_for(len(tokens), self.tokens_per_page)
            raise KvforgeError(f"the KV pool cannot hold this sequence: it needs {need} pages, {self.pages.num_free} "
                               f"of {self.pages.capacity} are free and in-flight requests pin the rest; rebuild with "
                               "a larger --maxKVPoolPages or lower batch_size", "--maxKVPoolPages")
        lease.forced_cold = forced_cold
        if not forced_cold:
            lease.keys = keys  # publication reuses the prompt's keys instead of hashing twice
        self._count_admission(plan, lease, lookup)
        self.metrics.planning_nanoseconds += time.perf_counter_ns() - started
        return lease

    def _try_acquire(self, plan: ReusePlan, extras: KeyExtras, may_publish: bool) -> Lease | None:
        self.pages.pin(plan.hit_pages)  # pin before evicting: the plan's own hits are never victims
        victims = plan_eviction(plan.demand, self.pools, self.records.least_recent_first())
        if victims is None:
            self.pages.unpin(plan.hit_pages)
            return None
        self._evict(victims)
        private = self.pages.allocate(plan.demand.get(BASE_KV_PAGES, 0))
        lease = Lease(extras, [*plan.hit_pages, *private], plan.reuse_tokens, plan.matched_tokens, plan.kind,
                      may_publish)
        if plan.hit_pages:  # a hit refreshes the record it ends on, so reused documents stay resident
            record = self.records.find(self.index.key_of(plan.hit_pages[-1]))
            if record is not None:
                self.records.touch(record.record_id)
        self.leases.add(lease)
        return lease

    def _count_admission(self, plan: ReusePlan, lease: Lease, lookup: bool) -> None:
        m = self.metrics
        m.admitted_sequences += 1
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

    def grow(self, lease: Lease, num_tokens: int) -> None:
        """Make the lease's pages cover positions [0, num_tokens), evicting records if needed."""
        missing = pages_for(num_tokens, self.tokens_per_page) - len(lease.page_ids)
        if missing <= 0:
            return
        demand = {BASE_KV_PAGES: missing}
        victims = plan_eviction(demand, self.pools, self.records.least_recent_first())
        if victims is None:
            raise KvforgeError(f"the KV pool ran out of pages while decoding ({self.pages.capacity} pages, all "
                               "pinned by in-flight requests); rebuild with a larger --maxKVPoolPages or lower "
                               "batch_size", "--maxKVPoolPages")
        self._evict(victims)
        lease.page_ids.extend(self.pages.allocate(missing))

    # --- publish ------------------------------------------------------------------------------------

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
                if self.index.contains(key):
                    break
                page = lease.page_ids[i]
                self.index.insert(key, page, token_bytes)
            canonical.append(page)
        return canonical

    # --- release and eviction -----------------------------------------------------------------------

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self.leases.discard(lease)
        self.pages.unpin(lease.page_ids)

    def _evict(self, record_ids: list[int]) -> None:
        for record_id in record_ids:
            record = self.records.remove(record_id)
            self.metrics.reclaimed[BASE_KV_PAGES] += self.pages.drop_cache_ref(record.page_ids)
            self.metrics.records_evicted += 1

    # --- reporting and audits -----------------------------------------------------------------------

    def profile(self) -> dict:
        return self.metrics.to_dict(len(self.records), self.pools.to_dict())

    def check_invariants(self) -> None:
        """Audit every refcount and index entry (tests call this after each request)."""
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
        assert len(self.records) <= self.max_records or not self.enabled


