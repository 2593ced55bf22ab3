"""What cache-aware routers read from llm_serve (issue 54 item 1): GET /version, /v1/models' `root` and
`max_model_len`, and vLLM's series names on /metrics with the same values as kvforge's own; on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.server_harness import MODEL, LiveServer, build_server_engine, live_server

from kvforge import __version__

SYSTEM = "You are the assistant of the Harbor Point tidal energy array. Answer briefly. " * 2
KEYS: dict[str, Any] = {"key-a": "alice", "key-router": {"tenant": "router", "operator": True}}


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("router_engine"))


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(engine_dir, tmp_path_factory.mktemp("router_server")) as live:
        yield live


def samples(text: str) -> dict[str, tuple[float, dict[str, str]]]:
    return {s.name: (s.value, s.labels) for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels}


def complete(server: LiveServer, question: str, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    status, reply = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}, headers)
    assert status == 200, reply
    return reply


def test_version_and_model_cards(server: LiveServer) -> None:
    assert server.request("GET", "/version") == (200, {"version": __version__})
    status, models = server.request("GET", "/v1/models")
    assert status == 200
    [card] = models["data"]
    assert card["root"] == MODEL and card["owned_by"] == "kvforge"
    assert card["max_model_len"] == server.state.max_model_len > 0


def test_vllm_series_equal_ours(server: LiveServer) -> None:
    for question in ("How many turbines?", "Who chaired the review?", "When did it open?"):
        complete(server, question)
    pairs = (("kvforge_num_requests_running", "vllm:num_requests_running"),
             ("kvforge_num_requests_waiting", "vllm:num_requests_waiting"),
             ("kvforge_kv_pool_usage_ratio", "vllm:kv_cache_usage_perc"),
             ("kvforge_prefix_cache_queries_tokens_total", "vllm:prefix_cache_queries_total"),
             ("kvforge_prefix_cache_hits_tokens_total", "vllm:prefix_cache_hits_total"))
    # Each collector reads the engine's snapshot at its own moment: the step that publishes the last answer's pages
    # may land between them, so scrape until the engine is idle (bounded).
    deadline = time.monotonic() + 10
    while True:
        status, text = server.request("GET", "/metrics")
        assert status == 200
        values = samples(text)
        if all(values[theirs][0] == values[ours][0] for ours, theirs in pairs) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for ours, theirs in pairs:
        assert values[theirs] == (values[ours][0], {"model_name": MODEL}), theirs
    queries, hits = values["vllm:prefix_cache_queries_total"][0], values["vllm:prefix_cache_hits_total"][0]
    assert 0 < hits < queries  # the shared system prompt hit on the 2nd and 3rd request
    assert values["vllm:gpu_prefix_cache_hit_rate"][0] == pytest.approx(hits / queries)
    assert 0 < values["vllm:kv_cache_usage_perc"][0] <= 1  # the records hold pages
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text and "# TYPE vllm:kv_cache_usage_perc gauge" in text


def test_a_router_with_an_operator_key_reads_everything(engine_dir: Path, tmp_path: Path) -> None:
    with live_server(engine_dir, tmp_path, api_keys=KEYS) as server:
        assert server.request("GET", "/version") == (200, {"version": __version__})  # open, like /health
        assert server.request("GET", "/v1/models")[0] == 401
        complete(server, "How many turbines?", "key-a")
        status, _ = server.request("GET", "/metrics", headers={"Authorization": "Bearer key-a"})
        assert status == 403  # a tenant's key never reads the other tenants' load and hit rates
        router = {"Authorization": "Bearer key-router"}
        status, text = server.request("GET", "/metrics", headers=router)
        assert status == 200 and samples(text)["vllm:prefix_cache_queries_total"][0] > 0
        assert server.request("GET", "/v1/models", headers=router)[0] == 200
