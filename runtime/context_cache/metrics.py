"""Context-cache counters, cumulative over the process (warmup included), keyed as the profile JSON expects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvforge.runtime.context_cache.planner import PLAN_KINDS
from kvforge.runtime.context_cache.pools import POOL_NAMES


@dataclass(slots=True)
class CacheMetrics:
    admitted_sequences: int = 0
    hit_sequences: int = 0
    media_aware_sequences: int = 0
    lookup_bypass_sequences: int = 0
    forced_cold_sequences: int = 0
    matched_tokens: int = 0
    reused_tokens: int = 0
    plans: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PLAN_KINDS, 0))
    publication_attempts: int = 0
    publications_committed: int = 0
    publications_existing: int = 0
    planning_nanoseconds: int = 0
    records_evicted: int = 0
    reclaimed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(POOL_NAMES, 0))

    def to_dict(self, records_current: int, resource_pools: dict[str, dict[str, int]]) -> dict[str, Any]:
        return {
            "admitted_sequences": self.admitted_sequences,
            "hit_sequences": self.hit_sequences,
            "media_aware_sequences": self.media_aware_sequences,
            "lookup_bypass_sequences": self.lookup_bypass_sequences,
            "forced_cold_sequences": self.forced_cold_sequences,
            "matched_tokens": self.matched_tokens,
            "reused_tokens": self.reused_tokens,
            "plans": dict(self.plans),
            "publications": {
                "attempts": self.publication_attempts,
                "committed": self.publications_committed,
                "existing": self.publications_existing,
                "successful_endpoints": self.publications_committed + self.publications_existing,
            },
            "hybrid": {"restores": 0, "snapshot_pressure_skips": 0, "capture_synchronizations": 0},
            "speculative": {"full_page_replays": 0, "pair_publications": 0},
            "planning_nanoseconds": self.planning_nanoseconds,
            "records": {"current": records_current, "evicted": self.records_evicted},
            "resource_pools": resource_pools,
            "reclaimed_resources": dict(self.reclaimed),
        }
