"""The sliding layers' page group as a cache type: each row holds only the pages its window still needs, and a
record keeps the window before its endpoint, so a hit there is exact.

An engine built with `llm_build --slidingWindowPool` keeps its sliding layers' K/V in a pool of their own, sized for
the window (kvforge/contract/window_pool.py), and reads it through a second page table. A lease's part
(`WindowPages`) is that table, one entry per logical page of the row, NO_PAGE where the page went back to the group:

    | -1 | ... | -1 | page k | ... | page b-1 | page b | ... | page n-1 |
                    |<- window before b*T ->|<- from the last page boundary b*T at or before the row's position on

A growth frees the pages wholly before the window of the last page boundary at or before the row's position (its
position is at least the extent of its previous growth, which ran, and at least the new extent less the most tokens
one call gives a row), and allocates the ones the next call reads or writes.

Reuse (a checkpoint kind, like the recurrent snapshots): a hit at a page boundary P needs the global layers' pages up
to P (the attention type's) and the sliding layers' keys [P - W + 1, P). A record published at P (its full pages
end there) keeps those window pages in place, by reference (`WindowCheckpoint`): they are complete and the lease
that wrote them never writes them again. A lookup narrows the attention type's hit to the deepest of its page
boundaries where a record keeps a window; none: cold. The hit's window pages start the new lease's table (shared,
read only: the lease writes from P on, into pages of its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvforge.contract import profile_schema as schema
from kvforge.contract.paging import pages_for
from kvforge.contract.profile_schema import SLIDING_WINDOW_PAGES
from kvforge.contract.window_pool import WINDOW_GROUP, checkpoint_pages, window_pages_per_row
from kvforge.runtime.context_cache.lease import Inputs, Lease
from kvforge.runtime.context_cache.metrics import CounterBlock, Sample
from kvforge.runtime.context_cache.planner import PlanKind, ReusePlan, media_safe_pages
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import CacheSetup, CacheTypeBase, Lookup, Publication
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.context_cache.support import NOT_ON_WINDOW_GROUP, PLAIN_DECODING, CacheSupport, ReuseOff, Tier
from kvforge.runtime.types import Deployment

# sliding_window: the window W; sliding_window_pages: the group's pages (0 = the engine has no group);
# sliding_window_call_tokens: the most new tokens one engine call gives a row.
SLIDING_WINDOW_OPTIONS = ("sliding_window", "sliding_window_pages", "sliding_window_call_tokens")
NO_PAGE = -1


@dataclass(slots=True)
class WindowPages:
    """A lease's part: its window table and what the row is known to have computed."""

    table: list[int]  # a slot of the group per logical page, NO_PAGE where none
    computed: int = 0  # a lower bound of the tokens in the row's K/V (the next call's first position)
    asked: int = 0  # the extent of the last growth asked (0: none since admission)
    freed: int = 0  # logical pages below this one are NO_PAGE
    missing: list[int] = field(default_factory=list)  # logical pages the pending growth fills, in order

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(slot for slot in self.table if slot != NO_PAGE)


@dataclass(frozen=True, slots=True)
class WindowCheckpoint:
    """A record's part (and a hit plan's): the window pages of logical pages [first, end // T) before `end`."""

    end: int  # the endpoint P, a page boundary
    first: int  # the first logical page kept
    slots: tuple[int, ...]


def window_table(lease: Lease | None) -> list[int] | None:
    """The lease's window table (the executor's second page table), or None without a sliding-window group."""
    part = None if lease is None else lease.parts.get(SLIDING_WINDOW_PAGES)
    return None if part is None else part.table


def _samples(cache: Mapping[str, Any]) -> Iterable[Sample]:
    """/metrics: the group's pages and hits, on an engine built with --slidingWindowPool."""
    pool = cache.get(schema.RESOURCE_POOLS, {}).get(SLIDING_WINDOW_PAGES, {})
    if not pool.get(schema.POOL_CAPACITY):
        return
    yield Sample("gauge", "sliding_window_pages_free", "Free pages of the sliding layers' page group.",
                 pool[schema.POOL_FREE])
    yield Sample("gauge", "sliding_window_pages_total", "Pages of the sliding layers' page group.",
                 pool[schema.POOL_CAPACITY])
    yield Sample("counter", "sliding_window_hits", "Admissions that took a record's sliding-window pages.",
                 cache[schema.SLIDING_WINDOW][schema.WINDOW_HITS])
    yield Sample("counter", "sliding_window_evicted_pages", "Sliding-window pages freed by evicting records.",
                 cache.get(schema.RECLAIMED_RESOURCES, {}).get(SLIDING_WINDOW_PAGES, 0))


