"""Records: one per published endpoint, holding a cache reference on each of its pages, kept in LRU order."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvforge.runtime.context_cache.keys import KeyExtras


@dataclass(frozen=True, slots=True)
class Record:
    record_id: int
    keys: tuple[bytes, ...]  # chain keys of its full pages; keys[-1] identifies the endpoint
    page_ids: tuple[int, ...]  # canonical base pages, one per key
    token_ids: tuple[int, ...]  # the tokens those pages hold (kept for audits and invariant checks)
    extras: KeyExtras

    @property
    def terminal_key(self) -> bytes:
        return self.keys[-1]


class RecordStore:
    """Exact index (terminal key → record) plus record-level LRU order (first = least recently used)."""

    __slots__ = ("_lru", "_by_key", "_next_id")

    def __init__(self) -> None:
        self._lru: OrderedDict[int, Record] = OrderedDict()
        self._by_key: dict[bytes, int] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._lru)

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def find(self, terminal_key: bytes) -> Record | None:
        record_id = self._by_key.get(terminal_key)
        return None if record_id is None else self._lru[record_id]

    def touch(self, record_id: int) -> None:
        self._lru.move_to_end(record_id)

    def insert(self, record: Record) -> None:
        if record.terminal_key in self._by_key:
            raise AssertionError("duplicate endpoint; callers touch the existing record instead")
        self._lru[record.record_id] = record
        self._by_key[record.terminal_key] = record.record_id

    def remove(self, record_id: int) -> Record:
        record = self._lru.pop(record_id)
        del self._by_key[record.terminal_key]
        return record

    def least_recent_first(self) -> Iterator[Record]:
        return iter(list(self._lru.values()))

    def oldest_id(self) -> int:
        return next(iter(self._lru))
