"""Attention KV pages as a cache type: the page index, the longest page hit, and the pages sequences are computing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from kvforge.contract.paging import pages_for
from kvforge.runtime.context_cache.index import PageIndex, page_token_bytes
from kvforge.runtime.context_cache.lease import Admission, Inputs, Lease
from kvforge.runtime.context_cache.planner import ReusePlan, plan_reuse
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import CacheSetup, CacheTypeBase, Lookup, Publication
from kvforge.runtime.context_cache.records import Record
from kvforge.runtime.context_cache.support import ALL_METHODS, CacheSupport, ReuseOff, Tier
from kvforge.runtime.types import Deployment

# Its row of the support matrix: the page table every paged engine has (informational: nothing turns it on).
ATTENTION_SUPPORT = CacheSupport(
    "base pages", "", (Deployment.VANILLA, Deployment.HYBRID), ALL_METHODS, window_group=True, tier=Tier.SAVED,
    reuse_off=ReuseOff.RUNS, on=lambda config, build: False, note="a plain page allocator with reuse off")


def build_attention_pages(setup: CacheSetup, name: str) -> AttentionPages | None:
    """Every deployment with attention layers keeps K/V in pages; only a pure recurrent one has none."""
    if not setup.paged:
        return None
    return AttentionPages(ResourcePool(name, setup.num_pages), setup.tokens_per_page,
                          shares_in_flight=not setup.checkpoints)


class AttentionPages(CacheTypeBase):
    """Base KV pages: full pages are content-addressed by their chain keys (first committer wins), and with
    `shares_in_flight` a page becomes findable as soon as a prefill chunk computed it, so an identical prefix
    waits for it instead of computing it twice. A checkpoint deployment does not share in flight: there a page
    is reusable only together with a recurrent checkpoint, which exists only once published."""

    __slots__ = ("name", "pool", "index", "tokens_per_page", "shares_in_flight", "_in_flight")

    def __init__(self, pool: ResourcePool, tokens_per_page: int, *, shares_in_flight: bool) -> None:
        self.name = pool.name
        self.pool = pool
        self.index = PageIndex()
        self.tokens_per_page = tokens_per_page
        self.shares_in_flight = shares_in_flight
        self._in_flight: dict[bytes, Lease] = {}  # page key -> the running lease computing that page
        pool.on_free = self.index.forget_page  # a freed page is about to be overwritten: it leaves the index

    @property
    def in_flight(self) -> Mapping[bytes, Lease]:
        return MappingProxyType(self._in_flight)

    def in_flight_pages(self) -> Mapping[bytes, Lease]:
        return self.in_flight

    def fits_alone(self, num_tokens: int) -> bool:
        return pages_for(num_tokens, self.tokens_per_page) <= self.pool.capacity

    # --- lookup -------------------------------------------------------------------------------------

    def matching_pages(self, lookup: Lookup) -> list[int]:
        """The canonical pages of the longest run of the input's leading keys present with the same tokens."""
        if lookup.page_hits is None:
            lookup.page_hits = self.index.lookup_longest(lookup.keys, lookup.tokens, self.tokens_per_page)
        return lookup.page_hits

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """The longest page-aligned reuse (rewinding a fully matched input one page, stopping before media spans).
        The first type asked: `agreed` is the cold plan."""
        return plan_reuse(len(lookup.tokens), self.tokens_per_page, self.matching_pages(lookup), lookup.extras.media)

    def waits_for(self, lookup: Lookup) -> bool:
        """Whether the first page this input would compute is being computed by a running sequence."""
        if not self.shares_in_flight or not self._in_flight:
            return False
        hits = self.matching_pages(lookup)
        return len(hits) < len(lookup.keys) and lookup.keys[len(hits)] in self._in_flight

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        return plan.hit_pages

    # --- a lease's pages ----------------------------------------------------------------------------

    def admission_slots(self, plan: ReusePlan, inputs: Inputs) -> int:
        return plan.new_pages

    def admit(self, lease: Lease, plan: ReusePlan, inputs: Inputs, slots: list[int]) -> None:
        lease.page_ids.extend([*plan.hit_pages, *slots])

    def growth_slots(self, lease: Lease, num_tokens: int) -> int:
        return max(pages_for(num_tokens, self.tokens_per_page) - len(lease.page_ids), 0)

    def grow(self, lease: Lease, slots: list[int]) -> None:
        lease.page_ids.extend(slots)

    def pinned(self, lease: Lease) -> tuple[int, ...]:
        return tuple(lease.page_ids)

    def release(self, lease: Lease) -> None:
        self.forget_in_flight(lease)
        self.pool.unpin(lease.page_ids)

    # --- in flight ----------------------------------------------------------------------------------

    def on_admitted(self, lease: Lease, admission: Admission, num_tokens: int) -> None:
        if lease.may_publish:
            indexable = num_tokens if admission.indexable_tokens is None else admission.indexable_tokens
            self.register_in_flight(lease, min(indexable, num_tokens, lease.exact_tokens))

    def register_in_flight(self, lease: Lease, indexable_tokens: int) -> None:
        """Announce the full pages among the lease's first `indexable_tokens` it will compute, so identical
        prefixes wait instead of duplicating (and `index_computed` may make them findable)."""
        if not self.shares_in_flight:
            return
        lease.indexable_pages = indexable_tokens // self.tokens_per_page
        for key in lease.keys[lease.indexed_pages:lease.indexable_pages]:
            # A full-input rewind recomputes its last matched page: that page is indexed already, not in flight.
            if key not in self._in_flight and not self.index.contains(key):
                self._in_flight[key] = lease
                lease.inflight_keys.append(key)

    def index_computed(self, lease: Lease, tokens: np.ndarray, upto: int) -> None:
        """Index the lease's pages [indexed_pages, upto) (their keys are known): findable before any record."""
        for i in range(lease.indexed_pages, upto):
            key = lease.keys[i]
            if self._in_flight.get(key) is lease:
                del self._in_flight[key]
            if not self.index.contains(key) and self.index.key_of(lease.page_ids[i]) == b"":
                self._insert(key, lease.page_ids[i], page_token_bytes(tokens, i, self.tokens_per_page))
        lease.indexed_pages = max(lease.indexed_pages, upto)

    def _insert(self, key: bytes, page: int, token_bytes: bytes) -> None:
        """Index a page. A key another lease announced as in flight is findable from now on, so the announcement
        goes (a publication of the same content can index it first: a chat turn extending a running answer)."""
        self.index.insert(key, page, token_bytes)
        self._in_flight.pop(key, None)

    def forget_in_flight(self, lease: Lease) -> None:
        for key in lease.inflight_keys:
            if self._in_flight.get(key) is lease:
                del self._in_flight[key]
        lease.inflight_keys.clear()

    # --- publication --------------------------------------------------------------------------------

    def project(self, lease: Lease, publication: Publication) -> None:
        """Set the publication's canonical pages: a key already indexed maps to its page (first committer wins),
        a new key indexes the lease's own. Stops at a key whose stored tokens differ (a hash collision), so the
        publication may get fewer pages than keys."""
        pages = []
        for i, key in enumerate(publication.keys):
            token_bytes = page_token_bytes(publication.tokens, i, self.tokens_per_page)
            page = self.index.canonical(key, token_bytes)
            if page is None:
                if self.index.contains(key) or self.index.key_of(lease.page_ids[i]) != b"":
                    break
                page = lease.page_ids[i]
                self._insert(key, page, token_bytes)
            pages.append(page)
        publication.page_ids = pages

    # A record's pages are the lease's own (or canonical ones): nothing new is allocated for a publication; they
    # were indexed by `project`, and leave the index when they return to the free list (`pool.on_free`).

    def held(self, record: Record) -> tuple[int, ...]:
        return record.page_ids

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        free = self.pool.free_slots()
        for _key, entry in self.index.items():
            assert entry.page not in free, "an index entry points at a free page"
