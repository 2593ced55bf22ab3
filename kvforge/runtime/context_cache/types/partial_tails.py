"""Partial-KV snapshot tails as a cache type: a copy of a record's tail page extends a page hit to its exact length."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.profile_schema import PARTIAL_KV_SNAPSHOTS
from kvforge.runtime.context_cache.keys import KeyExtras, tail_page_key
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.planner import PlanKind, ReusePlan
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import CacheSetup, Lookup, Publication, SnapshotRestore
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.context_cache.support import ALL_METHODS, NOT_ON_WINDOW_GROUP, CacheSupport, ReuseOff, Tier
from kvforge.runtime.context_cache.types.document_inputs import documents_of
from kvforge.runtime.types import Deployment

PARTIAL_OPTIONS = ("partial_kv_snapshot_slots",)


def tail_key(keys: Sequence[bytes], tokens: Sequence[int] | np.ndarray, length: int, tokens_per_page: int,
             extras: KeyExtras, chain_root: bytes) -> bytes:
    """The key a tail ending at `length` (not page-aligned) is found by: chained to the last full page before it
    (the chain root below one page). The one rule for where a tail lives, here and in the shared tier."""
    depth = length // tokens_per_page
    return tail_page_key(keys[depth - 1] if depth else chain_root, tokens[:length], depth * tokens_per_page, extras)


def _shared_prefix(stored: Sequence[int], tokens: np.ndarray) -> int:
    """How many leading tokens of a snapshot's tail the input repeats."""
    n = min(len(stored), len(tokens))
    differ = np.flatnonzero(np.asarray(stored[:n], dtype=np.int64) != tokens[:n])
    return int(differ[0]) if differ.size else n


class TailCopier(Protocol):
    """Moves tail-page bytes (the engine's state manager): `setup.copier(PARTIAL_KV_SNAPSHOTS)`."""

    def capture_partial(self, page: int, slot: int) -> None: ...

    def restore_partial(self, slot: int, page: int) -> None: ...


@dataclass(frozen=True, slots=True)
class TierValue:
    """What a record saves to a shared tier for one type: slot `slot` of the engine storage named `source` (a pool
    name), saved in the record's endpoint value in registration order (a checkpoint's state, then its tail page)."""

    source: str
    slot: int


@dataclass(frozen=True, slots=True)
class SnapshotHit:
    """A plan's and then a lease's part: snapshot `slot` holds the K/V of the `tokens` tokens after the hit pages,
    copied into the lease's first private page (pinned from admission until `finish_restore`, then None: the lease
    keeps how many tokens it restored)."""

    slot: int | None
    tokens: int


# Typed handles: a plan's or lease's hit, and a record's slot, read outside this type (the engine, the tier, tests).
def tail_hit(holder: Lease | ReusePlan) -> SnapshotHit | None:
    return holder.parts.get(PARTIAL_KV_SNAPSHOTS)


def restore_slot(holder: Lease | ReusePlan) -> int | None:
    """The snapshot slot a plan or lease restores (None: none, or restored already)."""
    hit = tail_hit(holder)
    return None if hit is None else hit.slot


def restore_tokens(holder: Lease | ReusePlan) -> int:
    """How many tokens past the hit pages a plan or lease restores from a snapshot."""
    hit = tail_hit(holder)
    return 0 if hit is None else hit.tokens


def partial_slot(record: Record) -> int | None:
    """The snapshot slot holding a record's tail page (None: it ends on a page boundary, or kept none)."""
    return record.parts.get(PARTIAL_KV_SNAPSHOTS)


def tail_tier_value(record: Record) -> TierValue | None:
    """A record's tail page, saved after any checkpoint state in its endpoint value."""
    slot = partial_slot(record)
    return None if slot is None else TierValue(PARTIAL_KV_SNAPSHOTS, slot)


# Its row of the support matrix: the tail page is copied through the global page table, so not beside a
# sliding-window group yet; a hybrid's checkpoints ending inside a page need it.
PARTIAL_SUPPORT = CacheSupport(
    "partial-KV snapshots", "context_cache_partial_kv_snapshot_pool_bytes", (Deployment.VANILLA, Deployment.HYBRID),
    ALL_METHODS, window_group=False, tier=Tier.SAVED, reuse_off=ReuseOff.UNUSED,
    refusals={"window": NOT_ON_WINDOW_GROUP})


