"""Two llm_serve replicas behind Shepherd Model Gateway's cache_aware policy (issue 54 item 3), on the tiny engine,
every socket on 127.0.0.1: requests sharing a long prefix land where its pages are (the replicas' own hit counters
show it, with no shared tier to carry pages across), and a killed replica is routed around without losing a
request."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.server_harness import build_server_engine, http_call
from support.stores import free_port

SMG = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
if not Path(SMG).exists():
    pytest.skip("smg (Shepherd Model Gateway) is not installed: pip install 'kvforge[cluster]'",
                allow_module_level=True)
LLM_SERVE = str(Path(sys.executable).with_name("llm_serve"))
START_TIMEOUT_S = 120
REPO = Path(__file__).resolve().parents[2]
# Two long documents (byte-level tokenizer: one token per byte), 9 full pages each, far above cache_threshold 0.3.
DOCS = ["Harbor Point tidal array, survey of the turbine foundations and export cables. " * 2,
        "Minutes of the review board: budget, schedule, grid connection and the permit. " * 2]


def wait_ready(port: int, path: str, process: subprocess.Popen, log: Path,
               headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert process.poll() is None, log.read_text()
        try:
            if call(port, path, headers=headers)[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{path} on {port} never answered: {log.read_text()[-2000:]}"
        time.sleep(0.3)


def call(port: int, path: str, body: dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, str]:
    """http_call with request headers (an API key)."""
    if not headers:
        return http_call(port, path, body)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("GET" if body is None else "POST", path, None if body is None else json.dumps(body),
                           {"Content-Type": "application/json", **headers})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def counters(port: int) -> dict[str, float]:
    _, text = http_call(port, "/metrics")
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels
            or s.name.startswith("vllm:")}


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("cluster_engine"))


@contextmanager
def started_cluster(engine_dir: Path, tmp_path: Path, replicas: int = 2, replica_args: Sequence[str] = (),
                    gateway_args: Sequence[str] = (),
                    ready: tuple[str, dict[str, str]] = ("/v1/models", {})) -> Iterator[tuple[int, list[int],
                                                                                              list[subprocess.Popen]]]:
    """`replicas` llm_serve processes of `engine_dir` and SMG's cache_aware gateway in front, all on 127.0.0.1;
    every process ends with the block."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "NO_COLOR": "1"}
    ports, processes = [free_port() for _ in range(replicas)], []
    try:
        for port in ports:
            log = tmp_path / f"replica-{port}.log"
            processes.append(subprocess.Popen(
                [LLM_SERVE, "--engineDir", str(engine_dir), "--host", "127.0.0.1", "--port", str(port),
                 "--enableContextReuse", "--numThreads", "1", "--servedModelName", "tiny", *replica_args],
                stdout=log.open("w"), stderr=subprocess.STDOUT, env=env))
        for port, process in zip(ports, processes, strict=True):
            wait_ready(port, "/health", process, tmp_path / f"replica-{port}.log")
        gateway = free_port()
        log = tmp_path / "smg.log"
        processes.append(subprocess.Popen(
            [SMG, "launch", "--host", "127.0.0.1", "--port", str(gateway), "--policy", "cache_aware",
             "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports],
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *gateway_args],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env))
        wait_ready(gateway, ready[0], processes[-1], log, ready[1])
        yield gateway, ports, processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


@pytest.fixture
def cluster(engine_dir: Path, tmp_path: Path) -> Iterator[tuple[int, list[int], list[subprocess.Popen]]]:
    with started_cluster(engine_dir, tmp_path) as running:
        yield running


def ask(gateway: int, doc: str, question: str) -> None:
    status, reply = http_call(gateway, "/v1/completions", {"model": "tiny", "prompt": doc + question, "max_tokens": 2,
                                                      "temperature": 0})
    assert status == 200, reply


