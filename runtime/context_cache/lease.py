"""What a sequence asks the cache for (an Admission) and what it holds while it runs (a Lease)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.planner import PlanKind
from kvforge.runtime.types import LookupPolicy


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
    # An EAGLE3 request: it also needs draft KV pages, and reuses only records with a coherent draft path.
    speculative: bool = False


@dataclass(slots=True, eq=False)
class Lease:
    """One sequence's hold on the pool. Token layout of its page-table row (T tokens per page):

        |<-- reuse_tokens: hit pages (shared, pinned) -->|<-- computed here: private pages ---------->|
        | page 0 | page 1 | ...                | page h-1 | page h | ... | partial tail (never shared) |
        |<-- indexed_pages: findable by other sequences (hits + full pages indexed in flight) -->|

    A snapshot hit moves the reuse point into page h: its first `restore_tokens` tokens are copied from
    snapshot `restore_slot` (pinned until `finish_restore`) into the private page h, and computing
    starts right after them (copy-on-partial-reuse: the snapshot itself is never written).

    On a hybrid or pure recurrent deployment a hit is an exact checkpoint (layout in the module docstring):
    `restore_recurrent_slot` is copied into the sequence's recurrent + conv state as well (both pinned until
    `finish_restore`); None there means a cold start from a zero state. A pure recurrent lease holds no pages.

    `page_ids` grows with `try_grow`; `keys` are the chain keys of its full pages computed so far.

    A speculative (EAGLE3) lease also holds `draft_page_ids`, laid out like `page_ids` in the draft's own pool:

        | draft page 0 | ... | draft page h-1 (one record's path) | private draft pages ... |
        |<-- draft_computed_tokens: positions p whose draft K/V (fed token p+1) is coherent -->|

    Its hit is one page shorter than the pages that matched: the final matched page is recomputed in base and draft
    (the draft's K/V at a page's last position depends on the next page's first token).

    A speculative checkpoint hit (hybrid MTP, checkpoint of length L) restores the base exactly at L, but the draft's
    pages only below ((L - 1) // T) * T: the draft recomputes its last positions up to L - 1, whose K/V read the
    successor token L (this request's, not the publisher's), from the record's stored hidden states:

        | draft pages (shared) | draft_hidden: replayed first | new positions ... |
        0                      ((L-1)//T)*T                   L
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
    restore_slot: int | None = None  # partial-KV snapshot to copy into page_ids[reuse_tokens // T]
    restore_tokens: int = 0
    restore_recurrent_slot: int | None = None  # recurrent snapshot to copy into the sequence's state
    # EAGLE3 (speculative admissions): the draft's own pages, one per base page (hits first: one record's coherent
    # path), and how many positions hold draft K/V coherent with the sequence (the drafter advances it).
    draft_page_ids: list[int] | None = None
    draft_computed_tokens: int = 0
    # Hybrid MTP: the base's hidden states at positions [draft_hidden_start, draft_hidden_start + len) kept by the
    # drafter (at most a page, up to draft_computed_tokens), so a checkpoint can store its draft tail; after a
    # checkpoint restore, the record's tail, which the drafter replays before anything else.
    draft_hidden: np.ndarray | None = None
    draft_hidden_start: int = 0
