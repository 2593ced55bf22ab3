"""The partial-KV snapshot store: slots holding one K+V page per attention layer, copied from and to the KV pool.

The cache manager decides which slot holds what (runtime/context_cache); this store only moves bytes through
the runner's KVStorage, so the cache core never touches K/V. Slots are preallocated per layer in the storage
dtype ([slots, 2, Hkv, T, D]); numpy maps untouched slots lazily, so an unused budget costs no memory.
"""

from __future__ import annotations

import numpy as np

from kvforge.runtime.runner import KVStorage


class PartialKVSnapshotStore:
    __slots__ = ("storage", "layers")

    def __init__(self, storage: KVStorage, num_slots: int) -> None:
        self.storage = storage
        self.layers = [np.zeros((num_slots, *page.shape), dtype=page.dtype) for page in storage.read_page(0)]

    @property
    def num_slots(self) -> int:
        return len(self.layers[0]) if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def capture(self, page: int, slot: int) -> None:
        """Copy a whole pool page (the valid tail tokens and whatever follows them) into `slot`."""
        for layer, rows in zip(self.layers, self.storage.read_page(page), strict=True):
            layer[slot] = rows

    def restore(self, slot: int, page: int) -> None:
        """Copy `slot` into a request's own page; the snapshot stays as it was (copy-on-partial-reuse)."""
        self.storage.write_page(page, [layer[slot] for layer in self.layers])
