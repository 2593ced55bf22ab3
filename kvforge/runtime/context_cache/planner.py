"""Reuse planning: pure functions from a lookup result to a plan.

Attention-only plans are page-aligned, except that a partial-KV snapshot of a record's tail page can extend the
reuse to the exact token right after the last reused full page (copy-on-partial-reuse into the lease's own page).
Hybrid and pure recurrent plans resume from an exact checkpoint (`plan_resume`) or start cold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import Any

from kvforge.contract.paging import pages_for
from kvforge.contract.profile_schema import (
    PLAN_FULL_INPUT_REWIND,
    PLAN_NO_REUSABLE_PREFIX,
    PLAN_STANDARD,
)
from kvforge.runtime.context_cache.keys import MediaKey
from kvforge.runtime.context_cache.parts import NO_PARTS


class PlanKind(str, Enum):
    """How an admission was planned. The values are the profile's `plans` keys, so the JSON stays the same."""

    STANDARD = PLAN_STANDARD
    NO_REUSABLE_PREFIX = PLAN_NO_REUSABLE_PREFIX
    FULL_INPUT_REWIND = PLAN_FULL_INPUT_REWIND
    BYPASS = "bypass"  # not a profile key: bypassed admissions are counted as lookup_bypass_sequences


PLAN_BYPASS = PlanKind.BYPASS


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """An admission's plan: what every type agreed it reuses. What a type adds beyond the pages (a snapshot to
    restore, another pool's pages) is its part in `parts`."""

    kind: PlanKind
    matched_tokens: int  # tokens covered by matching pages in the index
    reuse_tokens: int  # where execution starts (kvcache_start_index)
    hit_pages: tuple[int, ...]  # canonical pages bound to the first reuse_tokens // tokens_per_page slots
    new_pages: int  # private pages to allocate for the rest of the input
    resumes: int | None = None  # the record a snapshot or checkpoint hit resumes from (touched on admission)
    replayed_page: bool = False  # a hit that recomputes its final matched page (counted)
    parts: Mapping[str, Any] = field(default_factory=lambda: NO_PARTS, compare=False)  # type name -> what it adds

    def with_part(self, name: str, part: Any, **changes: Any) -> ReusePlan:
        """This plan with type `name`'s part set (and `changes` to the shared fields)."""
        return replace(self, parts=MappingProxyType({**self.parts, name: part}), **changes)

    def without_parts(self) -> ReusePlan:
        return replace(self, parts=NO_PARTS)


def plan_reuse(num_tokens: int, tokens_per_page: int, matched_pages: Sequence[int],
               media: Sequence[MediaKey] = ()) -> ReusePlan:
    """Longest page-aligned prefix; an input matched to its last token rewinds one page so that at
    least one token runs through the engine and produces logits. A reuse point inside a media span moves
    back to a page boundary at or before the span's start: the whole span is recomputed."""
    total_pages = pages_for(num_tokens, tokens_per_page)
    matched = len(matched_pages)
    hits = tuple(matched_pages)
    if not hits:
        kind = PlanKind.NO_REUSABLE_PREFIX
    elif matched * tokens_per_page >= num_tokens:
        kind, hits = PlanKind.FULL_INPUT_REWIND, hits[:-1]
    else:
        kind = PlanKind.STANDARD
    hits = hits[:media_safe_pages(len(hits), tokens_per_page, media)]
    reuse = len(hits) * tokens_per_page
    return ReusePlan(kind, matched * tokens_per_page, reuse, hits, total_pages - len(hits))


def media_safe_pages(num_pages: int, tokens_per_page: int, media: Sequence[MediaKey]) -> int:
    """The most reusable pages, at most `num_pages`, whose end does not fall strictly inside a media span."""
    for item in sorted(media, key=lambda m: -m.start):  # later spans first: moving back may enter earlier ones
        if item.start < num_pages * tokens_per_page < item.start + item.length:
            num_pages = item.start // tokens_per_page
    return num_pages


def plan_cold(num_tokens: int, tokens_per_page: int, *, paged: bool = True) -> ReusePlan:
    """No lookup (bypass policy, warmup, or a forced-cold retry): every page private (none without KV pages)."""
    return ReusePlan(PlanKind.BYPASS, 0, 0, (), pages_for(num_tokens, tokens_per_page) if paged else 0)


def plan_resume(num_tokens: int, tokens_per_page: int, *, paged: bool, length: int = 0,
                hit_pages: Sequence[int] = (), record_id: int | None = None) -> ReusePlan:
    """Resume from the exact checkpoint `record_id` of `length` tokens (its full pages as hits; the types that keep
    more of it add their parts), or, without one, start cold (the engine zeroes any state)."""
    total_pages = pages_for(num_tokens, tokens_per_page) if paged else 0
    if record_id is None:
        return ReusePlan(PlanKind.NO_REUSABLE_PREFIX, 0, 0, (), total_pages)
    return ReusePlan(PlanKind.STANDARD, length, length, tuple(hit_pages), total_pages - len(hit_pages),
                     resumes=record_id)
