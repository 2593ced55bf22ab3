"""Records: one per published endpoint, holding a cache reference on each of its pages and snapshots, in LRU order."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.parts import NO_PARTS


@dataclass(frozen=True, slots=True)
class Record:
    """An endpoint: its full pages, and for a length that is not page-aligned the key of its exact end (`tail_key`
    chains the tail tokens from the last full page's key, like a page key). Whatever else it keeps (a snapshot of its
    tail page, a recurrent snapshot, a path of a second model's pages) is one part per cache type in `parts`, which
    only that type reads; `exact` marks a checkpoint, reusable only at exactly `len(token_ids)` tokens.

    On a hybrid or pure recurrent deployment every record is an exact checkpoint. A pure recurrent record keeps the
    chain keys of its full blocks (content addressing) but no pages.
    """

    record_id: int
    keys: tuple[bytes, ...]  # chain keys of its full pages (logical blocks on a pure recurrent deployment)
    page_ids: tuple[int, ...]  # canonical base pages, one per key (none on a pure recurrent deployment)
    token_ids: tuple[int, ...]  # the tokens it covers: full pages, then the snapshot's tail (audits, lookups)
    extras: KeyExtras
    tail_key: bytes = b""  # set when the endpoint is not page-aligned: the exact endpoint's key
    exact: bool = False  # a checkpoint: reusable only at its exact length
    parts: Mapping[str, Any] = field(default_factory=lambda: NO_PARTS, compare=False)  # type name -> what it keeps

    @property
    def terminal_key(self) -> bytes:
        """What identifies the endpoint: the tail key of an exact checkpoint, else the last full page's key."""
        return self.tail_key or self.keys[-1]

    @property
    def parent_key(self) -> bytes | None:
        """The key a snapshot's tail chains from (None = the chain root: the record has no full page)."""
        return self.keys[-1] if self.keys else None

    @property
    def is_checkpoint(self) -> bool:
        return self.exact

    def with_part(self, name: str, part: Any) -> Record:
        """The same record (id, endpoint) with type `name`'s part replaced."""
        return Record(self.record_id, self.keys, self.page_ids, self.token_ids, self.extras, self.tail_key, self.exact,
                      MappingProxyType({**self.parts, name: part}))

    def without(self, names: frozenset[str]) -> Record:
        """The same record (id, endpoint) without these types' parts (an eviction that takes only them)."""
        return Record(self.record_id, self.keys, self.page_ids, self.token_ids, self.extras, self.tail_key, self.exact,
                      MappingProxyType({name: part for name, part in self.parts.items() if name not in names}))


class RecordStore:
    """The records by terminal key (exact endpoints) in record-level LRU order (first = least recently used).

    What finds a record by something else (a snapshot tail by its parent page, a checkpoint by its anchor and
    length) belongs to that resource type (`PartialTails`, `RecurrentCheckpoints`), filed on commit.
    """

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

    def get(self, record_id: int) -> Record | None:
        return self._lru.get(record_id)

    def touch(self, record_id: int) -> None:
        self._lru.move_to_end(record_id)

    def insert(self, record: Record) -> None:
        if record.terminal_key in self._by_key:
            raise AssertionError("duplicate endpoint; callers touch the existing record instead")
        self._lru[record.record_id] = record
        self._by_key[record.terminal_key] = record.record_id

    def replace(self, record: Record) -> None:
        """Swap in a record with the same id and endpoint (an upgraded one), keeping its place in the LRU order."""
        if self._by_key.get(record.terminal_key) != record.record_id:
            raise AssertionError("replace keeps a record's id and endpoint")
        self._lru[record.record_id] = record

    def remove(self, record_id: int) -> Record:
        record = self._lru.pop(record_id)
        del self._by_key[record.terminal_key]
        return record

    def least_recent_first(self) -> Iterator[Record]:
        """Records, least recently used first. A generator: the LRU order is copied (so callers may evict while
        iterating) only when it is first read, and an eviction plan that needs no victim never reads it."""
        yield from list(self._lru.values())

    def oldest_id(self) -> int:
        return next(iter(self._lru))
