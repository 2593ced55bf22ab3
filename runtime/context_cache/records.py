"""Records: one per published endpoint, holding a cache reference on each of its pages and snapshots, in LRU order."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.pools import BASE_KV_PAGES, PARTIAL_KV_SNAPSHOTS, RECURRENT_SNAPSHOTS


@dataclass(frozen=True, slots=True)
class Record:
    """An endpoint: its full pages, and for a length that is not page-aligned optionally a snapshot of the
    partial tail page (`tail_key` chains the tail tokens from the last full page's key, like a page key).

    On a hybrid or pure recurrent deployment every record is an exact checkpoint: it also holds a recurrent
    snapshot (`recurrent_slot`) of the state after exactly `len(token_ids)` tokens. A pure recurrent record
    keeps the chain keys of its full blocks (content addressing) but no pages.
    """

    record_id: int
    keys: tuple[bytes, ...]  # chain keys of its full pages (logical blocks on a pure recurrent deployment)
    page_ids: tuple[int, ...]  # canonical base pages, one per key (none on a pure recurrent deployment)
    token_ids: tuple[int, ...]  # the tokens it covers: full pages, then the snapshot's tail (audits, lookups)
    extras: KeyExtras
    tail_key: bytes = b""  # set when the endpoint is not page-aligned: the exact endpoint's key
    partial_slot: int | None = None  # partial-KV snapshot slot holding the tail page's K/V
    recurrent_slot: int | None = None  # recurrent snapshot slot: every recurrent layer's state + conv state

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
        return self.recurrent_slot is not None

    def held(self) -> dict[str, tuple[int, ...]]:
        """Slots this record holds a cache reference on, per pool."""
        partial = () if self.partial_slot is None else (self.partial_slot,)
        recurrent = () if self.recurrent_slot is None else (self.recurrent_slot,)
        return {BASE_KV_PAGES: self.page_ids, PARTIAL_KV_SNAPSHOTS: partial, RECURRENT_SNAPSHOTS: recurrent}


class RecordStore:
    """Exact index (terminal key → record), the snapshot tails by parent key, checkpoint lengths by parent key,
    and record-level LRU order (first = least recently used).

    A checkpoint of length L is filed under its anchor, the key of its last full page (None below one page),
    so a lookup walks the input's own chain keys from the deepest and hashes a tail only where a checkpoint of
    that length hangs off a page the input shares.
    """

    __slots__ = ("_lru", "_by_key", "_tails", "_checkpoints", "_next_id")

    def __init__(self) -> None:
        self._lru: OrderedDict[int, Record] = OrderedDict()
        self._by_key: dict[bytes, int] = {}
        self._tails: dict[bytes | None, set[int]] = {}  # parent key -> records with a snapshot tail after it
        self._checkpoints: dict[bytes | None, dict[int, int]] = {}  # parent key -> {checkpoint length: records}
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
        if record.is_checkpoint:
            lengths = self._checkpoints.setdefault(record.parent_key, {})
            lengths[len(record.token_ids)] = lengths.get(len(record.token_ids), 0) + 1
        elif record.partial_slot is not None:
            self._tails.setdefault(record.parent_key, set()).add(record.record_id)

    def remove(self, record_id: int) -> Record:
        record = self._lru.pop(record_id)
        del self._by_key[record.terminal_key]
        if record.is_checkpoint:
            lengths = self._checkpoints[record.parent_key]
            lengths[len(record.token_ids)] -= 1
            if not lengths[len(record.token_ids)]:
                del lengths[len(record.token_ids)]
                if not lengths:
                    del self._checkpoints[record.parent_key]
        elif record.partial_slot is not None:
            tails = self._tails[record.parent_key]
            tails.discard(record_id)
            if not tails:
                del self._tails[record.parent_key]
        return record

    def tails_after(self, parent_key: bytes | None) -> list[Record]:
        """Records whose snapshot tail follows the full page `parent_key` (None: the chain root)."""
        return [self._lru[i] for i in self._tails.get(parent_key, ())]

    def checkpoint_lengths_after(self, parent_key: bytes | None) -> list[int]:
        """Lengths of the checkpoints whose last full page is `parent_key` (None: under a page), longest first."""
        return sorted(self._checkpoints.get(parent_key, ()), reverse=True)

    def least_recent_first(self) -> Iterator[Record]:
        return iter(list(self._lru.values()))

    def oldest_id(self) -> int:
        return next(iter(self._lru))
