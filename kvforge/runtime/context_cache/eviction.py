"""Record-level LRU eviction over every pool, planned as a read-only simulation so it is applied all-or-nothing."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvforge.runtime.context_cache.pools import BASE_KV_PAGES, Demand, ResourcePools
from kvforge.runtime.context_cache.records import Record, RecordStore

if TYPE_CHECKING:
    from kvforge.runtime.context_cache.protocol import CacheType

Held = Callable[[Record], Mapping[str, Sequence[int]]]  # what a record holds, per pool: its types' answers
WHOLE: frozenset[str] = frozenset()


class Victim(NamedTuple):
    """A record an eviction plan takes: all of it (`parts` empty), or only its parts of these pools (their types
    say a record stays valid without them: `CacheType.part_drops_alone`)."""

    record_id: int
    parts: frozenset[str] = WHOLE


def pages_held(record: Record) -> Mapping[str, Sequence[int]]:
    """A record's base pages alone: what it holds where the pools are only a base KV pool."""
    return {BASE_KV_PAGES: record.page_ids}


def plan_eviction(demand: Demand, pools: ResourcePools, records_lru_first: Iterable[Record],
                  protected: int | None = None, held_by: Held = pages_held,
                  alone: Collection[str] = WHOLE) -> list[Victim] | None:
    """The LRU-first victims whose eviction frees enough slots of every pool for `demand` (pool name -> count),
    never `protected` (the record an admission resumes from: its snapshots are pinned, and it must outlive the
    admission). What a record holds of each pool is `held_by`'s answer (the coordinator asks its types).

    A slot counts as reclaimed only when its simulated cache refs reach 0 and no request pins it
    (pin-before-evict: a request's own hits are pinned before planning, so they are never victims).
    Shared ancestor pages may need several victims. A record holding nothing of a pool that is still
    short is passed over: evicting a document to make room for a snapshot slot, or the reverse, would
    only lose reuse. Where every short pool a record holds is in `alone` (pools whose part a record can lose and
    stay valid, e.g. a window checkpoint), only those parts go and the record stays with the rest (a document's
    stored form, its global pages). Returns [] when nothing needs evicting and None when even evicting every record
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
        short = frozenset(name for name, count in missing.items() if count > 0 and held.get(name))
        if not short:
            continue
        parts = short if short <= set(alone) else WHOLE
        victims.append(Victim(record.record_id, parts))
        for name, slots in held.items():
            if parts and name not in parts:
                continue
            pool = pools[name]
            for slot in slots:
                refs = remaining.get((name, slot), pool.cache[slot]) - 1
                remaining[(name, slot)] = refs
                if refs == 0 and pool.active[slot] == 0 and name in missing:
                    missing[name] -= 1
        if all(count <= 0 for count in missing.values()):
            return victims
    return None


def refile(types: Sequence[CacheType], records: RecordStore, existing: Record, record: Record) -> dict[str, int]:
    """Swap `record` (same id and endpoint, other parts) in for `existing`: cache references move to what it holds,
    and every type forgets the old one and files the new one. Returns the slots freed, per pool."""
    freed = {}
    for kind in types:
        kind.pool.add_cache_ref(kind.held(record))  # first: a slot both hold never touches zero
        freed[kind.name] = kind.pool.drop_cache_ref(kind.held(existing))
    for kind in types:
        kind.on_evict(existing)
    records.replace(record)
    for kind in types:
        kind.on_commit(record)
    return freed
