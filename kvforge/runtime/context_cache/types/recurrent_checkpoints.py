"""Recurrent checkpoints as a cache type: the state after exactly L tokens, reusable only at exactly L.

Hybrid and pure recurrent deployments reuse ONLY exact checkpoints: a recurrent layer's state after L tokens cannot
be rebuilt from KV pages, so a page hit without the state is worthless. A checkpoint is a record of exactly L tokens
holding a recurrent snapshot and, on a hybrid with L not page-aligned, a partial-KV snapshot of its tail page, plus
(hybrid) cache refs on its floor(L/T) full pages. Token layout of a hybrid lease resuming from L = h*T + r tokens:

    |<-- reuse_tokens = L ----------------------------------------->|
    | page 0 | ... | page h-1 (hits: the checkpoint's canonical pages)| page h: r restored tokens, computing ->| ... |
                                                                    |<- its partial-KV snapshot ------------->|
    recurrent + conv state of the sequence <- the checkpoint's recurrent snapshot (state after exactly L tokens)

The longest checkpoint the index's matching pages agree with is the hit; none: a cold start (zeroed state).
Publication is capture: `publish(lease, tokens)` runs at chat-message boundaries, snapshot intervals and the prefill
and decode ends, each time with exactly the tokens the lease has computed. Nothing is indexed in flight there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.profile_schema import RECURRENT_SNAPSHOTS
from kvforge.runtime.context_cache.keys import KeyExtras, MediaKey
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.planner import ReusePlan, plan_resume
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import CacheSetup, Lookup, Publication, SnapshotRestore
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.context_cache.support import ALL_METHODS, CacheSupport, ReuseOff, Tier
from kvforge.runtime.context_cache.types.partial_tails import TierValue, tail_key
from kvforge.runtime.types import Deployment

RECURRENT_OPTIONS = ("recurrent_snapshot_slots",)


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


class CheckpointCopier(Protocol):
    """Moves recurrent state bytes (the engine's state manager): `setup.copier(RECURRENT_SNAPSHOTS)`."""

    def capture_recurrent(self, lease: Lease, slot: int) -> None: ...

    def restore_recurrent(self, slot: int, lease: Lease) -> None: ...


@dataclass(frozen=True, slots=True)
class CheckpointHit:
    """A plan's and then a lease's part: the recurrent snapshot `slot` of checkpoint record `record_id`, copied into
    the sequence's recurrent + conv state (pinned from admission until `finish_restore`)."""

    slot: int
    record_id: int


# Typed handles: a plan's or lease's hit, and a record's slot, read outside this type (the engine, the tier, tests).
def checkpoint_hit(holder: Lease | ReusePlan) -> CheckpointHit | None:
    return holder.parts.get(RECURRENT_SNAPSHOTS)


def restore_recurrent_slot(holder: Lease | ReusePlan) -> int | None:
    """The recurrent snapshot a plan or lease restores (None: a cold start, or restored already)."""
    hit = checkpoint_hit(holder)
    return None if hit is None else hit.slot


def checkpoint_record(plan: ReusePlan) -> int | None:
    hit = checkpoint_hit(plan)
    return None if hit is None else hit.record_id


def recurrent_slot(record: Record) -> int | None:
    """The recurrent snapshot slot of a checkpoint record (None: not a checkpoint, or it kept none)."""
    return record.parts.get(RECURRENT_SNAPSHOTS)


def checkpoint_tier_value(record: Record) -> TierValue | None:
    """A checkpoint's recurrent state, saved first in its endpoint value."""
    slot = recurrent_slot(record)
    return None if slot is None else TierValue(RECURRENT_SNAPSHOTS, slot)


# Its row of the support matrix (informational: the engine config sizes its budget, and recurrent engines have no
# sliding-window group); the speculation table says which methods run on a recurrent base.
RECURRENT_SUPPORT = CacheSupport(
    "recurrent checkpoints", "context_cache_recurrent_snapshot_pool_bytes",
    (Deployment.HYBRID, Deployment.PURE_RECURRENT), ALL_METHODS, window_group=True, tier=Tier.SAVED,
    reuse_off=ReuseOff.UNUSED, on=lambda config, build: False, note="every publication is an exact checkpoint")


def build_recurrent_checkpoints(setup: CacheSetup, name: str) -> RecurrentCheckpoints | None:
    """Hybrid and pure recurrent deployments reuse only exact checkpoints, each with a recurrent snapshot."""
    slots = int(setup.options.get("recurrent_snapshot_slots", 0))
    if not setup.checkpoints:
        return None
    # The engine checks budgets against the slot sizes first (its message names bytes); this guards the core.
    if setup.enabled and slots < 1:
        raise InvalidConfig(f"a {setup.deployment.value} deployment reuses only exact checkpoints and needs at least "
                            "one recurrent snapshot slot", "context_cache_recurrent_snapshot_pool_bytes")
    return RecurrentCheckpoints(ResourcePool(name, slots if setup.enabled else 0), setup.records,
                                setup.tokens_per_page, setup.chain_root, with_pages=setup.paged,
                                copier=setup.copier(name))


class RecurrentCheckpoints(SnapshotRestore):
    """Recurrent snapshots (every recurrent layer's state + conv state), one per checkpoint record. A checkpoint of
    length L is filed under its anchor, the key of its last full page (None below one page), so a lookup walks the
    input's own chain keys from the deepest and hashes a tail only where a checkpoint of that length hangs off a
    page the input shares. `with_pages`: the deployment also keeps attention K/V (hybrid), so a checkpoint brings
    its full pages and must agree with the page index on them."""

    __slots__ = ("name", "pool", "records", "tokens_per_page", "chain_root", "with_pages", "copier", "_lengths")

    def __init__(self, pool: ResourcePool, records: RecordStore, tokens_per_page: int, chain_root: bytes, *,
                 with_pages: bool, copier: CheckpointCopier | None) -> None:
        self.name = pool.name
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
                if record is None or not record.exact or record.token_ids != tuple(tokens[:length].tolist()):
                    continue
                if lookup.page_hits is not None and tuple(lookup.page_hits[:depth]) != record.page_ids:
                    continue  # the pages this checkpoint holds are not the ones the index serves for this input
                plan = plan_resume(len(tokens), T, paged=self.with_pages, length=length, hit_pages=record.page_ids,
                                   record_id=record.record_id)
                return plan.with_part(self.name, CheckpointHit(record.parts[self.name], record.record_id))
        return plan_resume(len(tokens), T, paged=self.with_pages)

    # --- a lease's restore --------------------------------------------------------------------------

    def restore(self, lease: Lease) -> None:
        """The checkpoint's state into the sequence's state row (allocated zeroed before: a cold start keeps it)."""
        slot = restore_recurrent_slot(lease)
        if slot is not None:
            assert self.copier is not None, "a checkpoint hit without a recurrent snapshot store"
            self.copier.restore_recurrent(slot, lease)

    def finish_restore(self, lease: Lease) -> bool:
        hit = lease.parts.pop(self.name, None)
        if hit is None:
            return False
        self.pool.unpin([hit.slot])
        return True

    def release(self, lease: Lease) -> None:
        self.finish_restore(lease)  # admitted but never run: the snapshot was not copied

    # --- publication --------------------------------------------------------------------------------

    def publication_slots(self, publication: Publication) -> int:
        return int(publication.exact)  # every publication here is a checkpoint

    def capture(self, lease: Lease, publication: Publication) -> bool:
        slots = publication.reserved.get(self.name)
        if not slots:
            return False
        assert self.copier is not None, "a checkpoint deployment with reuse is built with a copier"
        self.copier.capture_recurrent(lease, slots[0])
        return True

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

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        for record in records:
            assert len(record.token_ids) in self.lengths_after(record.parent_key)
