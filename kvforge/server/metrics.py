"""/metrics: Prometheus text from a registry per server (tests start several), via the official client library.

Counters the handlers see (requests, tokens, prefix-cache queries and hits, TTFT, inter-token latency) are
observed as requests run; what only the engine knows (pool occupancy, queue depth, records, preemptions,
reused tokens) is read from the snapshot the engine thread leaves after each step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvforge.contract import profile_schema as schema
from kvforge.runtime.engine import EngineStats, cache_samples

PREFIX = "kvforge"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: a warm hit on a small model answers in milliseconds, a cold 1,500-token prefill on two cores in seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineStats]) -> None:
        disable_created_metrics()  # no *_created series: a gauge of timestamps per counter is noise on a dashboard
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests by outcome: stop, length, aborted (client gone), "
                                "failed (engine error or shutdown), rejected (429 queue full), invalid (4xx).",
                                ["outcome"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated and delivered.",
                                         registry=r)
        self.cache_queries = Counter(f"{PREFIX}_prefix_cache_queries_tokens",
                                     "Prompt tokens looked up in the context cache.", registry=r)
        self.cache_hits = Counter(f"{PREFIX}_prefix_cache_hits_tokens",
                                  "Prompt tokens served from the context cache (cached_tokens).", registry=r)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Requests the server holds (running, waiting, or being "
                               "handed to the engine); at the engine's maxBatchSize + --maxQueuedRequests it answers "
                               "429.", registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.latency = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request arrival to its last token.",
                                 buckets=TTFT_BUCKETS, registry=r)
        self.step_time = Histogram(f"{PREFIX}_engine_step_seconds", "Engine step time by stage (llm_prefill: any "
                                   "prefill row; llm_generation: decode rows only).", ["stage"],
                                   buckets=ITL_BUCKETS, registry=r)
        r.register(_EngineCollector(snapshot))

    def observe_stage(self, stage_id: str, ms: float) -> None:
        """The engine profiler's stage sink: one engine call of `stage_id` took `ms` milliseconds."""
        self.step_time.labels(stage_id).observe(ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats]) -> None:
        self.snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families are built fresh at each scrape

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        yield _gauge("num_requests_waiting", "Requests the scheduler has not admitted yet (queue depth).", s.waiting)
        yield _gauge("num_requests_running", "Sequences running in the engine.", s.running)
        yield _gauge("kv_pool_pages_free", "Free KV pages (no request and no cache record holds them).", s.pool_free)
        yield _gauge("kv_pool_pages_total", "KV pages in the pool.", s.pool_capacity)
        used = 1 - s.pool_free / s.pool_capacity if s.pool_capacity else 0.0
        yield _gauge("kv_pool_usage_ratio", "Share of KV pages held by requests or cache records.", used)
        yield _counter("prefill_reused_tokens", "Prompt tokens served from a cache instead of computed.",
                       s.prefill_reused_tokens)
        yield _counter("prefill_computed_tokens", "Prompt tokens run through the engine.", s.prefill_computed_tokens)
        yield _counter("adapter_base_pages_reused", "Base-model pages reused by adapter requests (activated LoRA "
                       "before its invocation).", s.adapter_base_pages)
        yield _counter("adapter_corrected_pages", "Base-model pages corrected adapters started from (copied, then "
                       "corrected: --loraCorrection).", s.adapter_corrected_pages)
        for key, help_text in (("preemptions", "Sequences preempted because the pool was full."),
                               ("steps", "Engine steps."),
                               ("inflight_prefix_waits", "Times a request waited for a prefix another computed.")):
            yield _counter(f"scheduler_{key}", help_text, s.scheduler.get(key, 0))
        if s.spec_draft_tokens:  # speculative decoding proposed something
            yield _counter("spec_decode_draft_tokens", "Draft tokens verified (speculative decoding).",
                           s.spec_draft_tokens)
            yield _counter("spec_decode_accepted_tokens", "Draft tokens the model agreed with and kept.",
                           s.spec_accepted_tokens)
            yield _gauge("spec_decode_acceptance_rate", "Kept drafts / verified drafts since the server started.",
                         s.spec_accepted_tokens / s.spec_draft_tokens)
        if s.encoder_cache:  # an encoder engine is loaded
            cache = s.encoder_cache
            yield _counter("encoder_cache_hits", "Media items whose encoder output came from the encoder cache.",
                           cache["hits"])
            yield _counter("encoder_cache_misses", "Media items the encoder ran for.", cache["misses"])
            yield _counter("encoder_cache_evictions", "Encoder-cache entries evicted (LRU).", cache["evictions"])
            yield _gauge("encoder_cache_bytes", "Bytes of encoder outputs held by the encoder cache.", cache["bytes"])
        if s.cache:  # reuse on
            records = s.cache[schema.RECORDS]
            yield _gauge("context_cache_records", "Published cache records.", records[schema.RECORDS_CURRENT])
            yield _counter("context_cache_records_evicted", "Cache records evicted.", records[schema.RECORDS_EVICTED])
            for key in (schema.ADMITTED_SEQUENCES, schema.HIT_SEQUENCES, schema.MATCHED_TOKENS):
                yield _counter(f"context_cache_{key}", f"The profile's context_cache.{key}.", s.cache[key])
            for sample in cache_samples(s.cache):  # each cache type's series, from its own module
                family = _counter if sample.kind == "counter" else _gauge
                yield family(sample.name, sample.help, sample.value)
            for key, value in s.cache.get("shared_tier", {}).items():  # --sharedCache
                yield _counter(f"shared_tier_{key}", f"The profile's context_cache.shared_tier.{key}.", value)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=value)
