"""vLLM's metric names on /metrics, beside kvforge's: the load and cache signals existing routers read.

Shepherd Model Gateway's and vllm-router's load monitors scrape `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and `vllm:gpu_prefix_cache_hit_rate`; llm-d's and Dynamo's
scorers and Grafana dashboards built for vLLM read the same names and the prefix-cache token counters. They are
copies of kvforge's own series (docs/scale-out.md lists which router reads which), so a router balances on what the
engine and the handlers already count, never on a second bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvforge.runtime.engine import EngineStats

VLLM_PREFIX = "vllm:"


class VllmCollector(Collector):
    """The vLLM-named series, read at each scrape from the engine snapshot and the handlers' token counters."""

    def __init__(self, snapshot: Callable[[], EngineStats], queries: Counter, hits: Counter,
                 model_name: str) -> None:
        self.snapshot = snapshot
        self.queries = queries
        self.hits = hits
        self.model_name = model_name  # vLLM labels its series by model_name; routers that filter by it find ours

    def describe(self) -> Iterator[Metric]:
        return iter(())  # built fresh at each scrape

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        name = self.model_name
        queries, hits = _counter_value(self.queries), _counter_value(self.hits)
        yield _family(GaugeMetricFamily, "num_requests_running", "Requests running in the engine (vLLM's name; "
                      "kvforge_num_requests_running).", name, s.running)
        # Waiting for pages from a shared tier is waiting too: the request holds no compute yet.
        yield _family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled (vLLM's name; "
                      "kvforge_num_requests_waiting plus those loading from the shared tier).", name,
                      s.waiting + s.loading)
        used = 1 - s.pool_free / s.pool_capacity if s.pool_capacity else 0.0
        yield _family(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage, 0 to 1 (vLLM's name; "
                      "kvforge_kv_pool_usage_ratio: pages held by requests or by cache records).", name, used)
        yield _family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                      "(vLLM's name; kvforge_prefix_cache_queries_tokens).", name, queries)
        yield _family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens served from the prefix cache "
                      "(vLLM's name; kvforge_prefix_cache_hits_tokens).", name, hits)
        yield _family(GaugeMetricFamily, "gpu_prefix_cache_hit_rate", "Prefix-cache hit rate since start, 0 to 1: "
                      "hit tokens / queried tokens (vLLM v0's name, which SMG's load monitor reads; the cache is in "
                      "host memory here).", name, hits / queries if queries else 0.0)


def _family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, help_text: str, model: str,
            value: float) -> Metric:
    family = kind(f"{VLLM_PREFIX}{name}", help_text, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter_value(counter: Counter) -> float:
    """A label-less counter's current total, through the client's public collect()."""
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                return float(sample.value)
    return 0.0
