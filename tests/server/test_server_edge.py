"""llm_serve at its edges: Host and Origin checks, JSON-only POSTs, bounded bodies, shutdown and Ctrl-C answers.

Raw sockets where a client library would fix the request up (a stalled body, a declared length never sent).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import support.server_harness as harness
from conftest import BIN_DIR, CLI_TIMEOUT_S
from support.server_harness import MODEL, LiveServer, build_server_engine, idle_audit, live_server

from kvforge.server.guard import MAX_JSON_SEPARATORS

BODY = {"model": MODEL, "prompt": "Harbor Point", "max_tokens": 3, "temperature": 0}
NOTEBOOK = "http://notebook.test:8888"


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("edge_engine"))


@contextmanager
def guarded_server(engine_dir: Path, tmp_path: Path, api_keys: dict[str, str] | None = None,
                   **app_options: Any) -> Iterator[LiveServer]:
    """live_server with create_app options of this file's (allowed origins, body bounds)."""
    original = harness.create_app
    harness.create_app = lambda *args, **kwargs: original(*args, **kwargs, **app_options)  # type: ignore[assignment]
    try:
        server_cm = live_server(engine_dir, tmp_path, api_keys=api_keys, shutdown_timeout=0.3)
        server = server_cm.__enter__()
    finally:
        harness.create_app = original  # type: ignore[assignment]
    try:
        yield server
    finally:
        server_cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with guarded_server(engine_dir, tmp_path_factory.mktemp("edge"), allowed_origins=frozenset({NOTEBOOK}),
                        max_body_bytes=2**20, body_bytes_in_flight=2 * 2**20, body_timeout_s=1.0) as live:
        yield live


