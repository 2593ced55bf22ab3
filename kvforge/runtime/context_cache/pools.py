"""Resource pools, one per cache type, behind one planning coordinator: base KV pages, draft KV pages (a draft
model's own pool), partial-KV snapshots and recurrent snapshots, and any type registered later.

Every pool has the same refcount discipline: `active` refs pin a slot for an in-flight request, `cache` refs
are held by published records, and a slot returns to its free list only when both are zero. What differs
per type is what a slot holds (a KV page in the runner's pool, a copy of one in the snapshot store, or a copy of
one sequence's recurrent + conv state, a draft's K/V page) and who asks for it (its cache type, for a lease's pages
or a publication's snapshots).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping

from kvforge.contract.profile_schema import BASE_KV_PAGES, POOL_CAPACITY, POOL_FREE  # noqa: F401 - re-exported


class ResourcePool:
    """Fixed-capacity slots with an O(1) free list. Ids are pool-local (page 5 is not snapshot slot 5)."""

    __slots__ = ("name", "capacity", "active", "cache", "_free", "on_free")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.active = [0] * capacity
        self.cache = [0] * capacity
        self._free: deque[int] = deque(range(capacity))
        self.on_free: Callable[[int], None] | None = None  # e.g. the page index forgets freed pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """New slots start with active=1, cache=0. Callers ask can_allocate (or plan an eviction) first."""
        if count > len(self._free):
            raise AssertionError(f"{self.name}: {count} slots requested, {len(self._free)} free")
        slots = [self._free.popleft() for _ in range(count)]
        for slot in slots:
            self.active[slot] = 1
        return slots

    def pin(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if self.active[slot] == 0 and self.cache[slot] == 0:
                raise AssertionError(f"{self.name}: pinning free slot {slot}")
            self.active[slot] += 1

    def unpin(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if self.active[slot] <= 0:
                raise AssertionError(f"{self.name}: active refcount of slot {slot} would go negative")
            self.active[slot] -= 1
            self._maybe_free(slot)

    def add_cache_ref(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self.cache[slot] += 1

    def drop_cache_ref(self, slots: Iterable[int]) -> int:
        """Drop one cache ref per slot; returns how many slots became free."""
        freed = 0
        for slot in slots:
            if self.cache[slot] <= 0:
                raise AssertionError(f"{self.name}: cache refcount of slot {slot} would go negative")
            self.cache[slot] -= 1
            freed += self._maybe_free(slot)
        return freed

    def _maybe_free(self, slot: int) -> int:
        if self.active[slot] or self.cache[slot]:
            return 0
        self._free.append(slot)
        if self.on_free is not None:
            self.on_free(slot)
        return 1

    def free_slots(self) -> set[int]:
        return set(self._free)

    def to_dict(self) -> dict[str, int]:
        return {POOL_FREE: len(self._free), POOL_CAPACITY: self.capacity}


Demand = Mapping[str, int]  # free slots an action needs, by pool name: an admission, a growth, a capture


class ResourcePools:
    """The coordinator's view of every typed pool: the eviction planner and the profile walk them by name, and a
    pool reads as an attribute of its name (`pools.base_kv_pages`).

    A pool of capacity 0 is a type this deployment does not use (no budget): it is listed in the profile with its
    real zeros and never asked for anything.
    """

    __slots__ = ("_by_name",)

    def __init__(self, *pools: ResourcePool) -> None:
        self._by_name = {pool.name: pool for pool in pools}

    def __iter__(self) -> Iterator[ResourcePool]:
        return iter(self._by_name.values())

    def __getitem__(self, name: str) -> ResourcePool:
        return self._by_name[name]

    def __getattr__(self, name: str) -> ResourcePool:
        if name.startswith("_"):  # not a pool (and never recurse before __init__ set _by_name)
            raise AttributeError(name)
        try:
            return self._by_name[name]
        except KeyError:
            raise AttributeError(f"no resource pool named {name!r}") from None

    def missing(self, demand: Demand) -> dict[str, int]:
        """Slots to reclaim per pool before `demand` can be allocated (only pools that are short)."""
        return {name: count - self[name].num_free for name, count in demand.items() if count > self[name].num_free}

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {pool.name: pool.to_dict() for pool in self}
