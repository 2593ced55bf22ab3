"""Context-cache counters, cumulative over the process (warmup included), for the profile's context_cache block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvforge.contract import profile_schema as schema
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.planner import ReusePlan


@dataclass(slots=True)
class CacheMetrics:
    admitted_sequences: int = 0
    hit_sequences: int = 0
    media_aware_sequences: int = 0
    lookup_bypass_sequences: int = 0
    forced_cold_sequences: int = 0
    matched_tokens: int = 0
    reused_tokens: int = 0
    plans: dict[str, int] = field(default_factory=lambda: dict.fromkeys(schema.PLAN_KINDS, 0))
    publication_attempts: int = 0
    publications_committed: int = 0
    publications_existing: int = 0
    planning_nanoseconds: int = 0
    restores: int = 0  # partial-KV snapshots copied into a request's page
    snapshot_pressure_skips: int = 0  # captures skipped: no snapshot slot could be freed
    capture_synchronizations: int = 0  # captures, each a copy that waits for the engine call that wrote the page
    boundary_captures: int = 0  # checkpoints captured mid-sequence (chat-message boundary, interval): benchmarks only
    endpoint_captures: int = 0  # checkpoints captured at a prefill or decode end: benchmarks only
    records_evicted: int = 0
    full_page_replays: int = 0  # speculative hits that recomputed their final matched page in base and draft
    pair_publications: int = 0  # records committed or upgraded with a draft path beside their base pages
    window_hits: int = 0  # admissions that took a record's sliding-window pages
    window_skips: int = 0  # records published without a window (the lease no longer held it all)
    reclaimed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(schema.POOL_KEYS, 0))
    documents: dict[str, int] = field(default_factory=lambda: dict.fromkeys(schema.DOCUMENT_KEYS, 0))  # issue 37
    adapter_corrections: dict[str, int] = field(  # issue 39
        default_factory=lambda: dict.fromkeys(schema.CORRECTION_KEYS, 0))

    def count_admission(self, plan: ReusePlan, lease: Lease, lookup: bool) -> None:
        """An admitted sequence, planned as `plan` (`lookup`: it looked the cache up)."""
        self.admitted_sequences += 1
        if lease.extras.media:
            self.media_aware_sequences += 1
        if not lookup or lease.forced_cold:
            self.lookup_bypass_sequences += 1
        if lease.forced_cold:
            self.forced_cold_sequences += 1
        if lookup:
            self.plans[plan.kind] += 1
            self.matched_tokens += plan.matched_tokens
        if plan.replayed_page and not lease.forced_cold:
            self.full_page_replays += 1
        if lease.reuse_tokens > 0:
            self.hit_sequences += 1
            self.reused_tokens += lease.reuse_tokens

    def to_dict(self, records_current: int, resource_pools: dict[str, dict[str, int]]) -> dict[str, Any]:
        """The context_cache block; the schema's pools missing from `resource_pools` are listed empty."""
        return {
            schema.ADMITTED_SEQUENCES: self.admitted_sequences,
            schema.HIT_SEQUENCES: self.hit_sequences,
            schema.MEDIA_AWARE_SEQUENCES: self.media_aware_sequences,
            schema.LOOKUP_BYPASS_SEQUENCES: self.lookup_bypass_sequences,
            schema.FORCED_COLD_SEQUENCES: self.forced_cold_sequences,
            schema.MATCHED_TOKENS: self.matched_tokens,
            schema.REUSED_TOKENS: self.reused_tokens,
            schema.PLANS: dict(self.plans),
            schema.PUBLICATIONS: {
                schema.PUBLICATION_ATTEMPTS: self.publication_attempts,
                schema.PUBLICATIONS_COMMITTED: self.publications_committed,
                schema.PUBLICATIONS_EXISTING: self.publications_existing,
                schema.SUCCESSFUL_ENDPOINTS: self.publications_committed + self.publications_existing,
            },
            schema.HYBRID: {
                schema.HYBRID_RESTORES: self.restores,
                schema.SNAPSHOT_PRESSURE_SKIPS: self.snapshot_pressure_skips,
                schema.CAPTURE_SYNCHRONIZATIONS: self.capture_synchronizations,
            },
            schema.SPECULATIVE: {schema.FULL_PAGE_REPLAYS: self.full_page_replays,
                                 schema.PAIR_PUBLICATIONS: self.pair_publications},
            schema.DOCUMENTS: dict(self.documents),
            schema.ADAPTER_CORRECTIONS: dict(self.adapter_corrections),
            schema.SLIDING_WINDOW: {schema.WINDOW_HITS: self.window_hits, schema.WINDOW_SKIPS: self.window_skips},
            schema.PLANNING_NANOSECONDS: self.planning_nanoseconds,
            schema.RECORDS: {schema.RECORDS_CURRENT: records_current, schema.RECORDS_EVICTED: self.records_evicted},
            # Schema order first (every pool TensorRT Edge-LLM lists, zeros for types this deployment lacks).
            schema.RESOURCE_POOLS: {**{name: dict(schema.EMPTY_POOL) for name in schema.POOL_KEYS}, **resource_pools},
            schema.RECLAIMED_RESOURCES: dict(self.reclaimed),
        }
