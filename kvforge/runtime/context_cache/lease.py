"""What a sequence asks the cache for (an Admission) and what it holds while it runs (a Lease)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.planner import PlanKind
from kvforge.runtime.types import LookupPolicy

# A request's input to the cache types, one entry per type that reads one (keyed by the type's name; each type's
# module defines what its entry is and the helper that reads it): speculative decoding with a draft pool, document
# spans, a document's standalone prefill, a new type's own input. A type without an entry reads its default.
Inputs = Mapping[str, Any]
NO_INPUTS: Inputs = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Prerequisite:
    """A request a type needs computed before an admission can use what it produces (a document's stored form): the
    admission's tokens [start, start + length) alone, from position 0, admitted with `inputs`. `key` names what it
    produces: the scheduler queues one request per key."""

    key: bytes
    start: int
    length: int
    inputs: Inputs = field(default_factory=dict)


@dataclass(slots=True)
class Admission:
    """What a sequence asks the pool for: K/V for every token in `token_ids`.

    `indexable_tokens` caps what may become findable while it runs (the prompt; generated tokens are
    published only when the sequence finishes normally). `keys` caches the chain keys between retries.
    """

    token_ids: list[int]
    extras: KeyExtras = field(default_factory=KeyExtras)
    lookup_policy: LookupPolicy = LookupPolicy.USE_CACHE
    indexable_tokens: int | None = None  # None = all of token_ids
    keys: list[bytes] | None = None
    inputs: Inputs = field(default_factory=dict)  # cache type name -> that type's input (see `Inputs`)


@dataclass(slots=True, eq=False)
class Lease:
    """One sequence's hold on the pool. Token layout of its page-table row (T tokens per page):

        |<-- reuse_tokens: hit pages (shared, pinned) -->|<-- computed here: private pages ---------->|
        | page 0 | page 1 | ...                | page h-1 | page h | ... | partial tail (never shared) |
        |<-- indexed_pages: findable by other sequences (hits + full pages indexed in flight) -->|

    A snapshot hit moves the reuse point into page h: its first tokens are copied from a snapshot (pinned until
    `finish_restore`) into the private page h, and computing starts right after them (copy-on-partial-reuse: the
    snapshot itself is never written). On a hybrid or pure recurrent deployment a hit is an exact checkpoint whose
    recurrent state is copied into the sequence's state as well. A pure recurrent lease holds no pages.

    `page_ids` grows with `try_grow`; `keys` are the chain keys of its full pages computed so far. Whatever else a
    type holds for the sequence (a snapshot to restore, another pool's pages) is its part in `parts`; the layout of
    each is in its type's module.
    """

    extras: KeyExtras
    page_ids: list[int]
    reuse_tokens: int
    matched_tokens: int
    plan_kind: PlanKind
    may_publish: bool
    forced_cold: bool = False
    keys: list[bytes] = field(default_factory=list)
    indexed_pages: int = 0
    indexable_pages: int = 0
    inflight_keys: list[bytes] = field(default_factory=list)  # keys this lease registered as being computed
    released: bool = False
    # Positions from here on may hold approximate K/V (a restored document, issue 37): nothing from there is
    # indexed in flight or published under exact prefix keys.
    exact_tokens: int = 1 << 62
    parts: dict[str, Any] = field(default_factory=dict)  # cache type name -> what that type holds for the sequence
