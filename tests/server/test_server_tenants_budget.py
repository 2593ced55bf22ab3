"""One tenant cannot starve another (body bytes reserved as they arrive, per-tenant shares of bodies, request slots
and open requests), and /metrics is for operator keys only; real sockets on loopback, every loop bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support.server_harness import MODEL, LiveServer, build_server_engine, idle_audit, live_server

from kvforge.contract.errors import KvforgeError
from kvforge.server.guard import BodyLimits, Shares, read_json
from kvforge.server.limits import TenantLimits
from kvforge.server.protocol import ApiError
from kvforge.server.tenants import load_tenants

KEYS: dict[str, Any] = {"key-a": "alice", "key-b": "bob", "key-ops": {"tenant": "ops", "operator": True}}
BODY = {"model": MODEL, "prompt": "Harbor Point", "max_tokens": 2, "temperature": 0}
TRICKLE_INTERVAL_S = 0.1
TRICKLE_MAX_S = 20.0  # a trickle stops by itself after this, whatever the test does
ANSWER_WITHIN_S = 10.0  # tenant B's answer, on 2 shared cores, while A trickles


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("tenant_budget_engine"))


def _head(server: LiveServer, key: str, length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {length}\r\n\r\n").encode()


@contextmanager
def trickling(server: LiveServer, key: str, count: int, length: int, first: bytes = b"{") -> Iterator[None]:
    """`count` connections of tenant `key` that declare `length` bytes, send `first`, then one byte per connection
    every TRICKLE_INTERVAL_S until the block ends (or TRICKLE_MAX_S)."""
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(count)]
    for sock in socks:
        sock.sendall(_head(server, key, length) + first)
    stop = threading.Event()

    def trickle() -> None:
        deadline = time.monotonic() + TRICKLE_MAX_S
        while not stop.wait(TRICKLE_INTERVAL_S) and time.monotonic() < deadline:
            for sock in socks:
                with contextlib.suppress(OSError):  # the server refused it and closed: fine
                    sock.sendall(b" ")  # JSON whitespace: the body stays a valid prefix

    thread = threading.Thread(target=trickle, name="test-trickle", daemon=True)
    thread.start()
    try:
        time.sleep(0.3)  # the server is reading every one of them
        yield
    finally:
        stop.set()
        thread.join(5)
        for sock in socks:
            sock.close()


def _call(server: LiveServer, method: str, path: str, key: str | None = None,
          body: dict | bytes | None = None) -> tuple[int, Any, float]:
    """(status, decoded body, seconds) of one request on its own connection."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    started = time.monotonic()
    status, reply = server.request(method, path, body, headers)
    return status, reply, time.monotonic() - started


def _code(reply: Any) -> str | None:
    return reply["error"]["code"] if isinstance(reply, dict) and "error" in reply else None


