"""The cache coordinator's two interfaces: one per resource type (`CacheType`), one for listeners (`CacheEvents`).

A resource type owns one pool and whatever finds its hits (the page index, the snapshot tails, the checkpoint
lengths); the coordinator (`ContextCacheManager`) owns the records, the leases and the eviction plan, and asks each
type present in its deployment the same questions. Adding a type (draft pages, say) is one more class here, not
one more flag in the manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.planner import ReusePlan
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.records import DraftTail, Record


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
    speculative: bool = False  # an EAGLE3 admission: hits need a coherent draft path


@dataclass(slots=True)
class Publication:
    """A record being built: the endpoint `publish` chose, then what each type commits for it."""

    tokens: np.ndarray  # the tokens the lease has computed: the endpoint
    keys: list[bytes]  # chain keys of the full pages the record keeps
    tail_key: bytes  # the exact endpoint's key when it ends inside a page; b"" = it ends on the last full page
    exact: bool  # a checkpoint: all or nothing (never falls back to the full pages alone)
    partial: bool  # it keeps a partial-KV snapshot of its tail page
    recurrent: bool  # it keeps a recurrent snapshot
    page_ids: list[int] = field(default_factory=list)  # canonical pages, one per key (attention)
    draft_page_ids: list[int] = field(default_factory=list)  # the lease's draft path over the first pages (EAGLE3)
    draft_tail: DraftTail | None = None  # a hybrid MTP checkpoint's base hidden states past its shared draft pages
    partial_slot: int | None = None
    recurrent_slot: int | None = None

    @property
    def terminal_key(self) -> bytes:
        return self.tail_key or self.keys[-1]

    def full_pages_only(self, num_pages: int | None = None) -> Publication:
        """The same publication without its tail (no snapshot slot), or cut to its first `num_pages` (a collision)."""
        keys = self.keys if num_pages is None else self.keys[:num_pages]
        return Publication(self.tokens, keys, b"", self.exact, False, self.recurrent)


class CacheType(Protocol):
    """One resource type behind the coordinator. Lookups are pure; the coordinator applies what they find."""

    pool: ResourcePool

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """`agreed` (what the types before this one found) narrowed or extended to the longest reuse this type can
        serve too. No side effects."""
        ...

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        """The slots of this pool an admission planned as `plan` reuses: pinned from admission until restored."""
        ...

    def publication_slots(self, publication: Publication) -> int:
        """New slots of this pool committing `publication` takes (reserved before anything is copied)."""
        ...

    def held(self, record: Record) -> tuple[int, ...]:
        """What a record holds of this type: one cache reference on each of these slots."""
        ...

    def on_commit(self, record: Record) -> None:
        """The record was committed: file it where this type's lookup finds it."""
        ...

    def on_evict(self, record: Record) -> None:
        """The record was evicted (its cache references already dropped): forget it."""
        ...


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