@pytest.fixture(scope="module")
def roomy(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The default bounds (50 MiB bodies, 100 MiB at once, 30 s)."""
    with guarded_server(engine_dir, tmp_path_factory.mktemp("roomy")) as live:
        yield live


@dataclass(frozen=True)
class Spawned:
    """An llm_serve process's port (what `call` needs of a server)."""

    port: int


def call(server: LiveServer | Spawned, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """(status, lower-cased headers, JSON or text); `headers` replace the defaults (Host, Content-Type) they name."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        text = response.read().decode()
        found = {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()
    try:
        return response.status, found, json.loads(text)
    except ValueError:
        return response.status, found, text


def assert_error(reply: Any, code: str) -> None:
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["code"] == code, reply


def raw(server: LiveServer, head: str, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
    return sock


def response_of(sock: socket.socket) -> tuple[int, Any]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, json.loads(response.read())


def post_head(server: LiveServer, length: int) -> str:
    return (f"POST /v1/completions HTTP/1.1\nHost: 127.0.0.1:{server.port}\nContent-Type: application/json\n"
            f"Content-Length: {length}\n")


# --- browsers' reach: Host, Origin, Content-Type ----------------------------------------------------------


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.1.evil.example"])
def test_a_foreign_host_is_refused(server: LiveServer, host: str) -> None:
    for method, path, body in [("GET", "/metrics", None), ("POST", "/v1/completions", json.dumps(BODY).encode())]:
        status, _, reply = call(server, method, path, body, {"Host": host})
        assert status == 400
        assert_error(reply, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:{port}", "127.0.0.1:{port}", "[::1]:{port}"])
def test_loopback_hosts_are_answered(server: LiveServer, host: str) -> None:
    assert call(server, "GET", "/health", headers={"Host": host.format(port=server.port)})[0] == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_a_post_that_is_not_json_gets_415(server: LiveServer, content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {"Content-Type": ""}
    status, _, reply = call(server, "POST", "/v1/completions", json.dumps(BODY).encode(), headers)
    assert status == 415
    assert_error(reply, "unsupported_media_type")
    assert call(server, "POST", "/v1/completions", json.dumps(BODY).encode(),
                {"Content-Type": "application/json; charset=utf-8"})[0] == 200


def test_a_foreign_origin_gets_403_and_no_cors(server: LiveServer) -> None:
    evil = {"Origin": "http://evil.example"}
    for method, path, headers in [("POST", "/v1/completions", evil), ("GET", "/metrics", evil),
                                  ("OPTIONS", "/v1/completions", {**evil, "Access-Control-Request-Method": "POST"}),
                                  ("POST", "/v1/completions", {"Origin": "null"}),
                                  ("POST", "/v1/completions", {"Origin": f"http://localhost:{server.port}"})]:
        status, found, reply = call(server, method, path, json.dumps(BODY).encode(), headers)
        assert status == 403, (method, headers)
        assert_error(reply, "origin_not_allowed")
        assert not [h for h in found if h.startswith("access-control-")]


def test_same_origin_and_allowed_origins_work(server: LiveServer) -> None:
    body = json.dumps(BODY).encode()
    status, found, reply = call(server, "POST", "/v1/completions", body, {"Origin": f"http://127.0.0.1:{server.port}"})
    assert status == 200 and reply["usage"]["completion_tokens"] == 3  # the chat page's own fetch
    assert "access-control-allow-origin" not in found  # same origin needs none
    status, found, reply = call(server, "POST", "/v1/completions", body, {"Origin": NOTEBOOK})
    assert status == 200 and found["access-control-allow-origin"] == NOTEBOOK
    status, found, _ = call(server, "OPTIONS", "/v1/chat/completions", None, {
        "Origin": NOTEBOOK, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200 and found["access-control-allow-origin"] == NOTEBOOK
    assert "POST" in found["access-control-allow-methods"]
    assert "authorization" in found["access-control-allow-headers"].lower()


def test_metrics_need_a_key_when_keys_are_required(engine_dir: Path, tmp_path: Path) -> None:
    with guarded_server(engine_dir, tmp_path, api_keys={"k1": "team"}) as server:
        status, _, reply = call(server, "GET", "/metrics")
        assert status == 401
        assert_error(reply, "invalid_api_key")
        assert call(server, "GET", "/metrics", headers={"Authorization": "Bearer k1"})[0] == 403  # operator keys only
        assert call(server, "GET", "/health")[0] == 200  # probes need no key
        assert call(server, "GET", "/")[0] == 200


# --- bodies ---------------------------------------------------------------------------------------------


def test_a_declared_length_over_the_cap_is_refused_before_reading(server: LiveServer) -> None:
    sock = raw(server, post_head(server, 2**20 + 1))  # no body byte follows
    try:
        started = time.monotonic()
        status, reply = response_of(sock)
        assert status == 413 and time.monotonic() - started < 2
        assert_error(reply, "body_too_large")
    finally:
        sock.close()


def test_a_client_sending_too_much_reads_the_413(server: LiveServer) -> None:
    """Clients write their whole body before they read: the refusal must not reach them as a connection reset."""
    big = json.dumps({**BODY, "padding": "x" * (3 * 2**20)}).encode()
    status, _, reply = call(server, "POST", "/v1/completions", big)  # declared: refused before reading
    assert status == 413
    assert_error(reply, "body_too_large")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:  # undeclared (chunked): refused once the cap is passed
        connection.request("POST", "/v1/completions", body=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                           headers={"Content-Type": "application/json"}, encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 413 and "more than 1,048,576 bytes" in json.loads(response.read())["error"]["message"]
    finally:
        connection.close()
    assert call(server, "POST", "/v1/completions", json.dumps(BODY).encode())[0] == 200


def test_a_body_with_too_many_values_is_refused_unparsed(roomy: LiveServer) -> None:
    body = json.dumps({**BODY, "metadata": [0] * (MAX_JSON_SEPARATORS + 1)}).encode()  # 3 MiB of "0, "
    status, _, reply = call(roomy, "POST", "/v1/completions", body)
    assert status == 413 and "JSON values" in reply["error"]["message"]


@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_a_stalled_body_gets_408_while_health_answers(server: LiveServer) -> None:
    sock = raw(server, post_head(server, 1000), b'{"model": ')  # then nothing
    try:
        started = time.monotonic()
        latencies = []
        while time.monotonic() - started < 0.8:
            before = time.monotonic()
            assert call(server, "GET", "/health")[0] == 200
            latencies.append(time.monotonic() - before)
        status, reply = response_of(sock)
        elapsed = time.monotonic() - started
        assert status == 408 and 0.8 <= elapsed < 3.0  # the server's body_timeout_s is 1 s
        assert_error(reply, "request_timeout")
        assert max(latencies) < 0.5
    finally:
        sock.close()
    assert call(server, "GET", "/health")[0] == 200


def test_uploads_beyond_the_shared_budget_are_refused_not_buffered(server: LiveServer) -> None:
    length = 900 * 1024  # each fits the 1 MiB cap; two fill the 2 MiB budget
    sent = b'{"model": "' + b"x" * (length - 100)  # bytes reserve the budget as they arrive, never declared ones
    slow = [raw(server, post_head(server, length), sent) for _ in range(2)]
    try:
        time.sleep(0.2)  # both are reading (reserved what they sent)
        refused = raw(server, post_head(server, length), sent + b"x" * 100)  # whole: nothing left to drain
        try:
            started = time.monotonic()
            status, reply = response_of(refused)
            assert status == 503 and time.monotonic() - started < 0.9  # before the 1 s body timeout
            assert_error(reply, "overloaded")
        finally:
            refused.close()
    finally:
        for sock in slow:
            sock.close()
    time.sleep(0.3)  # the disconnects give the reservations back
    assert call(server, "POST", "/v1/completions", json.dumps(BODY).encode())[0] == 200
    server.on_engine(idle_audit)


def test_a_large_body_being_parsed_does_not_stall_health(roomy: LiveServer) -> None:
    # Many small objects (a Python call each) and a long string: the costliest parse an allowed body can ask for.
    items = MAX_JSON_SEPARATORS // 2 - 1000
    body = json.dumps({**BODY, "metadata": [{"k": 1}] * items, "padding": "x" * (40 * 2**20)}).encode()
    server = roomy
    latencies: list[float] = []
    result: list[int] = []
    upload = threading.Thread(target=lambda: result.append(call(server, "POST", "/v1/completions", body)[0]))
    upload.start()
    while upload.is_alive():
        before = time.monotonic()
        assert call(server, "GET", "/health")[0] == 200
        latencies.append(time.monotonic() - before)
        time.sleep(0.005)
    upload.join()
    assert result == [200]  # parsed (unknown fields are ignored) and answered
    assert max(latencies) < 0.25, f"/health waited {max(latencies):.3f} s"


# --- shutdown and Ctrl-C --------------------------------------------------------------------------------


def test_a_request_cancelled_by_shutdown_gets_503(engine_dir: Path, tmp_path: Path) -> None:
    with guarded_server(engine_dir, tmp_path) as server:  # shutdown_timeout 0.3 s
        gate = threading.Event()
        server.state.engine_loop.call(lambda _engine: gate.wait(60))  # the engine thread is busy: nothing finishes
        answers: list[tuple[int, Any]] = []
        waiting = threading.Thread(target=lambda: answers.append(server.request("POST", "/v1/completions", BODY)))
        waiting.start()
        deadline = time.monotonic() + 30
        while server.state.in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        threading.Timer(1.5, gate.set).start()
        server.stop()
        waiting.join(30)
        status, reply = answers[0]
        assert status == 503
        assert_error(reply, "unavailable")
        idle_audit(server.state.engine_loop.engine)


# Runs llm_serve's entry point with SIGINT raised when the named module is first imported: at a known point of
# the start-up, whatever the machine's speed.
# SIGINT back to Python's handler first: a shell's background job (pytest run with `&`) starts with SIGINT ignored,
# and the child would inherit that and never see the interrupt.
INTERRUPTED_START = """
import importlib.abc, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
target = sys.argv.pop(1)

class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target_module=None):
        if name == target:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
sys.argv[0] = "llm_serve"
from kvforge.server.cli import main
main()
"""


@pytest.mark.parametrize("module", ["kvforge.runtime.engine.config", "onnxruntime"],
                         ids=["while-importing", "while-the-engine-loads"])
def test_ctrl_c_during_start_up_is_one_line(engine_dir: Path, module: str) -> None:
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "300"}
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_START, module, "--engineDir", str(engine_dir),
                             "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == ["error: interrupted"]


# --- the flags, through llm_serve itself ---------------------------------------------------------------


@pytest.mark.parametrize(("args", "flag"), [(["--maxBodyBytes", "0"], "--maxBodyBytes"),
                                            (["--maxBodyBytesInFlight", "10"], "--maxBodyBytesInFlight"),
                                            (["--bodyTimeout", "-1"], "--bodyTimeout"),
                                            (["--maxConnections", "0"], "--maxConnections"),
                                            (["--allowedOrigins", "notebook.test"], "--allowedOrigins")])
def test_bad_edge_flags_are_one_line(engine_dir: Path, args: list[str], flag: str) -> None:
    result = subprocess.run([str(BIN_DIR / "llm_serve"), "--engineDir", str(engine_dir), "--port", "0", *args],
                            capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                            env={**os.environ, "NO_COLOR": "1", "COLUMNS": "300"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and flag in lines[0], result.stderr


def test_the_flags_reach_the_server(engine_dir: Path) -> None:
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "300"}
    process = subprocess.Popen([str(BIN_DIR / "llm_serve"), "--engineDir", str(engine_dir), "--port", "0",
                                "--allowedHosts", "llm.test,other.test", "--allowedOrigins", NOTEBOOK,
                                "--maxBodyBytes", "4096", "--servedModelName", MODEL],
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stderr is not None
        port = None
        for line in process.stderr:
            if "127.0.0.1:" in line and port is None:
                port = int(line.split("127.0.0.1:")[1].split("/")[0])
            if "Application startup complete" in line:
                break
        assert port is not None
        live = Spawned(port)
        body = json.dumps(BODY).encode()
        assert call(live, "POST", "/v1/completions", body, {"Host": "llm.test", "Origin": NOTEBOOK})[0] == 200
        assert call(live, "GET", "/health", headers={"Host": f"other.test:{port}"})[0] == 200
        assert call(live, "GET", "/health", headers={"Host": "evil.test"})[0] == 400
        assert call(live, "POST", "/v1/completions", json.dumps({**BODY, "pad": "x" * 5000}).encode())[0] == 413
        process.send_signal(signal.SIGINT)
        assert process.wait(CLI_TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(CLI_TIMEOUT_S)
