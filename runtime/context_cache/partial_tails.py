"""Partial-KV snapshot tails as a cache type: a copy of a record's tail page extends a page hit to its exact length."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.runtime.context_cache.capture import SnapshotCopier
from kvforge.runtime.context_cache.keys import KeyExtras, tail_page_key
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.planner import ReusePlan, with_snapshot
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import Lookup, Publication
from kvforge.runtime.context_cache.records import Record


def tail_key(keys: Sequence[bytes], tokens: Sequence[int] | np.ndarray, length: int, tokens_per_page: int,
             extras: KeyExtras, chain_root: bytes) -> bytes:
    """The key a tail ending at `length` (not page-aligned) is found by: chained to the last full page before it
    (the chain root below one page). The one rule for where a tail lives, here and in the shared tier."""
    depth = length // tokens_per_page
    return tail_page_key(keys[depth - 1] if depth else chain_root, tokens[:length], depth * tokens_per_page, extras)


class PartialTails:
    """Snapshots of partial tail pages, filed by the key of the full page they follow. A snapshot is never written
    by a request: a hit copies it into the lease's own page (copy-on-partial-reuse). A checkpoint's tail belongs to
    its checkpoint (found through it, `RecurrentCheckpoints`), so only plain records' tails are filed here."""

    __slots__ = ("pool", "tokens_per_page", "chain_root", "copier", "_after", "_by_slot")

    def __init__(self, pool: ResourcePool, tokens_per_page: int, chain_root: bytes,
                 copier: SnapshotCopier | None) -> None:
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.chain_root = chain_root
        self.copier = copier
        self._after: dict[bytes | None, dict[int, Record]] = {}  # parent key (None: root) -> records by id
        self._by_slot: dict[int, Record] = {}  # snapshot slot -> the record holding it (a slot is never shared)

    @property
    def captures(self) -> bool:
        """Whether a publication can keep a tail at all (a pool to hold it, an engine to copy it)."""
        return self.pool.capacity > 0 and self.copier is not None

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """`agreed` extended by the longest snapshot tail that continues its hit pages along the input, leaving at
        least one token to compute (for logits). Candidates follow the last hit page's key; each is checked by its
        tail key (adapter, salt and media included) and its token ids."""
        if not self.pool.capacity:
            return agreed
        tokens, T = lookup.tokens, self.tokens_per_page
        base = len(agreed.hit_pages)
        start = base * T
        parent = lookup.keys[base - 1] if base else None
        best: tuple[int, Record] | None = None
        for record in self._after.get(parent, {}).values():
            tail = len(record.token_ids) - start
            if not 0 < tail < len(tokens) - start or (best is not None and tail <= best[0]):
                continue
            if record.page_ids != agreed.hit_pages:
                continue
            if list(record.token_ids[start:]) != tokens[start:start + tail].tolist():
                continue
            if tail_key(lookup.keys, tokens, start + tail, T, lookup.extras, self.chain_root) == record.tail_key:
                best = (tail, record)
        if best is None:
            return agreed
        assert best[1].partial_slot is not None
        return with_snapshot(agreed, best[1].partial_slot, best[0])

    def record_holding(self, slot: int) -> Record | None:
        return self._by_slot.get(slot)

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        return () if plan.restore_slot is None else (plan.restore_slot,)

    def publication_slots(self, publication: Publication) -> int:
        return int(publication.partial)

    def capture(self, lease: Lease, publication: Publication) -> None:
        """Copy the lease's tail page (the one after the publication's full pages) into the reserved slot."""
        assert self.copier is not None and publication.partial_slot is not None
        self.copier.capture_partial(lease.page_ids[len(publication.keys)], publication.partial_slot)

    def held(self, record: Record) -> tuple[int, ...]:
        return () if record.partial_slot is None else (record.partial_slot,)

    def on_commit(self, record: Record) -> None:
        if record.partial_slot is None:
            return
        self._by_slot[record.partial_slot] = record
        if not record.is_checkpoint:
            self._after.setdefault(record.parent_key, {})[record.record_id] = record

    def on_evict(self, record: Record) -> None:
        if record.partial_slot is None:
            return
        del self._by_slot[record.partial_slot]
        if not record.is_checkpoint:
            after = self._after[record.parent_key]
            del after[record.record_id]
            if not after:
                del self._after[record.parent_key]

    def filed(self, record: Record) -> bool:
        """Whether `record`'s tail is where lookups find it (the audit)."""
        if record.partial_slot is None:
            return True
        if self._by_slot.get(record.partial_slot) is not record:
            return False
        return record.is_checkpoint or self._after.get(record.parent_key, {}).get(record.record_id) is record