# The profile's `sliding_window` block: admissions that took a record's window pages, records published without one
# (the lease had freed part of it).
SLIDING_WINDOW_COUNTERS = CounterBlock(schema.SLIDING_WINDOW, (schema.WINDOW_HITS, schema.WINDOW_SKIPS), _samples)


# Its row of the support matrix: an engine built with --slidingWindowPool serves neither speculation nor a shared
# tier yet (both read or keep K/V through the global page table alone); each refusal names the other's setting.
SLIDING_WINDOW_SUPPORT = CacheSupport(
    "sliding-window pages", "", (Deployment.VANILLA,), PLAIN_DECODING, window_group=True, tier=Tier.REFUSED,
    reuse_off=ReuseOff.RUNS, on=lambda config, build: bool(build.window_pool_pages),
    refusals={"spec": NOT_ON_WINDOW_GROUP, "tier": NOT_ON_WINDOW_GROUP}, spec_field="spec_decode",
    note="turned on by llm_build --slidingWindowPool (Gemma 3/4)")


def build_sliding_window(setup: CacheSetup, name: str) -> SlidingWindowPages | None:
    """Only an engine built with a sliding-window group has one."""
    pages = int(setup.options.get("sliding_window_pages", 0))
    if not pages:
        return None
    window, per_call = int(setup.options["sliding_window"]), int(setup.options["sliding_window_call_tokens"])
    if window <= 0 or per_call <= 0:
        raise ValueError(f"a sliding-window group needs a window and a call size, got {window} and {per_call}")
    return SlidingWindowPages(ResourcePool(name, pages), setup.records, setup.tokens_per_page, window, per_call)


