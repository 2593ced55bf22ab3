"""Record-level LRU eviction planned as a read-only simulation, so it is applied all-or-nothing."""

from __future__ import annotations

from collections.abc import Iterable

from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.records import Record


def plan_eviction(pages_needed: int, pool: ResourcePool, records_lru_first: Iterable[Record]) -> list[int] | None:
    """The shortest LRU-first list of record ids whose eviction frees enough pages for `pages_needed`.

    A page counts as reclaimed only when its simulated cache refs reach 0 and no request pins it
    (pin-before-evict: a request's own hits are pinned before planning, so they are never victims).
    Shared ancestors may need several victims. Returns [] when nothing needs evicting and None when
    even evicting every record would not suffice. Nothing is modified.
    """
    missing = pages_needed - pool.num_free
    if missing <= 0:
        return []
    remaining: dict[int, int] = {}
    reclaimed = 0
    victims = []
    for record in records_lru_first:
        victims.append(record.record_id)
        for page in record.page_ids:
            refs = remaining.get(page, pool.cache[page]) - 1
            remaining[page] = refs
            if refs == 0 and pool.active[page] == 0:
                reclaimed += 1
        if reclaimed >= missing:
            return victims
    return None
