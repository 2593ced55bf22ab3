"""Record-level LRU eviction planned as a read-only simulation over all pools, applied all-or-nothing."""

from __future__ import annotations

from collections.abc import Iterable

from kvforge.runtime.context_cache.pools import BASE_KV_PAGES, ResourcePools
from kvforge.runtime.context_cache.records import Record


def shortfall(demand: dict[str, int], pools: ResourcePools) -> dict[str, int]:
    return {name: count - pools[name].num_free for name, count in demand.items() if count > pools[name].num_free}


def plan_eviction(demand: dict[str, int], pools: ResourcePools, records_lru_first: Iterable[Record],
                  protected: frozenset[int] = frozenset()) -> list[int] | None:
    """The shortest LRU-first list of record ids whose eviction frees enough slots for `demand`.

    A page counts as reclaimed only when its simulated cache refs reach 0 and no request pins it
    (pin-before-evict: a request's own hits are pinned before planning, so they are never victims).
    Shared ancestors may need several victims. Returns [] when nothing needs evicting and None when
    even evicting every unprotected record would not suffice. Nothing is modified.
    """
    missing = shortfall(demand, pools)
    if not missing:
        return []
    pool = pools[BASE_KV_PAGES]
    remaining: dict[int, int] = {}
    reclaimed = dict.fromkeys(missing, 0)
    victims = []
    for record in records_lru_first:
        if record.record_id in protected:
            continue
        victims.append(record.record_id)
        for page in record.page_ids:
            refs = remaining.get(page, pool.cache[page]) - 1
            remaining[page] = refs
            if refs == 0 and pool.active[page] == 0:
                reclaimed[BASE_KV_PAGES] = reclaimed.get(BASE_KV_PAGES, 0) + 1
        if all(reclaimed.get(name, 0) >= count for name, count in missing.items()):
            return victims
    return None