def _wait_released(server: LiveServer, key: str) -> None:
    """Disconnected uploads give their shares back once the server sees the hang-up (bounded)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        status, _, _ = _call(server, "POST", "/v1/completions", key, BODY)
        if status == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"tenant {key}'s shares were not given back")


def test_a_body_holds_the_bytes_it_sent_never_the_length_it_declared() -> None:
    limits = BodyLimits.of(2 * 2**20, 4 * 2**20)  # 2 MiB bodies, 4 MiB in flight, 1 MiB per tenant
    limits.per_tenant = Shares(2**20)
    held: list[tuple[int, int]] = []

    async def chunks(parts: list[bytes]) -> Any:
        for part in parts:
            held.append((limits.budget.used, limits.per_tenant.held("tenant:a")))  # type: ignore[union-attr]
            yield part

    parts = [b'{"a": ', b'"xyz"', b"}"]
    assert asyncio.run(read_json(chunks(parts), limits, declared=2**20, tenant_key="tenant:a")) == {"a": "xyz"}
    assert held == [(0, 0), (6, 6), (11, 11)]  # what arrived so far, in both; nothing for the 1 MiB declared
    assert limits.budget.used == 0 and limits.per_tenant.held("tenant:a") == 0  # all given back
    # Past the tenant's share: 429 for this tenant, and what it held is given back too.
    big = [b'{"a": "', b"x" * (2**20 - 100), b"x" * 200]
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_json(chunks(big), limits, tenant_key="tenant:a"))
    assert refused.value.status == 429 and refused.value.code == "tenant_limit_exceeded"
    assert limits.budget.used == 0 and limits.per_tenant.held("tenant:a") == 0


def test_a_tenant_declaring_the_maximum_and_trickling_does_not_block_another(engine_dir: Path,
                                                                             tmp_path: Path) -> None:
    """The issue's attack on the default bounds: two connections each declare the 50 MiB maximum (the whole 100 MiB
    in flight) and send a byte at a time. Declared lengths reserve nothing, so tenant B is answered at once."""
    with live_server(engine_dir, tmp_path, api_keys=KEYS) as server:
        with trickling(server, "key-a", count=2, length=50 * 2**20):
            for _ in range(3):
                status, reply, seconds = _call(server, "POST", "/v1/completions", "key-b", BODY)
                assert status == 200, reply
                assert seconds < ANSWER_WITHIN_S
        server.on_engine(idle_audit)


@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_a_tenant_past_its_request_slots_gets_429_and_the_others_are_served(engine_dir: Path, tmp_path: Path) -> None:
    limits = TenantLimits(requests=2, connections=8)
    with live_server(engine_dir, tmp_path, api_keys=KEYS, app_options={"tenant_limits": limits}) as server:
        with trickling(server, "key-a", count=2, length=2**20):
            status, reply, seconds = _call(server, "POST", "/v1/completions", "key-a", BODY)
            assert status == 429 and _code(reply) == "tenant_limit_exceeded", reply
            assert seconds < 2.0  # refused before its body, not after the 30 s body timeout
            assert _call(server, "GET", "/v1/models", "key-a")[0] == 200  # slots are completions only
            for key in ("key-b", "key-ops"):
                status, reply, seconds = _call(server, "POST", "/v1/completions", key, BODY)
                assert status == 200 and seconds < ANSWER_WITHIN_S, reply
        _wait_released(server, "key-a")
        server.on_engine(idle_audit)


def test_a_tenant_past_its_open_requests_gets_429_and_probes_still_answer(engine_dir: Path, tmp_path: Path) -> None:
    limits = TenantLimits(requests=8, connections=2)
    with live_server(engine_dir, tmp_path, api_keys=KEYS, app_options={"tenant_limits": limits}) as server:
        with trickling(server, "key-a", count=2, length=2**20):
            status, reply, _ = _call(server, "GET", "/v1/models", "key-a")
            assert status == 429 and _code(reply) == "tenant_limit_exceeded", reply
            assert _call(server, "GET", "/health", "key-a")[0] == 200  # probes are never a tenant's share
            assert _call(server, "GET", "/v1/models", "key-b")[0] == 200
            status, reply, seconds = _call(server, "POST", "/v1/completions", "key-b", BODY)
            assert status == 200 and seconds < ANSWER_WITHIN_S, reply
        _wait_released(server, "key-a")


def test_a_tenant_past_its_body_bytes_gets_429_and_the_others_upload(engine_dir: Path, tmp_path: Path) -> None:
    """Bytes that did arrive count against their tenant's share, which is below the process-wide budget."""
    options = {"max_body_bytes": 2**20, "body_bytes_in_flight": 4 * 2**20, "tenant_limits": TenantLimits(
        body_bytes=2**20, requests=8, connections=8)}
    sent = 700 * 1024
    with live_server(engine_dir, tmp_path, api_keys=KEYS, app_options=options) as server:
        with trickling(server, "key-a", count=1, length=2**20, first=b'{"pad": "' + b"x" * sent):
            # A second upload of A's: its bytes pass A's 1 MiB share; B's upload of the same size is served.
            padded = json.dumps({**BODY, "user": "x" * sent}).encode()
            status, reply, _ = _call(server, "POST", "/v1/completions", "key-a", padded)
            assert status == 429 and _code(reply) == "tenant_limit_exceeded", reply
            status, reply, seconds = _call(server, "POST", "/v1/completions", "key-b", padded)
            assert status == 200 and seconds < ANSWER_WITHIN_S, reply
        _wait_released(server, "key-a")


