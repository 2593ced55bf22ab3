"""The profile JSON's writer: times engine calls and counts tokens so `llm_inference --profileOutputFile` can write
the profile users' scripts and `llm_profile` (kvforge/tools/profile/) read. Per-op timings are
kvforge/runtime/engine/op_timing.py."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import atomic_write_text
from kvforge.contract.profile_schema import (
    ADAPTER_BASE_PAGES,
    ADAPTER_CORRECTED_PAGES,
    CONTEXT_CACHE,
    GENERATION,
    GENERATION_STAGE,
    KV_POOL,
    PEAK_CPU_MEMORY,
    PER_ADAPTER,
    PREFILL,
    PREFILL_STAGE,
    SCHEDULER,
    SCHEDULER_KEYS,
    SPEC_DECODE_GENERATION,
    STAGES,
    bytes_key,
    mb_key,
)

_MIB = 1024 * 1024
_DECIMALS = 4


def _finite(value: float) -> float:
    """Round for readability and turn NaN/inf into 0: json would otherwise write invalid `NaN`."""
    value = float(value)
    return round(value, _DECIMALS) if math.isfinite(value) else 0.0


def _ratio(numerator: float, denominator: float) -> float:
    return _finite(numerator / denominator) if denominator else 0.0


@dataclass(slots=True)
class StageTimer:
    """All samples (ms) of one stage, e.g. every `llm_prefill` engine call."""

    stage_id: str
    samples_ms: list[float] = field(default_factory=list)

    def add(self, ms: float) -> None:
        self.samples_ms.append(float(ms))

    @property
    def total_ms(self) -> float:
        return float(sum(self.samples_ms))

    def stats(self) -> dict[str, Any]:
        """`gpu_time_stats`: linear-interpolated percentiles (numpy default), population stddev."""
        if not self.samples_ms:
            return {"count": 0, "min_ms": 0.0, "max_ms": 0.0, "mean_ms": 0.0, "median_ms": 0.0,
                    "p95_ms": 0.0, "p99_ms": 0.0, "stddev_ms": 0.0}
        samples = np.asarray(self.samples_ms, dtype=np.float64)
        return {
            "count": len(self.samples_ms),
            "min_ms": _finite(samples.min()),
            "max_ms": _finite(samples.max()),
            "mean_ms": _finite(samples.mean()),
            "median_ms": _finite(np.median(samples)),
            "p95_ms": _finite(np.percentile(samples, 95)),
            "p99_ms": _finite(np.percentile(samples, 99)),
            "stddev_ms": _finite(samples.std(ddof=0)),
        }

    def to_dict(self) -> dict[str, Any]:
        runs = len(self.samples_ms)
        return {
            "stage_id": self.stage_id,
            "total_runs": runs,
            "total_gpu_time_ms": _finite(self.total_ms),
            "average_time_per_run_ms": _ratio(self.total_ms, runs),
            "gpu_time_stats": self.stats(),
        }


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux but bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


@dataclass(slots=True)
class Profiler:
    """Per-stage timings and token counters for one `llm_inference` process.

    Stage times are measured with `time.perf_counter_ns` around each engine call. On the CPU
    backend they are wall times of those calls; a GPU backend would record device times instead.
    Either way the JSON key stays `gpu_time_stats` (and `total_gpu_time_ms`) because users'
    scripts written for the tool we mirror read those names.

    Set `enabled = False` for warmup runs: stages, `record` and every counter then record nothing.
    """

    enabled: bool = True
    stages: dict[str, StageTimer] = field(default_factory=dict)  # insertion order = first-seen order
    prefill_runs: int = 0
    prefill_reused_tokens: int = 0
    prefill_computed_tokens: int = 0
    generation_runs: int = 0
    generated_tokens: int = 0
    peak_cpu_memory_bytes: int = 0
    kv_pool_bytes: int | None = None
    per_adapter: dict[str, dict[str, int]] = field(default_factory=dict)  # adapter name ("base") -> counts
    adapter_base_pages: int = 0  # base pages reused by adapter requests, all adapters together (/metrics)
    adapter_corrected_pages: int = 0  # base pages corrected adapters started from, all together (/metrics)
    spec_verify_rows: int = 0  # rows that verified drafts
    spec_draft_tokens: int = 0  # drafts verified
    spec_accepted_tokens: int = 0  # drafts kept
    spec_committed_tokens: int = 0  # tokens those rows committed (kept drafts + one each)
    spec_media_cold_requests: int = 0  # speculative requests with image or audio, run cold (the support matrix)
    spec_reuse_bypassed_requests: int = 0  # speculative requests whose reuse the deployment could not serve
    spec_prefill_only_requests: int = 0  # ... whose decode-end publication it skipped (hybrid MTP: prefill_state_only)
    # TensorRT Edge-LLM names the block by strategy (mtp_generation for MTP drafters): written beside
    # spec_decode_generation, which every method writes, when set.
    spec_strategy_section: str | None = None
    # A long-running process (the server) streams stage times here instead of keeping every run in a list.
    stage_sink: Callable[[str, float], None] | None = None

    def reset(self) -> None:
        """Every stage and counter back to zero, in place (benchmarks between phases); `enabled`, `stage_sink` and
        the strategy's section name stay. In place because the engine's parts hold this profiler."""
        fresh = Profiler(enabled=self.enabled, stage_sink=self.stage_sink,
                         spec_strategy_section=self.spec_strategy_section)
        for item in fields(self):
            setattr(self, item.name, getattr(fresh, item.name))

    @contextmanager
    def stage(self, stage_id: str) -> Iterator[None]:
        """Time the body as one run of `stage_id`; a body that raises is not recorded."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter_ns()
        yield
        self.record(stage_id, (time.perf_counter_ns() - start) / 1e6)

    def record(self, stage_id: str, ms: float) -> None:
        """Add one externally measured run of `stage_id` (milliseconds)."""
        if not self.enabled:
            return
        if self.stage_sink is not None:
            self.stage_sink(stage_id, ms)
            return
        timer = self.stages.get(stage_id)
        if timer is None:
            timer = self.stages[stage_id] = StageTimer(stage_id)
        timer.add(ms)

    def add_prefill(self, reused_tokens: int, computed_tokens: int) -> None:
        """Count one prefill run (a batch): prompt tokens served from the cache vs run through the engine."""
        if not self.enabled:
            return
        self.prefill_runs += 1
        self.prefill_reused_tokens += int(reused_tokens)
        self.prefill_computed_tokens += int(computed_tokens)

    def add_adapter_request(self, adapter: str, reused_tokens: int, base_pages: int = 0,
                            corrected_pages: int = 0) -> None:
        """Count one request served with `adapter` ("base" for none), its prompt tokens reused and, for an adapter,
        the base pages among them (pages the base model computed, shared before an activated adapter's start)."""
        if not self.enabled:
            return
        counts = self.per_adapter.setdefault(adapter, {"requests": 0, "reused_tokens": 0})
        counts["requests"] += 1
        counts["reused_tokens"] += int(reused_tokens)
        if adapter != "base":
            counts[ADAPTER_BASE_PAGES] = counts.get(ADAPTER_BASE_PAGES, 0) + int(base_pages)
            self.adapter_base_pages += int(base_pages)
            if corrected_pages:  # a corrected adapter (lora_corrections): its copies of base pages
                counts[ADAPTER_CORRECTED_PAGES] = counts.get(ADAPTER_CORRECTED_PAGES, 0) + int(corrected_pages)
                self.adapter_corrected_pages += int(corrected_pages)

    def add_speculation(self, drafts: int, accepted: int, committed: int) -> None:
        """Count one row that verified `drafts` draft tokens, kept `accepted` and committed `committed` tokens."""
        if not self.enabled:
            return
        self.spec_verify_rows += 1
        self.spec_draft_tokens += int(drafts)
        self.spec_accepted_tokens += int(accepted)
        self.spec_committed_tokens += int(committed)

    def add_media_cold_request(self) -> None:
        if self.enabled:
            self.spec_media_cold_requests += 1

    def add_reuse_bypass(self) -> None:
        if self.enabled:
            self.spec_reuse_bypassed_requests += 1

    def add_prefill_only(self) -> None:
        if self.enabled:
            self.spec_prefill_only_requests += 1

    def add_generation(self, generated_tokens: int) -> None:
        """Count one decode run (one batch's decode loop)."""
        if not self.enabled:
            return
        self.generation_runs += 1
        self.generated_tokens += int(generated_tokens)

    def note_peak_memory(self, kv_pool_bytes: int | None = None) -> None:
        """Sample peak RSS so far; `kv_pool_bytes` is the KV pool size the caller allocated, if known."""
        if not self.enabled:
            return
        self.peak_cpu_memory_bytes = max(self.peak_cpu_memory_bytes, _peak_rss_bytes())
        if kv_pool_bytes is not None:
            self.kv_pool_bytes = int(kv_pool_bytes)

    def stage_ms(self, stage_id: str) -> float:
        timer = self.stages.get(stage_id)
        return timer.total_ms if timer else 0.0

    def to_dict(self, context_cache: dict[str, Any] | None = None,
                scheduler: dict[str, int] | None = None) -> dict[str, Any]:
        """The profile JSON object; each section appears only when it has data.

        Engine steps are counted by what they ran: a step with any prefill rows is one `llm_prefill` run
        (its decode rows included, so `generation` covers pure decode steps only and its tok/s stays the
        decode rate); the `scheduler` block counts those mixed steps."""
        data: dict[str, Any] = {}
        if self.prefill_runs:
            tokens = self.prefill_reused_tokens + self.prefill_computed_tokens
            prefill_ms = self.stage_ms(PREFILL_STAGE)
            data[PREFILL] = {
                "total_runs": self.prefill_runs,
                "reused_tokens": self.prefill_reused_tokens,
                "computed_tokens": self.prefill_computed_tokens,
                "average_tokens_per_run": _ratio(tokens, self.prefill_runs),
                "average_time_per_run_ms": _ratio(prefill_ms, self.prefill_runs),
                # Reused tokens count too, as in the mirrored tool: reuse shows up as higher tok/s.
                "tokens_per_second": _ratio(tokens * 1000.0, prefill_ms),
                "average_time_per_token_ms": _ratio(prefill_ms, tokens),
            }
        if context_cache is not None:
            # Verbatim: the cache owns these counters (cumulative, warmup included).
            data[CONTEXT_CACHE] = context_cache
        if self.generation_runs:
            generation_ms = self.stage_ms(GENERATION_STAGE)
            data[GENERATION] = {
                "total_runs": self.generation_runs,
                "generated_tokens": self.generated_tokens,
                "average_tokens_per_run": _ratio(self.generated_tokens, self.generation_runs),
                "tokens_per_second": _ratio(self.generated_tokens * 1000.0, generation_ms),
                "average_time_per_token_ms": _ratio(generation_ms, self.generated_tokens),
            }
        if self.spec_verify_rows or self.spec_media_cold_requests or self.spec_reuse_bypassed_requests or \
                self.spec_prefill_only_requests:
            data[SPEC_DECODE_GENERATION] = {
                # TensorRT Edge-LLM's names: an iteration is one verify row; its tokens are what it committed.
                "total_runs": self.generation_runs,
                "total_iterations": self.spec_verify_rows,
                "total_draft_tokens": self.spec_draft_tokens,
                "total_accepted_tokens": self.spec_accepted_tokens,
                "total_generated_tokens": self.spec_committed_tokens,
                "average_acceptance_rate": _ratio(self.spec_accepted_tokens, self.spec_draft_tokens),
                "acceptance_length": _ratio(self.spec_committed_tokens, self.spec_verify_rows),
                "media_cold_requests": self.spec_media_cold_requests,
                "reuse_bypassed_requests": self.spec_reuse_bypassed_requests,
                "prefill_state_only_requests": self.spec_prefill_only_requests,
            }
            if self.spec_strategy_section:
                data[self.spec_strategy_section] = dict(data[SPEC_DECODE_GENERATION])
        if scheduler is not None and self.enabled:
            data[SCHEDULER] = {key: int(scheduler[key]) for key in SCHEDULER_KEYS}
        if self.per_adapter:
            data[PER_ADAPTER] = {name: dict(counts) for name, counts in self.per_adapter.items()}
        if self.stages:
            data[STAGES] = [timer.to_dict() for timer in self.stages.values()]
        if self.peak_cpu_memory_bytes:
            _add_memory(data, PEAK_CPU_MEMORY, self.peak_cpu_memory_bytes)
        if self.kv_pool_bytes is not None:
            _add_memory(data, KV_POOL, self.kv_pool_bytes)
        return data


def _add_memory(data: dict[str, Any], figure: str, num_bytes: int) -> None:
    """A memory figure is written twice: exact bytes and MiB for reading."""
    data[bytes_key(figure)] = num_bytes
    data[mb_key(figure)] = _finite(num_bytes / _MIB)


def write_profile(path: Path, data: dict[str, Any]) -> None:
    """Write the profile JSON (2-space indent); a bad location names `--profileOutputFile`."""
    path = Path(path)
    if not path.parent.is_dir():
        raise KvforgeError(f"directory {str(path.parent)!r} does not exist", "profile_output_file")
    try:
        # allow_nan=False: fail loudly rather than write JSON that strict parsers reject.
        text = json.dumps(data, indent=2, allow_nan=False)
    except ValueError as exc:
        raise KvforgeError(f"profile holds a non-finite number ({exc})", "profile_output_file") from None
    try:
        atomic_write_text(path, text + "\n")
    except OSError as exc:
        raise KvforgeError(f"cannot write {str(path)!r}: {exc.strerror or exc}",
                           "profile_output_file") from None