def test_prefixes_land_where_their_pages_are_and_a_dead_replica_is_routed_around(cluster) -> None:
    gateway, ports, processes = cluster
    questions = ["How many turbines?", "Who chaired it?", "When did it start?", "What did it cost?"]
    # A, A, B, B, A, A, B, B: round robin would give each replica each document twice (each computing it once).
    for pair in (questions[:2], questions[2:]):
        for doc in DOCS:
            for question in pair:
                ask(gateway, doc, question)
    stats = [counters(port) for port in ports]
    hits = sum(s["vllm:prefix_cache_hits_total"] for s in stats)
    served = [s.get("kvforge_prompt_tokens_total", 0) for s in stats]
    # Every repeat of a document hit its whole pages on the replica that computed it: with nothing shared between
    # the replicas, that happens only if the router sent it there. Each document is 9 full pages (144 tokens).
    full_pages = [len(doc) // 16 * 16 for doc in DOCS]
    assert hits >= (len(questions) - 1) * sum(full_pages), (hits, stats)
    assert sum(served) > 0

    busiest = max(range(2), key=lambda i: stats[i]["vllm:prefix_cache_hits_total"])
    processes[busiest].terminate()
    processes[busiest].wait(20)
    survivor = ports[1 - busiest]
    before = counters(survivor).get("kvforge_prompt_tokens_total", 0)
    for question in ["Which cable failed?", "Who signed the permit?"]:
        for doc in DOCS:
            ask(gateway, doc, question)  # none is lost: the gateway retries on the live replica
    assert counters(survivor)["kvforge_prompt_tokens_total"] > before


ROUTER_KEY, ALICE_KEY = "router-operator-key-54", "alice-tenant-key-54"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_gateway_with_the_operator_key_forwards_each_clients_own_key(engine_dir: Path, tmp_path: Path) -> None:
    """docs/scale-out.md "With --apiKeys": replicas with --apiKeys, SMG with --api-key ROUTER_KEY (an operator key,
    which may read /metrics) and --tenant-api-key for each client key (SMG checks client keys itself once it has
    --api-key). A client's own key reaches the replica: its tenant's salt keys the pages it stores, so a direct call
    with the same key finds them and one with the router's key does not; no key is refused, not replaced."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({ROUTER_KEY: {"tenant": "router", "operator": True}, ALICE_KEY: "alice"}))
    gateway_args = ["--api-key", ROUTER_KEY, "--tenant-api-key", f"alice:{ALICE_KEY}"]
    with started_cluster(engine_dir, tmp_path, replicas=1, replica_args=["--apiKeys", str(keys)],
                         gateway_args=gateway_args, ready=("/v1/models", bearer(ALICE_KEY))) as (gateway, ports, _):
        doc = DOCS[0]
        status, reply = call(gateway, "/v1/completions", {"model": "tiny", "prompt": doc + "Q1?", "max_tokens": 2,
                                                          "temperature": 0}, bearer(ALICE_KEY))
        assert status == 200, reply
        status, reply = call(ports[0], "/v1/completions", {"model": "tiny", "prompt": doc + "Q2?", "max_tokens": 2,
                                                           "temperature": 0}, bearer(ALICE_KEY))
        assert status == 200, reply
        cached = json.loads(reply)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(doc) // 16 * 16, reply  # stored under alice's salt: the gateway sent alice's key
        status, reply = call(ports[0], "/v1/completions", {"model": "tiny", "prompt": doc + "Q3?", "max_tokens": 2,
                                                           "temperature": 0}, bearer(ROUTER_KEY))
        assert status == 200 and json.loads(reply)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, reply
        status, reply = call(gateway, "/v1/completions", {"model": "tiny", "prompt": "no key", "max_tokens": 2})
        assert status == 401, (status, reply)
        assert call(ports[0], "/metrics", headers=bearer(ROUTER_KEY))[0] == 200
        assert call(ports[0], "/metrics", headers=bearer(ALICE_KEY))[0] == 403
