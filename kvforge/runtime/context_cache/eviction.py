"""Record-level LRU eviction over every pool, planned as a read-only simulation so it is applied all-or-nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from kvforge.runtime.context_cache.pools import BASE_KV_PAGES, Demand, ResourcePools
from kvforge.runtime.context_cache.records import Record

Held = Callable[[Record], Mapping[str, Sequence[int]]]  # what a record holds, per pool: its types' answers


def pages_held(record: Record) -> Mapping[str, Sequence[int]]:
    """A record's base pages alone: what it holds where the pools are only a base KV pool."""
    return {BASE_KV_PAGES: record.page_ids}


def plan_eviction(demand: Demand, pools: ResourcePools, records_lru_first: Iterable[Record],
                  protected: int | None = None, held_by: Held = pages_held) -> list[int] | None:
    """The LRU-first record ids whose eviction frees enough slots of every pool for `demand` (pool name -> count),
    never `protected` (the record an admission resumes from: its snapshots are pinned, and it must outlive the
    admission). What a record holds of each pool is `held_by`'s answer (the coordinator asks its types).

    A slot counts as reclaimed only when its simulated cache refs reach 0 and no request pins it
    (pin-before-evict: a request's own hits are pinned before planning, so they are never victims).
    Shared ancestor pages may need several victims. A record holding nothing of a pool that is still
    short is passed over: evicting a document to make room for a snapshot slot, or the reverse, would
    only lose reuse. Returns [] when nothing needs evicting and None when even evicting every record
    would not suffice. Nothing is modified.
    """
    missing = pools.missing(demand)
    if not missing:
        return []
    remaining: dict[tuple[str, int], int] = {}
    victims = []
    for record in records_lru_first:
        if record.record_id == protected:
            continue
        held = held_by(record)
        if not any(held.get(name) for name, short in missing.items() if short > 0):
            continue
        victims.append(record.record_id)
        for name, slots in held.items():
            pool = pools[name]
            for slot in slots:
                refs = remaining.get((name, slot), pool.cache[slot]) - 1
                remaining[(name, slot)] = refs
                if refs == 0 and pool.active[slot] == 0 and name in missing:
                    missing[name] -= 1
        if all(short <= 0 for short in missing.values()):
            return victims
    return None