def test_metrics_are_for_operator_keys_only(engine_dir: Path, tmp_path: Path) -> None:
    with live_server(engine_dir, tmp_path, api_keys=KEYS) as server:
        assert _call(server, "POST", "/v1/completions", "key-a", BODY)[0] == 200
        status, reply, _ = _call(server, "GET", "/metrics", "key-a")
        assert status == 403 and _code(reply) == "operator_key_required"  # another tenant's counts stay hidden
        assert "kvforge_requests_total" not in json.dumps(reply)
        assert _call(server, "GET", "/metrics")[0] == 401
        assert _call(server, "GET", "/metrics", "not-a-key")[0] == 401
        status, text, _ = _call(server, "GET", "/metrics", "key-ops")
        assert status == 200 and 'kvforge_requests_total{outcome="length"} 1.0' in text
        # the operator is a tenant too: its key answers /v1 calls
        assert _call(server, "POST", "/v1/completions", "key-ops", BODY)[0] == 200


def test_metrics_stay_open_without_keys(engine_dir: Path, tmp_path: Path) -> None:
    with live_server(engine_dir, tmp_path) as server:
        status, text, _ = _call(server, "GET", "/metrics")
        assert status == 200 and "kvforge_requests_in_flight" in text


@pytest.mark.parametrize("entry, message", [
    ({"tenant": "ops", "operator": "yes"}, "operator must be true or false"),
    ({"tenant": "ops", "admin": True}, "unknown field 'admin'"),
    ({"operator": True}, "every tenant a non-empty string"),
])
def test_a_bad_key_entry_is_one_line_naming_the_field(tmp_path: Path, entry: dict, message: str) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k": entry}), encoding="utf-8")
    with pytest.raises(KvforgeError) as refused:
        load_tenants(keys, None)
    assert refused.value.field == "api_keys" and message in refused.value.message
    assert "\n" not in str(refused.value)


def test_operator_keys_are_told_apart_by_digest(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS), encoding="utf-8")
    tenants = load_tenants(keys, None)
    assert tenants.tenant_for("Bearer key-ops") == "ops" and tenants.is_operator("Bearer key-ops")
    assert tenants.tenant_for("Bearer key-a") == "alice" and not tenants.is_operator("Bearer key-a")
    assert not tenants.is_operator(None) and not tenants.is_operator("Bearer nope")
    assert load_tenants(None, None).is_operator(None)  # no keys: everyone, as before



@pytest.mark.parametrize(("args", "flag"), [
    (["--maxBodyBytesPerTenant", "0"], "--maxBodyBytesPerTenant"),
    (["--maxBodyBytesPerTenant", str(101 * 2**20)], "--maxBodyBytesPerTenant"),  # more than the 100 MiB in flight
    (["--maxRequestsPerTenant", "-1"], "--maxRequestsPerTenant"),
    (["--maxConnections", "10", "--maxConnectionsPerTenant", "11"], "--maxConnectionsPerTenant"),
    (["--apiKeys", "KEYS"], "--apiKeys"),  # an operator entry that is not true or false
])
def test_bad_tenant_flags_are_one_line(engine_dir: Path, run_cli: Callable[..., Any], tmp_path: Path,
                                       args: list[str], flag: str) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k": {"tenant": "ops", "operator": 1}}), encoding="utf-8")
    result = run_cli(["llm_serve", "--engineDir", engine_dir, *[str(keys) if a == "KEYS" else a for a in args]])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}"), result.stderr
