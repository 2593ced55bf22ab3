"""A real consumer of llm_serve's KV events (issue 54 item 2): vllm-router's kv_aware policy subscribes to
--kvEventsEndpoint, decodes the batches and credits the pages it was told about to the worker; everything on
127.0.0.1, the router's metrics server included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.server_harness import MODEL, build_server_engine, http_call, live_server
from support.stores import free_port

pytest.importorskip("zmq", reason="KV events need pyzmq: pip install 'kvforge[cluster]'")
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
if not Path(ROUTER).exists():
    pytest.skip("vllm-router is not installed (pip install 'kvforge[cluster]'): no real KV event consumer",
                allow_module_level=True)

START_TIMEOUT_S = 60
PREFIX = "The Harbor Point tidal array report, section one: turbines, cables and the review board. " * 2


def lookups(port: int) -> dict[str, float]:
    _, text = http_call(port, "/metrics")
    return {s.labels["result"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "vllm_router_kv_placement_lookups_total"}


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("kv_router_engine"))


def test_vllm_router_kv_aware_credits_the_published_pages(engine_dir: Path, tmp_path: Path) -> None:
    with live_server(engine_dir, tmp_path, kv_events_endpoint="tcp://127.0.0.1:0") as server:
        endpoint = server.on_engine(lambda e: e.kv_events.endpoint)
        port, metrics_port = free_port(), free_port()
        log = (tmp_path / "router.log").open("w")
        router = subprocess.Popen(
            [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", server.url, "--policy", "kv_aware",
             "--kv-event-source", f"{server.url}={endpoint}", "--kv-event-block-size", "16",
             "--kv-event-model", MODEL, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "info", "NO_COLOR": "1"})
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                assert router.poll() is None, (tmp_path / "router.log").read_text()
                try:
                    if http_call(port, "/health")[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "vllm-router did not start"
                time.sleep(0.2)
            time.sleep(1.0)  # the router's SUB socket joins after its HTTP side is up (ZMQ's slow joiner)
            body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
            assert http_call(port, "/v1/completions", {**body, "prompt": PREFIX + "How many turbines?"})[0] == 200
            assert lookups(metrics_port).get("hit", 0) == 0  # nothing published yet when it routed
            deadline = time.monotonic() + 20
            while lookups(metrics_port).get("hit", 0) == 0:  # the events reach the router's index asynchronously
                status, _ = http_call(port, "/v1/completions", {**body, "prompt": PREFIX + "Who chaired the review?"})
                assert status == 200 and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
                time.sleep(0.3)
        finally:
            router.terminate()
            router.wait(10)
            log.close()
        text = (tmp_path / "router.log").read_text()
        assert "decode batch" not in text and "must be" not in text, text  # every batch decoded
