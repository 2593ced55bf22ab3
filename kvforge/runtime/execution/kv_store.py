"""The paged KV pool: one numpy tensor per attention layer, addressed through page-table rows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvforge.plugins.reference import apply_rope, pool_numpy_dtype, rotate_keys, to_storage
from kvforge.runtime.execution.backend import KVStorage
from kvforge.runtime.execution.key_rotation import KeyRotation, moved_keys

ROTATION_CHECK_TOLERANCE = 1e-3  # float32 rotations of unit-scale keys agree to ~1e-6; a wrong table is off by O(1)


class KVStore:
    """Per-layer pools [num_pages, 2, Hkv, tokens_per_page, D] in the storage dtype (FP8 as raw bytes)."""

    __slots__ = ("layers", "tokens_per_page", "kv_cache_dtype", "layer_group")

    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, tokens_per_page: int, head_dim: int,
                 kv_cache_dtype: str, *, groups: Mapping[str, tuple[Iterable[int], int]] | None = None,
                 head_dims: tuple[int, ...] = ()) -> None:
        """`groups`: page groups beside the global one, by name: (their layer indices into `layers`, pages each),
        addressed through the rows' tables of that group; every other layer has `num_pages`. `head_dims`: each
        layer's head size where they differ (Gemma 4's wider global heads), else every layer's is `head_dim`."""
        self.tokens_per_page = tokens_per_page
        self.kv_cache_dtype = kv_cache_dtype
        # Each layer's page group (None: the global one) and that group's page count.
        self.layer_group: list[str | None] = [None] * num_layers
        pages = [num_pages] * num_layers
        for name, (layers, group_pages) in (groups or {}).items():
            for layer in layers:
                self.layer_group[layer], pages[layer] = name, group_pages
        dtype = pool_numpy_dtype(kv_cache_dtype)
        # np.zeros maps untouched pages lazily, so a large pool costs memory only as it fills.
        self.layers = [np.zeros((pages[i], 2, num_kv_heads, tokens_per_page, head_dims[i] if head_dims else head_dim),
                                dtype=dtype) for i in range(num_layers)]

    def _one_table(self) -> None:
        """What addresses every layer through one row of page ids cannot serve another page group (its layers have
        their own page ids): the support rows refuse the features that would ask (snapshots, the shared tier,
        speculation; the engine the legacy system-prompt cache); this guards the pool."""
        groups = sorted({group for group in self.layer_group if group is not None})
        if groups:
            raise AssertionError(f"a copy through one page table on a pool with another page group "
                                 f"({', '.join(groups)})")

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def locate(self, page_ids: list[int], start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(page, slot) of positions [start, stop) of a sequence whose page-table row is `page_ids`."""
        positions = np.arange(start, stop)
        return np.asarray(page_ids, dtype=np.int64)[positions // self.tokens_per_page], positions % self.tokens_per_page

    def scatter(self, layer: int, rows: np.ndarray, page_ids: np.ndarray, slots: np.ndarray) -> None:
        """Write new float rows [n, 2, Hkv, D] at (page, slot) pairs, encoding them as the pool stores them."""
        if self.kv_cache_dtype == "fp8":
            rows = to_storage(rows, "fp8")
        self.layers[layer][page_ids, :, :, slots, :] = rows

    def read_tokens(self, page_ids: list[int], num_tokens: int) -> list[np.ndarray]:
        """Stored rows [n, 2, Hkv, D] of positions [0, num_tokens) per layer (copies, storage dtype)."""
        self._one_table()
        pages, slots = self.locate(page_ids, 0, num_tokens)
        return [layer[pages, :, :, slots, :] for layer in self.layers]

    def write_tokens(self, page_ids: list[int], stored_rows: list[np.ndarray]) -> None:
        """Write rows previously returned by read_tokens back at positions [0, n)."""
        self._one_table()
        pages, slots = self.locate(page_ids, 0, len(stored_rows[0]))
        for layer, rows in zip(self.layers, stored_rows, strict=True):
            layer[pages, :, :, slots, :] = rows

    def copy_positions(self, page_ids: list[int], sources: list[int], targets: list[int]) -> None:
        """Move K/V rows within one sequence: position sources[i] to targets[i] (a tree verify's accepted path to
        consecutive positions). Sources are read before anything is written, so the lists may overlap."""
        self._one_table()
        src_pages, src_slots = _locate_positions(page_ids, sources, self.tokens_per_page)
        dst_pages, dst_slots = _locate_positions(page_ids, targets, self.tokens_per_page)
        for layer in self.layers:
            layer[dst_pages, :, :, dst_slots, :] = layer[src_pages, :, :, src_slots, :]

    def copy_rotated(self, src_pages: list[int], dst_pages: list[int], delta: int, cos_sin: np.ndarray) -> None:
        """Copy whole pages src_pages[i] -> dst_pages[i], their K moved `delta` positions (a document's K/V placed
        at another offset; `delta` a multiple of the page size keeps slots in place). V does not depend on the
        position and is copied as stored. `cos_sin` is the engine's rope table (the pool does not know the rope).
        Sources are read before anything is written, so the lists may overlap."""
        self._one_table()
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destinations")
        src, dst = np.asarray(src_pages, dtype=np.int64), np.asarray(dst_pages, dtype=np.int64)
        for layer in self.layers:
            pages = layer[src].copy()  # [n, 2, Hkv, T, D]
            pages[:, 0] = moved_keys(pages[:, 0], delta, cos_sin, self.kv_cache_dtype)
            layer[dst] = pages

    def read_page(self, page: int) -> list[np.ndarray]:
        """Views of one page [2, Hkv, T, D] per layer (callers copy them before the page is written again)."""
        self._one_table()
        return [layer[page] for layer in self.layers]

    def write_page(self, page: int, stored: list[np.ndarray]) -> None:
        self._one_table()
        for layer, rows in zip(self.layers, stored, strict=True):
            layer[page] = rows

    def read_group_page(self, page: int, group: str | None) -> list[np.ndarray]:
        """Views of page `page` of each layer of page group `group` (None: the global one), in pool order: a group's
        page ids are its own, so a copy through a row's tables goes group by group (a document's rows, issue 53)."""
        return [layer[page] for layer, own in zip(self.layers, self.layer_group, strict=True) if own == group]

    def write_group_page(self, page: int, stored: list[np.ndarray], group: str | None) -> None:
        """Overwrite page `page` of each layer of `group` with what read_group_page returned."""
        layers = [layer for layer, own in zip(self.layers, self.layer_group, strict=True) if own == group]
        for layer, rows in zip(layers, stored, strict=True):
            layer[page] = rows


class DocumentKVStore:
    """Documents' stored K/V beside the pool (issue 37): slots shaped like pool pages, each holding one page of a
    document computed alone at position 0. Copies go by token rows, so a document restored at any position lands in
    whatever pages and slots that position maps to, partly filled pages included.

    Page groups (issue 53): on an engine built with --slidingWindowPool the sliding layers' pages are the window
    group's, addressed by the row's window table. A slot keeps, for each pool layer, the document's logical page of
    that layer's group; a group page the producer no longer held (behind its window) is not captured, and its rows
    are never restored (nothing reads them: only the last window of a document is read after it)."""

    __slots__ = ("storage", "layers", "groups", "captured", "rotations", "kv_cache_dtype", "tokens_per_page")

    def __init__(self, kv: KVStorage, num_slots: int, rotations: np.ndarray | Sequence[KeyRotation],
                 kv_cache_dtype: str) -> None:
        """`rotations`: each pool layer's RoPE (key_rotation.layer_rotations), or one rope table every layer turns
        by."""
        self.storage = kv
        # Each page group's pool layers (None: the global group, the lease's page ids).
        self.groups: dict[str | None, list[int]] = {}
        for layer, group in enumerate(kv.layer_group):
            self.groups.setdefault(group, []).append(layer)
        self.layers: list[np.ndarray] = [np.empty(0)] * len(kv.layer_group)
        for group, members in self.groups.items():
            for layer, page in zip(members, self._read(0, group), strict=True):
                # np.zeros maps a slot's memory only when it is written.
                self.layers[layer] = np.zeros((num_slots, *page.shape), dtype=page.dtype)
        # Per group beside the global one: which slots hold that group's page of their document.
        self.captured = {group: np.zeros(num_slots, dtype=bool) for group in self.groups if group is not None}
        # K moves by each layer's own rotation (issue 53: Gemma's layer types turn by their own bases and scalings).
        self.rotations: list[np.ndarray | KeyRotation] = [rotations] * len(self.layers) \
            if isinstance(rotations, np.ndarray) else list(rotations)
        if len(self.rotations) != len(self.layers):
            raise ValueError(f"{len(self.rotations)} layer rotations for {len(self.layers)} pool layers")
        self.kv_cache_dtype = kv_cache_dtype
        self.tokens_per_page = self.layers[0].shape[3] if self.layers else 0  # [slots, 2, Hkv, T, D]

    @property
    def num_slots(self) -> int:
        return len(self.layers[0]) if self.layers else 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def _read(self, page: int, group: str | None) -> list[np.ndarray]:
        if len(self.groups) == 1:  # one page table (a device pool has no other group)
            return self.storage.read_page(page)
        return self.storage.read_group_page(page, group)

    def _write(self, page: int, stored: list[np.ndarray], group: str | None) -> None:
        if len(self.groups) == 1:
            self.storage.write_page(page, stored)
        else:
            self.storage.write_group_page(page, stored, group)

    def capture(self, page_ids: list[int], slots: list[int], tables: Mapping[str, Sequence[int]] | None = None) -> None:
        """Copy a document's pool pages (its sequence's first pages, the last one possibly partial) into `slots`:
        logical page i from `page_ids[i]` in the global group, from `tables[group][i]` in another group (a negative
        entry, or none: that group's page is not captured)."""
        if len(page_ids) != len(slots):
            raise ValueError(f"{len(page_ids)} pages for {len(slots)} slots")
        for group, members in self.groups.items():
            table = page_ids if group is None else (tables or {}).get(group, ())
            for index, slot in enumerate(slots):
                page = int(table[index]) if index < len(table) else -1
                if group is not None:
                    self.captured[group][slot] = page >= 0
                if page < 0:
                    continue
                for layer, rows in zip(members, self._read(page, group), strict=True):
                    self.layers[layer][slot] = rows

    def restore(self, slots: list[int], page_ids: Sequence[int], start: int, first: int, last: int,
                group: str | None = None) -> None:
        """Write the document's token rows [first, last) at sequence positions start+first .. start+last-1 into the
        layers of page group `group` (None: the global one) through that group's page-table row `page_ids`, each K
        rotated by `start` with its layer's RoPE (computed at p, it now sits at start + p). Rows whose page is
        negative or past the row's table, or that the group did not capture, are left alone. Each destination page is
        read, its rows replaced and written back, so the rows around them stay as they were."""
        members = self.groups.get(group, [])
        if first >= last or not members:
            return
        T = self.tokens_per_page
        rows = np.arange(first, last)
        src_slots = np.asarray(slots, dtype=np.int64)[rows // T]
        logical = (start + rows) // T
        table = np.asarray(page_ids, dtype=np.int64)
        wanted = logical < len(table)
        dst_pages = np.full(len(rows), -1, dtype=np.int64)
        dst_pages[wanted] = table[logical[wanted]]
        wanted &= dst_pages >= 0
        if group is not None:
            wanted &= self.captured[group][src_slots]
        if not wanted.any():
            return
        rows, src_slots, dst_pages = rows[wanted], src_slots[wanted], dst_pages[wanted]
        src_rows, dst_rows = rows % T, (start + rows) % T
        moved = []
        for layer in members:
            rotation = self.rotations[layer]
            layer_rows = self.layers[layer][src_slots, :, :, src_rows, :]  # [n, 2, Hkv, D]
            layer_rows[:, 0] = rotation.move(layer_rows[:, 0], start, self.kv_cache_dtype) \
                if isinstance(rotation, KeyRotation) else moved_keys(layer_rows[:, 0], start, rotation,
                                                                    self.kv_cache_dtype)
            moved.append(layer_rows)
        for page in dict.fromkeys(dst_pages.tolist()):
            here = dst_pages == page
            pages = [np.array(layer) for layer in self._read(page, group)]  # copies: a read may give views
            for layer, layer_rows in zip(pages, moved, strict=True):
                layer[:, :, dst_rows[here], :] = np.moveaxis(layer_rows[here], 0, 2)
            self._write(page, pages, group)


def check_rotation(cos_sin: np.ndarray, head_dim: int, shift: int = 37) -> float:
    """The largest difference between keys rotated to p and then moved by `shift` (`rotate_keys`) and the same keys
    rotated to p + shift directly (`apply_rope`), in float32 over the table's positions; a table the rotation cannot
    reproduce (rope scaling, a rotary variant) is refused by its caller when this is above ROTATION_CHECK_TOLERANCE.
    Like LMCache's start-up check of its fused rope against the reference."""
    capacity = cos_sin.shape[0]
    shift = min(shift, capacity - 1)
    positions = np.arange(0, capacity - shift, max((capacity - shift) // 16, 1))
    keys = np.random.default_rng(0).standard_normal((len(positions), 1, head_dim)).astype(np.float32)
    at_p = apply_rope(keys, cos_sin, positions)
    moved = rotate_keys(at_p, shift, cos_sin, "fp32")
    direct = apply_rope(keys, cos_sin, positions + shift)
    return float(np.max(np.abs(moved - direct)))


def _locate_positions(page_ids: list[int], positions: list[int], tokens_per_page: int) -> tuple[np.ndarray, np.ndarray]:
    at = np.asarray(positions, dtype=np.int64)
    return np.asarray(page_ids, dtype=np.int64)[at // tokens_per_page], at % tokens_per_page


def rotation_error(rotations: Sequence[KeyRotation], capacity: int) -> float:
    """The largest `check_rotation` error over the distinct segments of the layers' rotations (tables of
    `capacity` rows)."""
    worst, seen = 0.0, set()
    for rotation in rotations:
        for (first, freq), table in zip(rotation.segments, rotation.tables(capacity), strict=True):
            if (first, freq.tobytes()) not in seen:
                seen.add((first, freq.tobytes()))
                worst = max(worst, check_rotation(table, table.shape[1]))
    return worst
