"""The cache coordinator's two interfaces: one per resource type (`CacheType`), one for listeners (`CacheEvents`).

A resource type owns one pool, its part of every lease, record, plan and publication, and whatever finds its hits
(the page index, the snapshot tails, the checkpoint lengths, another pool's page paths); the coordinator
(`ContextCacheManager`) owns the records, the leases and the eviction plan, and asks each type present in its
deployment the same questions, in registration order (registry.py). Adding a type is one module with one class
here-shaped (`CacheTypeBase` gives every hook a do-nothing default) and one registration, not one more flag in the
coordinator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from kvforge.runtime.context_cache.capture import Copiers
from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.lease import Admission, Inputs, Lease, Prerequisite
from kvforge.runtime.context_cache.metrics import CacheMetrics
from kvforge.runtime.context_cache.planner import ReusePlan
from kvforge.runtime.context_cache.pools import Demand, ResourcePool
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.types import Deployment

_NOTHING_IN_FLIGHT: Mapping[bytes, Lease] = MappingProxyType({})
_NO_COUNTERS: Mapping[str, int] = MappingProxyType({})
_NO_TABLES: Mapping[str, list[int]] = MappingProxyType({})


class PublishResult(str, Enum):
    """What `publish` did. str-valued, so a result still compares equal to its old string."""

    COMMITTED = "committed"  # a new record
    EXISTING = "existing"  # the same endpoint was already cached: touched
    SKIPPED = "skipped"  # not allowed, nothing to keep, or no slot for a checkpoint


@dataclass(slots=True)
class Lookup:
    """One admission's input as every type's lookup reads it."""

    tokens: np.ndarray
    keys: list[bytes]  # the chain keys of its full pages
    extras: KeyExtras
    # The index's matching pages before any plan rule cut them, found once by the attention type so a type that
    # must agree with the pages (a hybrid's checkpoints) compares with the same list. None: no attention type.
    page_hits: list[int] | None = None
    inputs: Inputs = field(default_factory=dict)  # the admission's per-type inputs (lease.py `Inputs`)


@dataclass(slots=True)
class Publication:
    """A record being built: the endpoint `publish` chose, the slots reserved for it, then what each type keeps."""

    tokens: np.ndarray  # the tokens the lease has computed: the endpoint
    keys: list[bytes]  # chain keys of the full pages the record keeps
    tail_key: bytes  # the exact endpoint's key when it ends inside a page; b"" = it ends on the last full page
    exact: bool  # a checkpoint: all or nothing (never falls back to the full pages alone)
    page_ids: list[int] = field(default_factory=list)  # canonical pages, one per key (attention)
    reserved: dict[str, list[int]] = field(default_factory=dict)  # pool name -> new slots reserved (pinned) for it
    parts: dict[str, Any] = field(default_factory=dict)  # cache type name -> what that type keeps of it

    @property
    def terminal_key(self) -> bytes:
        return self.tail_key or self.keys[-1]

    def full_pages_only(self, num_pages: int | None = None) -> Publication:
        """The same publication without its tail (nothing reserved), or cut to its first `num_pages` (a collision)."""
        keys = self.keys if num_pages is None else self.keys[:num_pages]
        return Publication(self.tokens, keys, b"", self.exact)


@dataclass(frozen=True, slots=True)
class CacheSetup:
    """What a type's factory may read: the deployment, the coordinator's shared state and the options it was given."""

    enabled: bool
    deployment: Deployment
    num_pages: int  # the base KV pool's size (the engine's build)
    tokens_per_page: int
    chain_root: bytes
    copiers: Copiers  # cache type name -> what moves its bytes (each type's module names the protocol)
    records: RecordStore
    metrics: CacheMetrics
    options: Mapping[str, Any]  # the manager's keyword options, by name
    reserve: Callable[[Demand], bool]  # evict LRU records until `demand` is allocatable (False: pins forbid it)
    # A lease's tables of the page groups beside the global one, from the types that own them (the coordinator's
    # `page_tables`): what a type that copies K/V into every group reads them through.
    page_tables: Callable[[Lease], Mapping[str, list[int]]] = lambda lease: _NO_TABLES

    def copier(self, name: str) -> Any:
        """Type `name`'s copier, or None (bookkeeping only: the cache's own tests)."""
        return self.copiers.get(name)

    @property
    def checkpoints(self) -> bool:
        """Reuse is by exact checkpoint only (hybrid, pure recurrent)."""
        return self.deployment is not Deployment.VANILLA

    @property
    def paged(self) -> bool:
        """Sequences keep K/V in pages (not on a pure recurrent engine)."""
        return self.deployment is not Deployment.PURE_RECURRENT


class CacheType(Protocol):
    """One resource type behind the coordinator. Lookups are pure; the coordinator applies what they find, and every
    other hook touches only this type's pool and its own part (`holder.parts[self.name]`) of a lease or record."""

    name: str  # its part's key everywhere, and its pool's name
    pool: ResourcePool
    keeps_tail: bool  # a publication that ends inside a page may keep that page's tail through this type
    part_drops_alone: bool  # a record stays valid without this type's part: pressure on its pool takes the part alone

    def keeps_tail_of(self, lease: Lease) -> bool:
        """Whether this lease's publication that ends inside a page must keep that tail even where `keeps_tail` is
        False: a document shorter than a page has no full page, and its stored form is that tail (issue 53)."""
        ...

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` could hold what it needs of this pool if nothing else held any."""
        ...

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """`agreed` (what the types before this one found) narrowed or extended to the longest reuse this type can
        serve too. No side effects."""
        ...

    def waits_for(self, lookup: Lookup) -> bool:
        """Whether a running sequence is computing what this input would compute next (it should wait for it)."""
        ...

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        """The slots of this pool an admission planned as `plan` reuses: pinned from admission until restored."""
        ...

    def admission_slots(self, plan: ReusePlan, inputs: Inputs) -> int:
        """New slots of this pool admitting `plan` takes (allocated after any eviction they need); `inputs`: the
        admission's per-type inputs (this type reads its own entry)."""
        ...

    def admit(self, lease: Lease, plan: ReusePlan, inputs: Inputs, slots: list[int]) -> None:
        """Give the new lease its part: the plan's hits of this pool and the `slots` allocated for it."""
        ...

    def prerequisites(self, admission: Admission) -> Sequence[Prerequisite]:
        """Requests to compute before `admission` (queued by the scheduler ahead of it), e.g. a document's
        standalone prefill when it has no stored form yet. No side effects."""
        ...

    def restored_spans(self, lease: Lease) -> Sequence[tuple[int, int]]:
        """Prompt ranges [start, end) this type restored into the lease's pages at admission, past its reuse point
        (a document's K/V): the scheduler moves the sequence's computing past them. No side effects."""
        ...

    def repair_pass(self, lease: Lease, computed: int) -> tuple[int, int]:
        """A second pass over the prompt (issue 53: documents' `attention` repair), asked before each chunk of the
        lease is scheduled, `computed` tokens in: (where computing resumes: `computed`, or earlier once the pass
        ended and chose more to recompute; where the next chunk must end, 0 for anywhere)."""
        ...

    def on_admitted(self, lease: Lease, admission: Admission, num_tokens: int) -> None:
        """The lease of an input of `num_tokens` tokens was admitted (keys known): e.g. announce pages in flight."""
        ...

    def growth_slots(self, lease: Lease, num_tokens: int) -> int:
        """New slots of this pool the lease needs to cover positions [0, num_tokens)."""
        ...

    def grow(self, lease: Lease, slots: list[int]) -> None:
        """Add `slots` (allocated after `growth_slots` asked for them) to the lease's part."""
        ...

    def on_grown(self, lease: Lease) -> None:
        """Some type gave the lease new slots (`grow`), before the call that reads them: e.g. copy restored rows
        into pages a page group allocates only as the row reaches them (a document's window rows, issue 53)."""
        ...

    def index_computed(self, lease: Lease, tokens: np.ndarray, upto: int) -> None:
        """The lease computed its full pages [indexed_pages, upto) (keys known): make them findable in flight."""
        ...

    def in_flight_pages(self) -> Mapping[bytes, Lease]:
        """What running sequences are computing, by key (audits, tests)."""
        ...

    def restore(self, lease: Lease) -> None:
        """Copy the lease's hit of this type in through this type's copier (a snapshot into its first private page,
        a checkpoint into its state), once the sequence holds what it is copied into."""
        ...

    def finish_restore(self, lease: Lease) -> bool:
        """The lease's snapshot of this type was copied in: unpin it. True when there was one."""
        ...

    def release(self, lease: Lease) -> None:
        """The lease ends: unpin everything it holds of this pool."""
        ...

    def pinned(self, lease: Lease) -> tuple[int, ...]:
        """The slots of this pool the lease pins (one active reference each): the audit's question."""
        ...

    def publication_slots(self, publication: Publication) -> int:
        """New slots of this pool committing `publication` takes (reserved before anything is copied)."""
        ...

    def project(self, lease: Lease, publication: Publication) -> None:
        """Decide what the record keeps of this type (attention: its canonical pages, which may be fewer than its
        keys after a hash collision)."""
        ...

    def capture(self, lease: Lease, publication: Publication) -> bool:
        """Copy the lease's state into this type's reserved slots. True when it copied something."""
        ...

    def record_part(self, publication: Publication) -> Any:
        """This type's part of the record committing `publication` (None: none)."""
        ...

    def upgrade(self, existing: Record, lease: Lease) -> Record | None:
        """A publication found its endpoint cached already: the record with a better part of this type from the
        lease, or None to keep it as it is."""
        ...

    def held(self, record: Record) -> tuple[int, ...]:
        """What a record holds of this type: one cache reference on each of these slots. The only answer to it."""
        ...

    def on_commit(self, record: Record) -> None:
        """The record was committed: file it where this type's lookup finds it."""
        ...

    def on_evict(self, record: Record) -> None:
        """The record was evicted (its cache references already dropped): forget it."""
        ...

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        """Assert what this type alone knows about the records and leases (check_invariants calls it)."""
        ...

    def page_tables(self, lease: Lease) -> Mapping[str, list[int]]:
        """The lease's tables of the page groups this type owns, by group (contract/paging.py PageGroup): what the
        executor binds beside the global table. Empty: it owns none."""
        ...

    def counters(self) -> Mapping[str, int]:
        """This type's counters, cumulative: the profile's block its registration names (`CounterBlock`)."""
        ...


class CacheTypeBase:
    """Every `CacheType` hook with a do-nothing answer: a type overrides the ones it needs."""

    __slots__ = ()
    name: str
    pool: ResourcePool
    keeps_tail = False
    part_drops_alone = False

    def keeps_tail_of(self, lease: Lease) -> bool:
        return False

    def fits_alone(self, num_tokens: int) -> bool:
        return True

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        return agreed

    def waits_for(self, lookup: Lookup) -> bool:
        return False

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        return ()

    def admission_slots(self, plan: ReusePlan, inputs: Inputs) -> int:
        return 0

    def admit(self, lease: Lease, plan: ReusePlan, inputs: Inputs, slots: list[int]) -> None:
        pass

    def prerequisites(self, admission: Admission) -> Sequence[Prerequisite]:
        return ()

    def restored_spans(self, lease: Lease) -> Sequence[tuple[int, int]]:
        return ()

    def repair_pass(self, lease: Lease, computed: int) -> tuple[int, int]:
        return computed, 0

    def on_admitted(self, lease: Lease, admission: Admission, num_tokens: int) -> None:
        pass

    def growth_slots(self, lease: Lease, num_tokens: int) -> int:
        return 0

    def grow(self, lease: Lease, slots: list[int]) -> None:
        pass

    def on_grown(self, lease: Lease) -> None:
        pass

    def index_computed(self, lease: Lease, tokens: np.ndarray, upto: int) -> None:
        pass

    def in_flight_pages(self) -> Mapping[bytes, Lease]:
        return _NOTHING_IN_FLIGHT

    def restore(self, lease: Lease) -> None:
        pass

    def finish_restore(self, lease: Lease) -> bool:
        return False

    def release(self, lease: Lease) -> None:
        pass

    def pinned(self, lease: Lease) -> tuple[int, ...]:
        return ()

    def publication_slots(self, publication: Publication) -> int:
        return 0

    def project(self, lease: Lease, publication: Publication) -> None:
        pass

    def capture(self, lease: Lease, publication: Publication) -> bool:
        return False

    def record_part(self, publication: Publication) -> Any:
        return publication.parts.get(self.name)

    def upgrade(self, existing: Record, lease: Lease) -> Record | None:
        return None

    def held(self, record: Record) -> tuple[int, ...]:
        return ()

    def on_commit(self, record: Record) -> None:
        pass

    def on_evict(self, record: Record) -> None:
        pass

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        pass

    def page_tables(self, lease: Lease) -> Mapping[str, list[int]]:
        return _NO_TABLES

    def counters(self) -> Mapping[str, int]:
        return _NO_COUNTERS


class CacheEvents(Protocol):
    """What an external tier (a shared store below the in-process pool) listens to: the one lookup point, the one
    commit tail and the one eviction point of the coordinator each call one method, once per event."""

    def looked_up(self, keys: Sequence[bytes], hit_pages: int) -> None:
        """An admission looked its chain `keys` up and reuses its first `hit_pages` full pages (fewer than
        len(keys) means the rest missed: the keys a remote tier could be asked for)."""
        ...

    def committed(self, record: Record) -> None:
        """A new record was committed (a tier may save it)."""
        ...

    def evicted(self, record: Record) -> None:
        """A record was evicted (a write-back tier may save it now)."""
        ...


class NoEvents:
    """The default listener: nothing outside the process hears about the cache."""

    __slots__ = ()

    def looked_up(self, keys: Sequence[bytes], hit_pages: int) -> None:
        pass

    def committed(self, record: Record) -> None:
        pass

    def evicted(self, record: Record) -> None:
        pass


class SnapshotRestore(CacheTypeBase):
    """The hooks of a snapshot type: a hit's part names one slot (`.slot`, None once restored), copied into the lease
    at admission and pinned until `finish_restore`; a record's part is the one slot reserved for it. Partial tails
    and recurrent checkpoints share them."""

    __slots__ = ()

    def record_part(self, publication: Publication) -> int | None:
        slots = publication.reserved.get(self.name)
        return slots[0] if slots else None

    def held(self, record: Record) -> tuple[int, ...]:
        slot = record.parts.get(self.name)
        return () if slot is None else (slot,)

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        hit = plan.parts.get(self.name)
        return () if hit is None else (hit.slot,)

    def admit(self, lease: Lease, plan: ReusePlan, inputs: Inputs, slots: list[int]) -> None:
        hit = plan.parts.get(self.name)
        if hit is not None:
            lease.parts[self.name] = hit

    def pinned(self, lease: Lease) -> tuple[int, ...]:
        hit = lease.parts.get(self.name)
        return () if hit is None or hit.slot is None else (hit.slot,)
