"""Typed resource pools with active and cache reference counts; a slot is free only when both are zero."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from kvforge.contract.errors import KvforgeError

BASE_KV_PAGES = "base_kv_pages"
DRAFT_KV_PAGES = "draft_kv_pages"
RECURRENT_SNAPSHOTS = "recurrent_snapshots"
PARTIAL_KV_SNAPSHOTS = "partial_kv_snapshots"
POOL_NAMES = (BASE_KV_PAGES, DRAFT_KV_PAGES, RECURRENT_SNAPSHOTS, PARTIAL_KV_SNAPSHOTS)


class ResourcePool:
    """Fixed-capacity slots with an O(1) free list. `active` refs pin a slot for an in-flight request;
    `cache` refs are held by published records. Ids are pool-local."""

    __slots__ = ("name", "capacity", "active", "cache", "_free", "on_free")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.active = [0] * capacity
        self.cache = [0] * capacity
        self._free: deque[int] = deque(range(capacity))
        self.on_free: Callable[[int], None] | None = None  # the block index forgets freed pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """New slots start with active=1, cache=0."""
        if count > len(self._free):
            raise KvforgeError(f"{count} slots requested, {len(self._free)} of {self.capacity} free", self.name)
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
        return {"free": len(self._free), "capacity": self.capacity}


class ResourcePools:
    """The four typed pools of the cache; attention-only deployments leave all but base pages empty."""

    __slots__ = ("pools",)

    def __init__(self, capacities: dict[str, int]) -> None:
        self.pools = {name: ResourcePool(name, capacities.get(name, 0)) for name in POOL_NAMES}

    def __getitem__(self, name: str) -> ResourcePool:
        return self.pools[name]

    def can_allocate(self, demand: dict[str, int]) -> bool:
        return all(self.pools[name].can_allocate(count) for name, count in demand.items())

    def allocate(self, demand: dict[str, int]) -> dict[str, list[int]]:
        """All-or-nothing over every pool in the demand."""
        if not self.can_allocate(demand):
            short = {n: c for n, c in demand.items() if not self.pools[n].can_allocate(c)}
            raise KvforgeError(f"cannot allocate {short}", "resource_pools")
        return {name: self.pools[name].allocate(count) for name, count in demand.items()}

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {name: pool.to_dict() for name, pool in self.pools.items()}
