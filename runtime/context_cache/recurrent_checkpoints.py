"""Recurrent checkpoints as a cache type: the state after exactly L tokens, reusable only at exactly L."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.runtime.context_cache.capture import SnapshotCopier
from kvforge.runtime.context_cache.keys import KeyExtras, MediaKey
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.partial_tails import tail_key
from kvforge.runtime.context_cache.planner import ReusePlan, plan_checkpoint
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import Lookup, Publication
from kvforge.runtime.context_cache.records import Record, RecordStore


def checkpoint_key(keys: Sequence[bytes], tokens: Sequence[int] | np.ndarray, length: int, tokens_per_page: int,
                   extras: KeyExtras, chain_root: bytes) -> bytes:
    """The key a checkpoint of exactly `length` tokens is found by: its last full page's key when page-aligned,
    else its tail's key (`tail_key`). The one rule, here and in the shared tier."""
    if length % tokens_per_page:
        return tail_key(keys, tokens, length, tokens_per_page, extras, chain_root)
    return keys[length // tokens_per_page - 1]


def resumable(length: int, num_tokens: int, media: Sequence[MediaKey]) -> bool:
    """Whether an input of `num_tokens` tokens may resume after `length`: one token must still compute (for the
    logits), and never inside a media span (its encoder output is one unit)."""
    return length < num_tokens and not any(m.start < length < m.start + m.length for m in media)


class RecurrentCheckpoints:
    """Recurrent snapshots (every recurrent layer's state + conv state), one per checkpoint record. A checkpoint of
    length L is filed under its anchor, the key of its last full page (None below one page), so a lookup walks the
    input's own chain keys from the deepest and hashes a tail only where a checkpoint of that length hangs off a
    page the input shares. `with_pages`: the deployment also keeps attention K/V (hybrid), so a checkpoint brings
    its full pages and must agree with the page index on them."""

    __slots__ = ("pool", "records", "tokens_per_page", "chain_root", "with_pages", "copier", "_lengths")

    def __init__(self, pool: ResourcePool, records: RecordStore, tokens_per_page: int, chain_root: bytes, *,
                 with_pages: bool, copier: SnapshotCopier | None) -> None:
        self.pool = pool
        self.records = records
        self.tokens_per_page = tokens_per_page
        self.chain_root = chain_root
        self.with_pages = with_pages
        self.copier = copier
        self._lengths: dict[bytes | None, dict[int, int]] = {}  # anchor -> {checkpoint length: records}

    def lengths_after(self, anchor: bytes | None) -> list[int]:
        """Lengths of the checkpoints whose last full page is `anchor` (None: under a page), longest first."""
        return sorted(self._lengths.get(anchor, ()), reverse=True)

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """The longest exact checkpoint strictly shorter than the input, not ending inside a media span, whose
        exact key and tokens match and (with pages) whose full pages are the index's matching pages; else a cold
        plan. A page hit alone is worthless here, so `agreed` is only the attention type's lookup (on `lookup`)."""
        tokens, keys, extras, T = lookup.tokens, lookup.keys, lookup.extras, self.tokens_per_page
        for depth in range((len(tokens) - 1) // T, -1, -1):
            anchor = keys[depth - 1] if depth else None
            for length in self.lengths_after(anchor):
                if not resumable(length, len(tokens), extras.media):
                    continue
                record = self.records.find(checkpoint_key(keys, tokens, length, T, extras, self.chain_root))
                if record is None or not record.is_checkpoint or record.token_ids != tuple(tokens[:length].tolist()):
                    continue
                if lookup.page_hits is not None and tuple(lookup.page_hits[:depth]) != record.page_ids:
                    continue  # the pages this checkpoint holds are not the ones the index serves for this input
                return plan_checkpoint(len(tokens), T, paged=self.with_pages, length=length,
                                       hit_pages=record.page_ids, recurrent_slot=record.recurrent_slot,
                                       partial_slot=record.partial_slot, record_id=record.record_id)
        return plan_checkpoint(len(tokens), T, paged=self.with_pages)

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        return () if plan.restore_recurrent_slot is None else (plan.restore_recurrent_slot,)

    def publication_slots(self, publication: Publication) -> int:
        return int(publication.recurrent)

    def capture(self, lease: Lease, publication: Publication) -> None:
        assert self.copier is not None, "a checkpoint deployment with reuse is built with a copier"
        assert publication.recurrent_slot is not None
        self.copier.capture_recurrent(lease, publication.recurrent_slot)

    def held(self, record: Record) -> tuple[int, ...]:
        return () if record.recurrent_slot is None else (record.recurrent_slot,)

    def on_commit(self, record: Record) -> None:
        lengths = self._lengths.setdefault(record.parent_key, {})
        lengths[len(record.token_ids)] = lengths.get(len(record.token_ids), 0) + 1

    def on_evict(self, record: Record) -> None:
        lengths = self._lengths[record.parent_key]
        lengths[len(record.token_ids)] -= 1
        if not lengths[len(record.token_ids)]:
            del lengths[len(record.token_ids)]
            if not lengths:
                del self._lengths[record.parent_key]
