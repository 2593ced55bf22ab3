"""Context-cache counters, cumulative over the process (warmup included), for the profile's context_cache block.

The coordinator's counters are fields here; a cache type's own counters are its block (`CounterBlock`, declared at
its registration): the type counts into it, the profile lists it as `context_cache.<block>` (zeros where the
deployment has no such type) and /metrics exports the series its `samples` read, so a type's counters are read and
written in its own module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvforge.contract import profile_schema as schema
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.planner import ReusePlan


@dataclass(frozen=True, slots=True)
class Sample:
    """One Prometheus series a type exports from the profile (`name` without the server's `kvforge_` prefix)."""

    kind: Literal["counter", "gauge"]
    name: str
    help: str
    value: float


def no_samples(cache: Mapping[str, Any]) -> Iterable[Sample]:
    return ()


@dataclass(frozen=True, slots=True)
class CounterBlock:
    """A cache type's counters: the profile's `context_cache.<name>` block with these `keys` (in this order), and
    the /metrics series `samples` reads from a whole context_cache block (the type's, its pool's, ...)."""

    name: str
    keys: tuple[str, ...]
    samples: Callable[[Mapping[str, Any]], Iterable[Sample]] = no_samples

    def zeros(self) -> dict[str, int]:
        return dict.fromkeys(self.keys, 0)


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
    reclaimed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(schema.POOL_KEYS, 0))

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
        if lease.reuse_tokens > 0:
            self.hit_sequences += 1
            self.reused_tokens += lease.reuse_tokens

    def to_dict(self, records_current: int, resource_pools: dict[str, dict[str, int]],
                blocks: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
        """The context_cache block: the coordinator's counters, then each type's `blocks` by name; the schema's pools
        missing from `resource_pools` are listed empty."""
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
            **{name: dict(block) for name, block in blocks.items()},
            schema.PLANNING_NANOSECONDS: self.planning_nanoseconds,
            schema.RECORDS: {schema.RECORDS_CURRENT: records_current, schema.RECORDS_EVICTED: self.records_evicted},
            # Schema order first (every pool TensorRT Edge-LLM lists, zeros for types this deployment lacks).
            schema.RESOURCE_POOLS: {**{name: dict(schema.EMPTY_POOL) for name in schema.POOL_KEYS}, **resource_pools},
            schema.RECLAIMED_RESOURCES: dict(self.reclaimed),
        }
