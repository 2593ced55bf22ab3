"""The sliding layers' page group as a cache type: each running row holds only the pages its window still needs.

An engine built with `llm_build --slidingWindowPool` keeps its sliding layers' K/V in a pool of their own, sized for
the window (kvforge/contract/window_pool.py), and reads it through a second page table. A lease's part
(`WindowPages`) is that table, one entry per logical page of the row, -1 where the page went back to the group:

    | -1 | -1 | ... | -1 | page k | page k+1 | ... | page n-1 |
    |<-- wholly before the window of the next new position -->|<-- the window, then the positions being computed

A page is freed once every position the row may still compute sees none of it: the next call's first position is at
least the extent of the row's previous successful growth (that call ran) and at least the new extent less the most
tokens one call gives a row. Reuse is not served yet: the engine refuses context reuse on such an engine (a hit would
need the window's pages before the hit point, which this type does not keep), so every plan here is cold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.paging import pages_for
from kvforge.contract.profile_schema import SLIDING_WINDOW_PAGES
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.planner import ReusePlan
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import CacheSetup, CacheTypeBase
from kvforge.runtime.context_cache.records import Record

# sliding_window: the window W; sliding_window_pages: the group's pages (0 = the engine has no group);
# sliding_window_call_tokens: the most new tokens one engine call gives a row (the build's maxInputLen).
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


def window_table(lease: Lease | None) -> list[int] | None:
    """The lease's window table (the executor's second page table), or None without a sliding-window group."""
    part = None if lease is None else lease.parts.get(SLIDING_WINDOW_PAGES)
    return None if part is None else part.table


def build_sliding_window(setup: CacheSetup, name: str) -> SlidingWindowPages | None:
    """Only an engine built with a sliding-window group has one; reuse on it is refused (see the module doc)."""
    pages = int(setup.options.get("sliding_window_pages", 0))
    if not pages:
        return None
    if setup.enabled:
        raise InvalidConfig("context reuse is not served on an engine with a sliding-window page group yet; run "
                            "without it, or rebuild without --slidingWindowPool", "enable_context_reuse")
    window, per_call = int(setup.options["sliding_window"]), int(setup.options["sliding_window_call_tokens"])
    if window <= 0 or per_call <= 0:
        raise ValueError(f"a sliding-window group needs a window and a call size, got {window} and {per_call}")
    return SlidingWindowPages(ResourcePool(name, pages), setup.tokens_per_page, window, per_call)


class SlidingWindowPages(CacheTypeBase):
    __slots__ = ("name", "pool", "tokens_per_page", "window", "per_call")

    def __init__(self, pool: ResourcePool, tokens_per_page: int, window: int, per_call: int) -> None:
        self.name = pool.name
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.window = window
        self.per_call = per_call

    def row_pages(self, num_new: int) -> int:
        """The most pages a row holds for a call of `num_new` tokens: the window before it, then its own."""
        return pages_for(self.window - 1 + num_new, self.tokens_per_page) + 1

    def fits_alone(self, num_tokens: int) -> bool:
        return min(self.row_pages(self.per_call), pages_for(num_tokens, self.tokens_per_page)) <= self.pool.capacity

    def admission_slots(self, plan: ReusePlan, speculative: bool) -> int:
        if plan.reuse_tokens:
            raise AssertionError("a sliding-window group serves cold admissions only (reuse is refused)")
        # The first call computes at most per_call tokens from position 0: its pages, the rest as it grows.
        return min(plan.new_pages, pages_for(self.per_call, self.tokens_per_page))

    def admit(self, lease: Lease, plan: ReusePlan, speculative: bool, slots: list[int]) -> None:
        lease.parts[self.name] = WindowPages(list(slots))

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
        keep = max(part.computed - self.window + 1, 0) // self.tokens_per_page
        dead = [slot for slot in part.table[part.freed:keep] if slot != NO_PAGE]
        part.table[part.freed:keep] = [NO_PAGE] * len(part.table[part.freed:keep])
        part.freed = max(part.freed, keep)
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

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        held = [slot for lease in leases for slot in self.pinned(lease)]
        assert len(held) == len(set(held)), f"{self.name}: a page is in two window tables"
        for lease in leases:
            part: WindowPages = lease.parts[self.name]
            assert all(slot == NO_PAGE for slot in part.table[:part.freed]), f"{self.name}: a freed page is held"
            # A row never holds more than one call's window: the pool's sizing depends on it.
            assert len(part.slots) <= self.row_pages(self.per_call), f"{self.name}: a row holds {len(part.slots)}"
