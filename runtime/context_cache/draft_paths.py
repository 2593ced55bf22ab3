"""Draft pages as a cache type: a draft's own pool (EAGLE3, block drafts), and the coherent draft paths records carry.

Draft pages are not content-addressed one by one: a draft page's K/V depends on the tokens *after* it (the draft at
position p is fed token p + 1) and on the draft pages before it, so a speculative hit takes one record's path
whole. Every full-page boundary of a record with a draft path is filed here by its base chain key; a speculative
admission takes the longest boundary among its matching base pages and reuses one page fewer than that in both
base and draft (the final matched page is replayed: its last position depends on the next page's first token,
which the match guarantees only up to the boundary). A record without a draft path (published by a plain request)
serves plain requests only; a speculative publication of the same endpoint upgrades it (the coordinator's job).

Block drafts (DFlash, DSpark) hold K/V at p that are projections of the base's hidden state at p alone, so nothing
is replayed: a hit reuses the whole coherent path up to its boundary (`replays=False`). Their pages could be
content-addressed one by one; the paths are kept for them too (one code path, and a path is only shorter than the
per-page match when two records diverge inside a document, where the base pages diverge as well).

On a hybrid deployment (MTP: the draft at p reads token p + 1, like EAGLE3) a hit is an exact checkpoint of length
L, and the base cannot recompute a page. So a speculative publication stores, beside its draft path, the base's
hidden states from the last page boundary at or before L - 1 up to L (a `DraftTail`), and a speculative hit takes
the checkpoint with the record's draft pages below that boundary, then the draft recomputes the tail from the
stored states with the hitting request's own successor token (the successor boundary rebuilt). A checkpoint
without a draft tail (published by a plain request) serves speculative requests nothing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvforge.runtime.context_cache.planner import PlanKind, ReusePlan, plan_checkpoint
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import Lookup, Publication
from kvforge.runtime.context_cache.records import DraftTail, Record, RecordStore


def shared_draft_pages(length: int, tokens_per_page: int) -> int:
    """Draft pages a checkpoint of `length` tokens shares: those wholly before its last position."""
    return (length - 1) // tokens_per_page


class DraftPaths:
    __slots__ = ("pool", "tokens_per_page", "replays", "records", "_boundaries", "_paths")

    def __init__(self, pool: ResourcePool, tokens_per_page: int, *, replays: bool = True,
                 records: RecordStore | None = None) -> None:
        """`records`: a checkpoint deployment's records (hybrid MTP): hits are checkpoints with a draft tail."""
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.replays = replays
        self.records = records
        # base chain key of page j - 1 -> (record id, j): that record's draft path covers the first j pages
        self._boundaries: dict[bytes, tuple[int, int]] = {}
        self._paths: dict[int, tuple[int, ...]] = {}

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """A plain admission keeps `agreed`. A speculative one reuses the longest coherent path among its matching
        pages minus its final page (none less without replay), never more than `agreed` (media spans, the
        full-input rewind) and never a snapshot tail (the draft has none): a cold start when no record with a path
        matches."""
        if not lookup.speculative:
            return agreed
        if self.records is not None:
            return self._checkpoint_hit(lookup, agreed)
        matched = lookup.page_hits or []
        cold = ReusePlan(PlanKind.NO_REUSABLE_PREFIX, agreed.matched_tokens, 0, (), agreed.new_pages + len(
            agreed.hit_pages))
        for boundary in range(len(matched), 0, -1):
            found = self._boundaries.get(lookup.keys[boundary - 1])
            if found is None:
                continue
            record_id, covered = found
            pages = min(boundary - int(self.replays), len(agreed.hit_pages), covered)
            if pages <= 0:
                return replace(cold, replayed_page=self.replays)
            path = self._paths[record_id]
            return replace(cold, kind=PlanKind.STANDARD, reuse_tokens=pages * self.tokens_per_page,
                           hit_pages=tuple(matched[:pages]), new_pages=cold.new_pages - pages,
                           draft_hit_pages=path[:pages], replayed_page=self.replays)
        return cold

    def _checkpoint_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """The checkpoint the types before agreed on, with its draft pages and tail; cold without them."""
        record = None if agreed.checkpoint_record is None or self.records is None else \
            self.records.get(agreed.checkpoint_record)
        if record is None:
            return agreed
        shared = shared_draft_pages(len(record.token_ids), self.tokens_per_page)
        tail = record.draft_tail
        if tail is None or len(record.draft_page_ids) < shared or tail.start != shared * self.tokens_per_page:
            return plan_checkpoint(len(lookup.tokens), self.tokens_per_page, paged=True)
        return replace(agreed, draft_hit_pages=record.draft_page_ids[:shared], draft_tail=tail)

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        return plan.draft_hit_pages

    def project(self, draft_page_ids: list[int], draft_computed_tokens: int, publication: Publication,
                hidden: np.ndarray | None = None, hidden_start: int = 0) -> None:
        """The draft path a speculative lease publishes: its draft pages over the full pages whose every position's
        draft K/V is coherent, at most one per base page the record keeps; on a checkpoint deployment also the
        tail of the base's hidden states (`hidden` from position `hidden_start`), or no path when they do not
        cover it."""
        pages = min(len(publication.page_ids), draft_computed_tokens // self.tokens_per_page, len(draft_page_ids))
        publication.draft_page_ids = draft_page_ids[:pages]
        if self.records is None:
            return
        length = len(publication.tokens)
        shared = shared_draft_pages(length, self.tokens_per_page)
        start = shared * self.tokens_per_page
        if hidden is None or draft_computed_tokens < length or pages < shared or hidden_start > start or \
                hidden_start + len(hidden) < length:
            publication.draft_page_ids = []
            return
        publication.draft_tail = DraftTail(start, hidden[start - hidden_start:length - hidden_start].copy())

    def publication_slots(self, publication: Publication) -> int:
        return 0  # the lease's own draft pages become the record's

    def held(self, record: Record) -> tuple[int, ...]:
        return record.draft_page_ids

    def on_commit(self, record: Record) -> None:
        if not record.draft_page_ids or self.records is not None:  # checkpoints are found by their own type
            return
        self._paths[record.record_id] = record.draft_page_ids
        for j in range(1, len(record.draft_page_ids) + 1):  # the newest path wins a boundary
            self._boundaries[record.keys[j - 1]] = (record.record_id, j)

    def on_evict(self, record: Record) -> None:
        if self._paths.pop(record.record_id, None) is None:  # (never filed on a checkpoint deployment)
            return
        for key in record.keys[:len(record.draft_page_ids)]:
            if self._boundaries.get(key, (None,))[0] == record.record_id:
                del self._boundaries[key]

    def boundaries(self) -> dict[bytes, tuple[int, int]]:
        """A copy of the boundary index (audits)."""
        return dict(self._boundaries)
