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

A speculative lease's part (`DraftLease`, the drafter's handle: `draft_of(lease)`) is laid out like its base pages,
in the draft's own pool:

    | draft page 0 | ... | draft page h-1 (one record's path) | private draft pages ... |
    |<-- computed: positions p whose draft K/V (fed token p+1) is coherent -->|

After a speculative checkpoint hit (hybrid MTP, checkpoint of length L) the base is restored exactly at L, but the
draft's pages only below ((L - 1) // T) * T: the draft recomputes its last positions up to L - 1, whose K/V read
the successor token L (this request's, not the publisher's), from the record's stored hidden states:

    | draft pages (shared) | hidden: replayed first | new positions ... |
    0                      ((L-1)//T)*T             L
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.paging import pages_for
from kvforge.contract.profile_schema import DRAFT_KV_PAGES, FULL_PAGE_REPLAYS, PAIR_PUBLICATIONS, SPECULATIVE_KEYS
from kvforge.contract.profile_schema import SPECULATIVE as SPECULATIVE_BLOCK
from kvforge.contract.speculation import SPEC_SUPPORT, DraftKV
from kvforge.runtime.context_cache.lease import Inputs, Lease
from kvforge.runtime.context_cache.metrics import CounterBlock
from kvforge.runtime.context_cache.planner import PlanKind, ReusePlan, plan_resume
from kvforge.runtime.context_cache.pools import Demand, ResourcePool
from kvforge.runtime.context_cache.protocol import CacheSetup, CacheTypeBase, Lookup, Publication
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.context_cache.support import CacheSupport, ReuseOff, Tier
from kvforge.runtime.types import Deployment

DRAFT_OPTIONS = ("draft_pages", "draft_replays")
# The profile's `speculative` block (TensorRT Edge-LLM's keys): speculative hits that replayed their final matched
# page, and records committed or upgraded with a draft path beside their base pages. No /metrics series.
DRAFT_COUNTERS = CounterBlock(SPECULATIVE_BLOCK, SPECULATIVE_KEYS)


@dataclass(frozen=True, slots=True)
class DraftTail:
    """The base's hidden states [n, H] at positions start .. start + n - 1 of a checkpoint whose draft K/V there
    cannot be shared (hybrid MTP: the draft at a checkpoint's last position reads the token after it, the successor,
    which differs between the publisher and a hit): a restore recomputes the draft there from these."""

    start: int
    hidden: np.ndarray = field(compare=False)


@dataclass(frozen=True, slots=True)
class DraftPath:
    """A record's part (and a publication's): the draft's K/V for the first len(page_ids) full pages, computed by one
    sequence along the same tokens (a coherent path), and a hybrid MTP checkpoint's draft tail (None: the record
    serves speculative requests by its pages alone, or not at all on a checkpoint deployment). The tail is host
    memory beside the record, at most a page of hidden states."""

    page_ids: tuple[int, ...]
    tail: DraftTail | None = None


@dataclass(frozen=True, slots=True)
class DraftHit:
    """A speculative plan's part: the draft pages reused beside the base's hit pages, and (a checkpoint hit) the
    tail the draft recomputes from: the draft K/V it brings covers fewer positions than the plan's reuse."""

    page_ids: tuple[int, ...]
    tail: DraftTail | None = None


@dataclass(slots=True, eq=False)
class DraftLease:
    """A speculative lease's part and the drafter's handle on it: its draft pages, how many positions hold draft K/V
    coherent with the sequence (the drafter advances `computed`), and (hybrid MTP) the base's hidden states at
    positions [hidden_start, hidden_start + len) the drafter keeps (at most a page, up to `computed`), so a
    checkpoint can store its draft tail; after a checkpoint restore, the record's tail, replayed before anything."""

    page_ids: list[int]
    computed: int
    owner: DraftPaths
    hidden: np.ndarray | None = None
    hidden_start: int = 0

    def grow(self, num_tokens: int) -> bool:
        """Draft pages covering positions [0, num_tokens): where a drafter writes the K/V of its own proposals before
        the base verifies them (evicting LRU records if needed). False (nothing changed) when the pool cannot."""
        return self.owner.extend(self, num_tokens)

    def replays_to(self, position: int) -> bool:
        """Whether the draft K/V lags the base (after a hybrid checkpoint restore) and the kept hidden states reach
        from where the draft stopped up to `position`, to replay them."""
        hidden, first = self.hidden, self.hidden_start
        return hidden is not None and first <= self.computed < position <= first + len(hidden)

    def keep_hidden(self, first: int, base: np.ndarray, keep: int) -> None:
        """Keep the last `keep` base hidden states through position first + len(base) - 1 (`base` starts at
        `first`), joined to those kept already when they continue them."""
        old, offset = self.hidden, self.hidden_start
        if old is not None and offset <= first <= offset + len(old):
            base, first = np.concatenate([old[:first - offset], base]), offset
        cut = max(len(base) - keep, 0)
        self.hidden, self.hidden_start = np.array(base[cut:], dtype=np.float32), first + cut


# Its row of the support matrix (informational: the speculation table's rows refuse what it cannot serve).
DRAFT_SUPPORT = CacheSupport(
    "draft pages", "spec_decode", (Deployment.VANILLA, Deployment.HYBRID),
    tuple(name for name, row in SPEC_SUPPORT.items() if row.draft_kv is DraftKV.OWN), window_group=False,
    tier=Tier.NOT_SAVED, reuse_off=ReuseOff.RUNS, on=lambda config, build: False,
    note="the speculation table's own-pool drafts")


def speculative_input(speculative: bool) -> Inputs:
    """The request input of a sequence whose draft owns K/V (the table's "own pool" rows): it takes draft pages, and
    reuses only coherent draft paths."""
    return {DRAFT_KV_PAGES: True} if speculative else {}


def is_speculative(inputs: Inputs) -> bool:
    return bool(inputs.get(DRAFT_KV_PAGES))


def draft_of(lease: Lease | None) -> DraftLease | None:
    """The draft part of a speculative lease (None: not speculative, or no draft pool)."""
    return None if lease is None else lease.parts.get(DRAFT_KV_PAGES)


def shared_draft_pages(length: int, tokens_per_page: int) -> int:
    """Draft pages a checkpoint of `length` tokens shares: those wholly before its last position."""
    return (length - 1) // tokens_per_page


def build_draft_paths(setup: CacheSetup, name: str) -> DraftPaths | None:
    """Only with a draft that has its own KV pool (`draft_pages`); `draft_replays`: whether a hit replays its final
    page (EAGLE3, MTP: the draft at p reads token p + 1) or not (block drafts: their K/V at p depend on p alone)."""
    pages = int(setup.options.get("draft_pages", 0))
    if not pages:
        return None
    if not setup.paged:
        raise InvalidConfig("a draft with its own KV pool needs a base with attention layers (the support matrix "
                            "rejects pure-recurrent speculative decoding)", "spec_decode")
    return DraftPaths(ResourcePool(name, pages), setup.tokens_per_page,
                      replays=bool(setup.options.get("draft_replays", True)),
                      records=setup.records if setup.checkpoints else None, reserve=setup.reserve)


class DraftPaths(CacheTypeBase):
    __slots__ = ("name", "pool", "tokens_per_page", "replays", "records", "counts", "reserve", "_boundaries",
                 "_paths")

    def __init__(self, pool: ResourcePool, tokens_per_page: int, *, replays: bool = True,
                 records: RecordStore | None = None, reserve: Callable[[Demand], bool] | None = None) -> None:
        """`records`: a checkpoint deployment's records (hybrid MTP): hits are checkpoints with a draft tail.
        `reserve`: the coordinator's eviction, for a drafter growing its pages (`DraftLease.grow`)."""
        self.name = pool.name
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.replays = replays
        self.records = records
        self.counts = DRAFT_COUNTERS.zeros()
        self.reserve = reserve
        # base chain key of page j - 1 -> (record id, j): that record's draft path covers the first j pages
        self._boundaries: dict[bytes, tuple[int, int]] = {}
        self._paths: dict[int, tuple[int, ...]] = {}

    def fits_alone(self, num_tokens: int) -> bool:
        return pages_for(num_tokens, self.tokens_per_page) <= self.pool.capacity  # a speculative request's pages

    # --- lookup -------------------------------------------------------------------------------------

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """A plain admission keeps `agreed`. A speculative one reuses the longest coherent path among its matching
        pages minus its final page (none less without replay), never more than `agreed` (media spans, the
        full-input rewind) and never a snapshot tail (the draft has none): a cold start when no record with a path
        matches."""
        if not is_speculative(lookup.inputs):
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
                return cold.with_part(self.name, DraftHit(()), replayed_page=self.replays)
            path = self._paths[record_id]
            return cold.with_part(self.name, DraftHit(path[:pages]), kind=PlanKind.STANDARD,
                                  reuse_tokens=pages * self.tokens_per_page, hit_pages=tuple(matched[:pages]),
                                  new_pages=cold.new_pages - pages, replayed_page=self.replays)
        return cold

    def _checkpoint_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """The checkpoint the types before agreed on, with its draft pages and tail; cold without them."""
        record = None if agreed.resumes is None or self.records is None else self.records.get(agreed.resumes)
        if record is None:
            return agreed
        shared = shared_draft_pages(len(record.token_ids), self.tokens_per_page)
        path = record.parts.get(self.name)
        tail = None if path is None else path.tail
        if tail is None or len(path.page_ids) < shared or tail.start != shared * self.tokens_per_page:
            return plan_resume(len(lookup.tokens), self.tokens_per_page, paged=True)
        return agreed.with_part(self.name, DraftHit(path.page_ids[:shared], tail))

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        hit = plan.parts.get(self.name)
        return () if hit is None else hit.page_ids

    # --- a speculative lease's pages ----------------------------------------------------------------

    def admission_slots(self, plan: ReusePlan, inputs: Inputs) -> int:
        if not is_speculative(inputs):
            return 0
        hit = plan.parts.get(self.name)
        return len(plan.hit_pages) + plan.new_pages - (0 if hit is None else len(hit.page_ids))

    def admit(self, lease: Lease, plan: ReusePlan, inputs: Inputs, slots: list[int]) -> None:
        if plan.replayed_page:  # (a forced-cold retry admits a cold plan: nothing replayed)
            self.counts[FULL_PAGE_REPLAYS] += 1
        if not is_speculative(inputs):
            return
        hit = plan.parts.get(self.name)
        draft = DraftLease([*(() if hit is None else hit.page_ids), *slots], plan.reuse_tokens, self)
        if hit is not None and hit.tail is not None:  # the drafter replays the checkpoint's tail first
            draft.computed, draft.hidden, draft.hidden_start = hit.tail.start, hit.tail.hidden.copy(), hit.tail.start
        lease.parts[self.name] = draft

    def growth_slots(self, lease: Lease, num_tokens: int) -> int:
        draft = lease.parts.get(self.name)
        return 0 if draft is None else max(pages_for(num_tokens, self.tokens_per_page) - len(draft.page_ids), 0)

    def grow(self, lease: Lease, slots: list[int]) -> None:
        if slots:
            lease.parts[self.name].page_ids.extend(slots)

    def extend(self, draft: DraftLease, num_tokens: int) -> bool:
        """Draft pages (only) for positions [0, num_tokens) of `draft` (`DraftLease.grow`)."""
        missing = max(pages_for(num_tokens, self.tokens_per_page) - len(draft.page_ids), 0)
        if not missing:
            return True
        assert self.reserve is not None, "a drafter grows its pages through the coordinator's eviction"
        if not self.reserve({self.name: missing}):
            return False
        draft.page_ids.extend(self.pool.allocate(missing))
        return True

    def pinned(self, lease: Lease) -> tuple[int, ...]:
        draft = lease.parts.get(self.name)
        return () if draft is None else tuple(draft.page_ids)

    def release(self, lease: Lease) -> None:
        draft = lease.parts.get(self.name)
        if draft is not None:
            self.pool.unpin(draft.page_ids)

    # --- publication --------------------------------------------------------------------------------

    def project(self, lease: Lease, publication: Publication) -> None:
        """The draft path a speculative lease publishes: its draft pages over the full pages whose every position's
        draft K/V is coherent, at most one per base page the record keeps; on a checkpoint deployment also the
        tail of the base's hidden states (kept by the drafter), or no path when they do not cover it."""
        draft = lease.parts.get(self.name)
        if draft is None:
            return
        pages = min(len(publication.page_ids), draft.computed // self.tokens_per_page, len(draft.page_ids))
        path = DraftPath(tuple(draft.page_ids[:pages]))
        if self.records is not None:
            length = len(publication.tokens)
            shared = shared_draft_pages(length, self.tokens_per_page)
            start = shared * self.tokens_per_page
            hidden, hidden_start = draft.hidden, draft.hidden_start
            if hidden is None or draft.computed < length or pages < shared or hidden_start > start or \
                    hidden_start + len(hidden) < length:
                return
            path = DraftPath(path.page_ids, DraftTail(start, hidden[start - hidden_start:length - hidden_start].copy()))
        publication.parts[self.name] = path

    def record_part(self, publication: Publication) -> DraftPath | None:
        path = publication.parts.get(self.name)
        if path is not None and path.page_ids:
            self.counts[PAIR_PUBLICATIONS] += 1
        return path

    def upgrade(self, existing: Record, lease: Lease) -> Record | None:
        """A speculative publication of an endpoint already cached with a shorter draft path (base-only, or one
        published before the draft caught up) gives the record its path: speculative requests can use it from now."""
        if self.name not in lease.parts:
            return None
        probe = Publication(np.asarray(existing.token_ids, dtype=np.int32), list(existing.keys), b"", False,
                            page_ids=list(existing.page_ids))
        self.project(lease, probe)
        new, old = probe.parts.get(self.name), existing.parts.get(self.name)
        if self.records is not None:  # a checkpoint: worth a path only with its tail, which it lacked
            if (old is not None and old.tail is not None) or new is None or new.tail is None:
                return None
        elif len(() if new is None else new.page_ids) <= len(() if old is None else old.page_ids):
            return None
        self.counts[PAIR_PUBLICATIONS] += 1
        return existing.with_part(self.name, new)

    def held(self, record: Record) -> tuple[int, ...]:
        path = record.parts.get(self.name)
        return () if path is None else path.page_ids

    def on_commit(self, record: Record) -> None:
        path = record.parts.get(self.name)
        if path is None or not path.page_ids or self.records is not None:  # checkpoints are found by their own type
            return
        self._paths[record.record_id] = path.page_ids
        for j in range(1, len(path.page_ids) + 1):  # the newest path wins a boundary
            self._boundaries[record.keys[j - 1]] = (record.record_id, j)

    def on_evict(self, record: Record) -> None:
        path = self._paths.pop(record.record_id, None)
        if path is None:  # (never filed on a checkpoint deployment)
            return
        for key in record.keys[:len(path)]:
            if self._boundaries.get(key, (None,))[0] == record.record_id:
                del self._boundaries[key]

    def counters(self) -> dict[str, int]:
        return self.counts

    def boundaries(self) -> dict[bytes, tuple[int, int]]:
        """A copy of the boundary index (audits)."""
        return dict(self._boundaries)

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        T = self.tokens_per_page
        for lease in leases:
            draft = lease.parts.get(self.name)
            if draft is not None:
                assert len(draft.page_ids) * T >= draft.computed, "draft K/V past the draft pages"
        by_id = {}
        for record in records:
            by_id[record.record_id] = record
            path = record.parts.get(self.name)
            if path is not None and path.tail is not None:  # a hybrid MTP checkpoint: the states past its pages
                shared = (len(record.token_ids) - 1) // T
                assert self.records is not None and record.exact and path.tail.start == shared * T
                assert len(path.tail.hidden) == len(record.token_ids) - shared * T and len(path.page_ids) >= shared
        for key, (record_id, covered) in self._boundaries.items():
            record = by_id.get(record_id)
            assert record is not None, "a draft path boundary names an evicted record"
            assert len(self.held(record)) >= covered and record.keys[covered - 1] == key


# Typed handles besides `draft_of`: a record's or plan's draft part, read outside this type (tests, tools).
def draft_path(record: Record) -> DraftPath | None:
    return record.parts.get(DRAFT_KV_PAGES)


def draft_page_ids(holder: Record | ReusePlan | Lease) -> tuple[int, ...]:
    """The draft pages a record's path, a plan's hit or a speculative lease holds (none: empty)."""
    part = holder.parts.get(DRAFT_KV_PAGES)
    return () if part is None else tuple(part.page_ids)


def draft_tail(holder: Record | ReusePlan) -> DraftTail | None:
    part = holder.parts.get(DRAFT_KV_PAGES)
    return None if part is None else part.tail


def draft_computed_tokens(lease: Lease) -> int:
    draft = draft_of(lease)
    return 0 if draft is None else draft.computed
