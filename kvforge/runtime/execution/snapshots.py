"""Snapshot stores: partial-KV slots (one K+V page per attention layer, copied from and to the KV pool) and
recurrent slots (every recurrent layer's state and conv state, copied from and to a running sequence's row).

The cache manager decides which slot holds what (kvforge/runtime/context_cache); these stores only move bytes through
the runner's storage, so the cache core never touches K/V or states. Slots are preallocated in the storage
dtype ([slots, 2, Hkv, T, D] per layer; [slots, ...state] per state tensor); numpy maps untouched slots
lazily, so an unused budget costs no memory.
"""

from __future__ import annotations

import numpy as np

from kvforge.runtime.execution.backend import KVStorage
from kvforge.runtime.execution.recurrent_state import RecurrentStates


class PageSlots:
    """Slots shaped like pool pages, one array per layer, filled through the pool's page reads (`KVStorage`, so a
    device pool works as a host one does). Preallocated with np.zeros, so an unused slot costs no memory."""

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

    def store_page(self, page: int, slot: int) -> None:
        """Copy a whole pool page into `slot`."""
        for layer, rows in zip(self.layers, self.storage.read_page(page), strict=True):
            layer[slot] = rows


class PartialKVSnapshotStore(PageSlots):
    __slots__ = ()

    def capture(self, page: int, slot: int) -> None:
        """Copy a whole pool page (the valid tail tokens and whatever follows them) into `slot`."""
        self.store_page(page, slot)

    def restore(self, slot: int, page: int) -> None:
        """Copy `slot` into a request's own page; the snapshot stays as it was (copy-on-partial-reuse)."""
        self.storage.write_page(page, [layer[slot] for layer in self.layers])


class RecurrentSnapshotStore:
    """Exact checkpoints of recurrent layers: a slot is one sequence's every state tensor at one token count."""

    __slots__ = ("states", "arrays")

    def __init__(self, states: RecurrentStates, num_slots: int) -> None:
        self.states = states
        self.arrays = [np.zeros((num_slots, *array.shape[1:]), dtype=array.dtype) for array in states.arrays.values()]

    @property
    def num_slots(self) -> int:
        return len(self.arrays[0]) if self.arrays else 0

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays)

    def capture(self, row: int, slot: int) -> None:
        """Copy a running sequence's states (after its last computed token) into `slot`."""
        for array, state in zip(self.arrays, self.states.read(row), strict=True):
            array[slot] = state

    def restore(self, slot: int, row: int) -> None:
        """Copy `slot` into a sequence's row; the snapshot stays as it was (later records may restore it too)."""
        self.states.write(row, [array[slot] for array in self.arrays])
