"""Reuse planning for attention-only models: pure functions from a lookup result to a page-aligned plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.contract.paging import pages_for
from kvforge.contract.profile_schema import (
    PLAN_FULL_INPUT_REWIND,
    PLAN_NO_REUSABLE_PREFIX,
    PLAN_STANDARD,
)

PLAN_BYPASS = "bypass"  # not a profile key: bypassed admissions are counted as lookup_bypass_sequences


@dataclass(frozen=True, slots=True)
class ReusePlan:
    kind: str
    matched_tokens: int  # tokens covered by matching pages in the index
    reuse_tokens: int  # where execution starts (kvcache_start_index)
    hit_pages: tuple[int, ...]  # canonical pages bound to the first reuse_tokens / tokens_per_page slots
    new_pages: int  # private pages to allocate for the rest of the input


def plan_reuse(num_tokens: int, tokens_per_page: int, matched_pages: Sequence[int]) -> ReusePlan:
    """Longest page-aligned prefix; an input matched to its last token rewinds one page so that at
    least one token runs through the engine and produces logits."""
    total_pages = pages_for(num_tokens, tokens_per_page)
    matched = len(matched_pages)
    hits = tuple(matched_pages)
    if not hits:
        kind = PLAN_NO_REUSABLE_PREFIX
    elif matched * tokens_per_page >= num_tokens:
        kind, hits = PLAN_FULL_INPUT_REWIND, hits[:-1]
    else:
        kind = PLAN_STANDARD
    reuse = len(hits) * tokens_per_page
    return ReusePlan(kind, matched * tokens_per_page, reuse, hits, total_pages - len(hits))


def plan_cold(num_tokens: int, tokens_per_page: int) -> ReusePlan:
    """No lookup (bypass policy, warmup, or a forced-cold retry): every page private."""
    return ReusePlan(PLAN_BYPASS, 0, 0, (), pages_for(num_tokens, tokens_per_page))