def build_partial_tails(setup: CacheSetup, name: str) -> PartialTails | None:
    """Paged deployments only; a budget only with reuse on. A hybrid's checkpoints ending inside a page need one."""
    slots = int(setup.options.get("partial_kv_snapshot_slots", 0))
    if setup.enabled and setup.deployment is Deployment.HYBRID and slots < 1:
        raise InvalidConfig("a hybrid deployment needs at least one partial-KV snapshot slot for checkpoints that "
                            "end inside a page", "context_cache_partial_kv_snapshot_pool_bytes")
    if not setup.paged:
        return None
    return PartialTails(ResourcePool(name, slots if setup.enabled else 0), setup.tokens_per_page, setup.chain_root,
                        setup.copier(name), records=setup.records if setup.checkpoints else None)


class PartialTails(SnapshotRestore):
    """Snapshots of partial tail pages, filed by the key of the full page they follow. A snapshot is never written
    by a request: a hit copies it into the lease's own page (copy-on-partial-reuse). A checkpoint's tail belongs to
    its checkpoint (found through it: with `records`, a hit is the checkpoint the types before agreed on, and this
    type adds its tail page), so only plain records' tails are filed by parent key."""

    __slots__ = ("name", "pool", "tokens_per_page", "chain_root", "copier", "records", "_after", "_by_slot")

    def __init__(self, pool: ResourcePool, tokens_per_page: int, chain_root: bytes,
                 copier: TailCopier | None, *, records: RecordStore | None = None) -> None:
        self.name = pool.name
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.chain_root = chain_root
        self.copier = copier
        self.records = records  # a checkpoint deployment's records: tails come with the checkpoint they end
        self._after: dict[bytes | None, dict[int, Record]] = {}  # parent key (None: root) -> records by id
        self._by_slot: dict[int, Record] = {}  # snapshot slot -> the record holding it (a slot is never shared)

    @property
    def captures(self) -> bool:
        """Whether a publication can keep a tail at all (a pool to hold it, an engine to copy it)."""
        return self.pool.capacity > 0 and self.copier is not None

    @property
    def keeps_tail(self) -> bool:  # type: ignore[override]
        return self.captures

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """`agreed` extended by the longest run of snapshot-tail tokens the input shares after its hit pages,
        leaving at least one token to compute (for logits). A snapshot serves any prefix of its tail, not only an
        input that extends all of it: the K/V of a position depends only on the tokens up to it, so the first k
        restored positions are exact and the positions after them are overwritten as the request computes them (an
        identical prompt reuses all but its last token, a shared system prompt reuses to the token). Candidates
        follow the last hit page's key; each is checked by its tail key over its own tokens under the input's
        identity (adapter, salt and media included: equal only when they are the record's on the whole tail) and by
        its token ids. On a checkpoint deployment: the tail page of the checkpoint agreed on, if it ends inside a
        page (a checkpoint is exact state after all of its tokens, so only a whole checkpoint serves)."""
        if not self.pool.capacity:
            return agreed
        if self.records is not None:
            record = None if agreed.resumes is None else self.records.get(agreed.resumes)
            slot = None if record is None else record.parts.get(self.name)
            if slot is None:
                return agreed
            return agreed.with_part(self.name, SnapshotHit(slot, agreed.reuse_tokens % self.tokens_per_page))
        tokens, T = lookup.tokens, self.tokens_per_page
        base = len(agreed.hit_pages)
        start = base * T
        parent = lookup.keys[base - 1] if base else None
        best: tuple[int, Record] | None = None
        # A restored page is copied over whole, after any document's pages, so a document starting in it would be
        # computed: a few shared tail tokens are not worth a document's pages (the whole-tail extension of a record,
        # as a chat's next turn, is kept as before).
        document_in_page = any(start <= begin < start + T for begin, _ in documents_of(lookup.inputs).spans)
        for record in self._after.get(parent, {}).values():
            stored = record.token_ids[start:]
            tail = _shared_prefix(stored, tokens[start:len(tokens) - 1])  # one input token is left to compute
            if tail < 1 or (best is not None and tail <= best[0]) or record.page_ids != agreed.hit_pages:
                continue
            if tail < len(stored) and document_in_page:
                continue
            if tail_key(lookup.keys, record.token_ids, len(record.token_ids), T, lookup.extras,
                        self.chain_root) == record.tail_key:
                best = (tail, record)
        if best is None:
            return agreed
        tail, record = best
        # A plan that found no page becomes a standard hit; the tail's record is the one this plan resumes from.
        kind = PlanKind.STANDARD if agreed.kind is PlanKind.NO_REUSABLE_PREFIX else agreed.kind
        reuse = agreed.reuse_tokens + tail
        return agreed.with_part(self.name, SnapshotHit(record.parts[self.name], tail), kind=kind,
                                matched_tokens=max(agreed.matched_tokens, reuse), reuse_tokens=reuse,
                                resumes=record.record_id)

    def record_holding(self, slot: int) -> Record | None:
        return self._by_slot.get(slot)

    # --- a lease's restore --------------------------------------------------------------------------

    def restore(self, lease: Lease) -> None:
        """Copy-on-partial-reuse: the snapshot goes into the lease's own page after the hit pages, which it then
        extends."""
        slot = restore_slot(lease)
        if slot is not None:
            assert self.copier is not None, "a snapshot hit without a snapshot store"
            self.copier.restore_partial(slot, lease.page_ids[lease.reuse_tokens // self.tokens_per_page])

    def finish_restore(self, lease: Lease) -> bool:
        hit = lease.parts.get(self.name)
        if hit is None or hit.slot is None:
            return False
        self.pool.unpin([hit.slot])
        lease.parts[self.name] = SnapshotHit(None, hit.tokens)
        return True

    def release(self, lease: Lease) -> None:
        self.finish_restore(lease)  # admitted but never run: the snapshot was not copied

    # --- publication --------------------------------------------------------------------------------

    def publication_slots(self, publication: Publication) -> int:
        # Without a pool, a tail another type keeps (a short document's stored form) takes no snapshot slot here.
        return int(bool(publication.tail_key) and self.captures)

    def capture(self, lease: Lease, publication: Publication) -> bool:
        """Copy the lease's tail page (the one after the publication's full pages) into the reserved slot."""
        slots = publication.reserved.get(self.name)
        if not slots:
            return False
        assert self.copier is not None
        self.copier.capture_partial(lease.page_ids[len(publication.keys)], slots[0])
        return True

    def on_commit(self, record: Record) -> None:
        slot = record.parts.get(self.name)
        if slot is None:
            return
        self._by_slot[slot] = record
        if not record.exact:
            self._after.setdefault(record.parent_key, {})[record.record_id] = record

    def on_evict(self, record: Record) -> None:
        slot = record.parts.get(self.name)
        if slot is None:
            return
        del self._by_slot[slot]
        if not record.exact:
            after = self._after[record.parent_key]
            del after[record.record_id]
            if not after:
                del self._after[record.parent_key]

    def filed(self, record: Record) -> bool:
        """Whether `record`'s tail is where lookups find it (the audit)."""
        slot = record.parts.get(self.name)
        if slot is None:
            return True
        if self._by_slot.get(slot) is not record:
            return False
        return record.exact or self._after.get(record.parent_key, {}).get(record.record_id) is record

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        T = self.tokens_per_page
        for record in records:
            slot = record.parts.get(self.name)
            tail = len(record.token_ids) - len(record.keys) * T
            if self.records is not None:  # a checkpoint keeps its tail page iff it ends inside one
                assert (slot is not None) == (tail > 0)
            elif slot is None:
                assert tail == 0 and not record.tail_key
            else:
                assert 0 < tail < T, "a snapshot holds a partial tail page"
            if slot is not None:
                assert self.filed(record), "a snapshot tail lookups cannot find"
