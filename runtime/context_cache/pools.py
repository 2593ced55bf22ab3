"""A resource pool with active and cache reference counts; a slot is free only when both are zero."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

# The base KV pages are the only pool with behaviour today; snapshot and draft pools join when their
# features land (the profile still lists their keys, with zeros, for scripts written for TensorRT Edge-LLM).
from kvforge.contract.profile_schema import BASE_KV_PAGES, POOL_CAPACITY, POOL_FREE  # noqa: F401 - BASE_KV_PAGES re-exported


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
        self.on_free: Callable[[int], None] | None = None  # the page index forgets freed pages

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