class SlidingWindowPages(CacheTypeBase):
    __slots__ = ("name", "pool", "records", "metrics", "tokens_per_page", "window", "per_call")
    # A record without its window checkpoint is what `project` publishes when the lease had freed part of the window:
    # valid, its global pages and other parts intact, just no exact hit here until `upgrade` gives it one again. So
    # pressure on the group takes only the checkpoint: a document's record keeps its stored form (issue 53).
    part_drops_alone = True

    def __init__(self, pool: ResourcePool, records: RecordStore, tokens_per_page: int, window: int,
                 per_call: int) -> None:
        self.name = pool.name
        self.pool = pool
        self.records = records
        self.metrics = SLIDING_WINDOW_COUNTERS.zeros()
        self.tokens_per_page = tokens_per_page
        self.window = window
        self.per_call = per_call

    @property
    def row_pages(self) -> int:
        """The most pages a row holds (the group is sized for this many per row)."""
        return window_pages_per_row(self.window, self.tokens_per_page, self.per_call, 1 << 62)

    def keep_from(self, position: int) -> int:
        """The first logical page a row at `position` keeps: the window of its last page boundary."""
        boundary = position // self.tokens_per_page * self.tokens_per_page
        return max(boundary - self.window + 1, 0) // self.tokens_per_page

    def fits_alone(self, num_tokens: int) -> bool:
        return min(self.row_pages, pages_for(num_tokens, self.tokens_per_page)) <= self.pool.capacity

    # --- lookup -------------------------------------------------------------------------------------

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """`agreed` narrowed to its deepest page boundary where a record keeps the window (same tokens, same
        pages), not inside a media span; else no reuse. The other types' parts stay (a document's hits lie after
        the agreed prefix, so after the narrowed one too)."""
        T, tokens = self.tokens_per_page, lookup.tokens
        total = len(agreed.hit_pages) + agreed.new_pages
        for depth in range(len(agreed.hit_pages), 0, -1):
            if media_safe_pages(depth, T, lookup.extras.media) != depth:
                continue
            record = self.records.find(lookup.keys[depth - 1])
            part = None if record is None else record.parts.get(self.name)
            if part is None or part.end != depth * T or record.token_ids != tuple(tokens[:depth * T].tolist()) \
                    or record.page_ids != tuple(agreed.hit_pages[:depth]):
                continue
            return ReusePlan(PlanKind.STANDARD, agreed.matched_tokens, depth * T, agreed.hit_pages[:depth],
                             total - depth, resumes=record.record_id, parts=agreed.parts).with_part(self.name, part)
        kind = PlanKind.NO_REUSABLE_PREFIX if agreed.hit_pages else agreed.kind
        return ReusePlan(kind, agreed.matched_tokens, 0, (), total, parts=agreed.parts)

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        hit: WindowCheckpoint | None = plan.parts.get(self.name)
        return () if hit is None else hit.slots

    # --- a lease's pages ----------------------------------------------------------------------------

    def admission_slots(self, plan: ReusePlan, inputs: Inputs) -> int:
        # The first call computes at most per_call tokens from the (page-aligned) reuse point: its pages now, the
        # rest as the row grows.
        return min(plan.new_pages, pages_for(self.per_call, self.tokens_per_page))

    def admit(self, lease: Lease, plan: ReusePlan, inputs: Inputs, slots: list[int]) -> None:
        hit: WindowCheckpoint | None = plan.parts.get(self.name)
        if hit is None:
            lease.parts[self.name] = WindowPages(list(slots))
            return
        self.metrics[schema.WINDOW_HITS] += 1
        table = [NO_PAGE] * hit.first + list(hit.slots) + list(slots)
        lease.parts[self.name] = WindowPages(table, computed=hit.end, freed=hit.first)

    def growth_slots(self, lease: Lease, num_tokens: int) -> int:
        """Frees the pages no future position sees, then counts the missing ones of [window start, num_tokens).
        Freeing here (not in `grow`) keeps a row at its window's pages when no new page is needed: a growth that
        then fails has given back only pages nothing reads again."""
        part: WindowPages = lease.parts[self.name]
        if num_tokens != part.asked:
            # A new extent: the last one asked was granted and computed (a failed growth preempts or retries the
            # same extent), and this call gives the row at most per_call tokens.
            part.computed = max(part.computed, part.asked, num_tokens - self.per_call)
            part.asked = num_tokens
        keep = self.keep_from(part.computed)
        if keep > part.freed:
            dead = [slot for slot in part.table[part.freed:keep] if slot != NO_PAGE]
            part.table[part.freed:keep] = [NO_PAGE] * len(part.table[part.freed:keep])
            part.freed = keep
            self.pool.unpin(dead)
        need = pages_for(num_tokens, self.tokens_per_page)
        part.table.extend([NO_PAGE] * (need - len(part.table)))
        part.missing = [p for p in range(keep, need) if part.table[p] == NO_PAGE]
        return len(part.missing)

    def grow(self, lease: Lease, slots: list[int]) -> None:
        part: WindowPages = lease.parts[self.name]
        for page, slot in zip(part.missing, slots, strict=True):
            part.table[page] = slot
        part.missing = []

    def pinned(self, lease: Lease) -> tuple[int, ...]:
        part: WindowPages | None = lease.parts.get(self.name)
        return () if part is None else part.slots

    def release(self, lease: Lease) -> None:
        self.pool.unpin(self.pinned(lease))

    # --- publication --------------------------------------------------------------------------------

    def project(self, lease: Lease, publication: Publication) -> None:
        """A record whose full pages end at P keeps the lease's window pages before P, when it still holds them
        all (it does whenever P is at or after its last growth's page boundary); else it keeps none and is no
        hit for a sliding-window engine."""
        end = len(publication.keys) * self.tokens_per_page
        part: WindowPages | None = lease.parts.get(self.name)
        if not end or part is None:
            return
        first = max(end - self.window + 1, 0) // self.tokens_per_page
        slots = tuple(part.table[first:end // self.tokens_per_page])
        if len(slots) == end // self.tokens_per_page - first and NO_PAGE not in slots:
            publication.parts[self.name] = WindowCheckpoint(end, first, slots)
        else:
            self.metrics[schema.WINDOW_SKIPS] += 1

    def upgrade(self, existing: Record, lease: Lease) -> Record | None:
        """An endpoint cached without a window (its publisher had freed part of it) takes this lease's."""
        if self.name in existing.parts or existing.tail_key:
            return None
        probe = Publication(np.asarray(existing.token_ids, dtype=np.int32), list(existing.keys), b"", False)
        self.project(lease, probe)
        kept = probe.parts.get(self.name)
        return None if kept is None else existing.with_part(self.name, kept)

    def counters(self) -> dict[str, int]:
        return self.metrics

    def page_tables(self, lease: Lease) -> dict[str, list[int]]:
        """The sliding layers' page group's table of the lease (-1 where a page fell out of the window)."""
        part: WindowPages | None = lease.parts.get(self.name)
        return {} if part is None else {WINDOW_GROUP: part.table}

    def held(self, record: Record) -> tuple[int, ...]:
        part: WindowCheckpoint | None = record.parts.get(self.name)
        return () if part is None else part.slots

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        for lease in leases:
            part: WindowPages = lease.parts[self.name]
            assert all(slot == NO_PAGE for slot in part.table[:part.freed]), f"{self.name}: a freed page is held"
            # A row never holds more than one call's window: the pool's sizing depends on it.
            assert len(part.slots) <= self.row_pages, f"{self.name}: a row holds {len(part.slots)} pages"
        for record in records:
            kept: WindowCheckpoint | None = record.parts.get(self.name)
            if kept is not None:
                assert kept.end == len(record.keys) * self.tokens_per_page and not record.tail_key
                assert len(kept.slots) <= checkpoint_pages(self.window, self.tokens_per_page)
