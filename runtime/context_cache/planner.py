"""Reuse planning for attention-only models: pure functions from a lookup result to a page-aligned plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvforge.contract.paging import pages_for
from kvforge.runtime.context_cache.pools import BASE_KV_PAGES

PLAN_STANDARD = "standard"
PLAN_NO_REUSABLE_PREFIX = "no_reusable_prefix"
PLAN_FULL_INPUT_REWIND = "full_input_rewind"
PLAN_BYPASS = "bypass"
PLAN_KINDS = (PLAN_STANDARD, PLAN_NO_REUSABLE_PREFIX, PLAN_FULL_INPUT_REWIND)


@dataclass(frozen=True, slots=True)
class ReusePlan:
    kind: str
    matched_tokens: int  # tokens covered by matching pages in the index
    reuse_tokens: int  # where execution starts (kvcache_start_index)
    hit_pages: tuple[int, ...]  # canonical pages bound to the first reuse_tokens / tokens_per_page slots
    demand: dict[str, int] = field(default_factory=dict)  # private slots to allocate


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
    return ReusePlan(kind, matched * tokens_per_page, reuse, hits, {BASE_KV_PAGES: total_pages - len(hits)})


def plan_cold(num_tokens: int, tokens_per_page: int) -> ReusePlan:
    """No lookup (bypass policy, warmup, or a forced-cold retry): every page private."""
    return ReusePlan(PLAN_BYPASS, 0, 0, (), {BASE_KV_PAGES: pages_for(num_tokens, tokens_per_page)})
