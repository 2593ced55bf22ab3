"""The paged KV pool: an O(1) free list of page ids and one numpy tensor per attention layer."""

from __future__ import annotations

import numpy as np

from kvforge.plugins.reference import pool_numpy_dtype, to_storage
from kvforge.runtime.errors import KvforgeError


class PageAllocator:
    """Free list of physical page ids; pops and pushes are O(1), double frees are caught."""

    __slots__ = ("capacity", "_free", "_in_use")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first
        self._in_use = np.zeros(capacity, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if not self.can_allocate(num_pages):
            raise KvforgeError(f"KV pool exhausted: need {num_pages} pages, {len(self._free)} of "
                               f"{self.capacity} free; rebuild with a larger --maxKVPoolPages", "kv_pool")
        page_ids = [self._free.pop() for _ in range(num_pages)]
        self._in_use[page_ids] = True
        return page_ids

    def free(self, page_ids: list[int]) -> None:
        for page in page_ids:
            if not self._in_use[page]:
                raise AssertionError(f"page {page} freed twice")
            self._in_use[page] = False
            self._free.append(page)


class KVPool:
    """Per-layer pools [num_pages, 2, Hkv, tokens_per_page, D] in the storage dtype (FP8 as raw bytes)."""

    __slots__ = ("layers", "tokens_per_page", "kv_cache_dtype")

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, tokens_per_page: int, head_dim: int,
                 kv_cache_dtype: str) -> None:
        self.tokens_per_page = tokens_per_page
        self.kv_cache_dtype = kv_cache_dtype
        shape = (num_pages, 2, num_kv_heads, tokens_per_page, head_dim)
        # np.zeros maps untouched pages lazily, so a large pool costs memory only as it fills.
        self.layers = [np.zeros(shape, dtype=pool_numpy_dtype(kv_cache_dtype)) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def scatter(self, layer: int, rows: np.ndarray, page_ids: np.ndarray, slots: np.ndarray) -> None:
        """Write new rows [n, 2, Hkv, D] at (page, slot) pairs."""
        if self.kv_cache_dtype == "fp8":
            rows = to_storage(rows, "fp8")
        self.layers[layer][page_ids, :, :, slots, :] = rows
