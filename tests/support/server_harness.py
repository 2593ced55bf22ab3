"""Test helpers for llm_serve: a tiny engine roomy enough for chat templates, and a live server on 127.0.0.1.

The server runs in-process (uvicorn in a thread, on a socket bound to a free loopback port) and stops by
itself when the `with` block ends; `LiveServer.on_engine` runs a function on the engine thread, which is
how tests audit the cache without touching the engine from another thread.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from kvforge.builder.build import BuildOptions
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.execution.load import load_backend
from kvforge.server.app import create_app
from kvforge.server.cli import bind_socket
from kvforge.server.handle import ServerState
from kvforge.server.media import MediaPolicy
from kvforge.server.tenants import load_tenants
from support.backends import FlakyBackend
from support.engine_driver import assert_idle, build_once

T = TypeVar("T")
# Byte-level tokenizer (one token per byte): 256 input tokens hold a chat template and a few sentences.
SERVER_BUILD = BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=4, tokens_per_page=16)
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
MODEL = "tiny"


def build_server_engine(onnx_dir: Path, engine_dir: Path) -> Path:
    """The server tests' engine of `onnx_dir`, built once per session (support.engine_driver.build_once); read-only."""
    return build_once(onnx_dir, engine_dir, SERVER_BUILD)


class LiveServer:
    def __init__(self, server: uvicorn.Server, thread: threading.Thread, port: int, state: ServerState) -> None:
        self.server, self.thread, self.state, self.port = server, thread, state, port
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """A plain HTTP call (no client-side checks): (status, decoded JSON body or the text)."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            response = connection.getresponse()
            text = response.read().decode("utf-8")
        finally:
            connection.close()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text

    def on_engine(self, fn: Callable[[Engine], T], timeout: float = 30.0) -> T:
        return self.state.engine_loop.call(fn).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(STOP_TIMEOUT_S)
        assert not self.thread.is_alive(), "the server did not stop"


@contextmanager
def live_server(engine_dir: Path, tmp_path: Path, *, reuse: bool = True, api_keys: dict[str, Any] | None = None,
                max_queued_requests: int = 64, shutdown_timeout: float = 10.0,
                lora_weights: dict[str, str] | None = None, media: MediaPolicy | None = None,
                app_options: dict[str, Any] | None = None, **config: Any) -> Iterator[LiveServer]:
    keys_file = None
    if api_keys is not None:
        keys_file = tmp_path / "keys.json"
        keys_file.write_text(json.dumps(api_keys), encoding="utf-8")
    threads = config.pop("num_threads", 2)
    backend = FlakyBackend(load_backend(load_engine_dir(engine_dir), threads))
    engine = Engine(engine_dir, EngineConfig(num_threads=threads, enable_context_reuse=reuse, **config),
                    backend=backend)
    if lora_weights:
        engine.load_adapters(lora_weights)
    app = create_app(engine, load_tenants(keys_file, None), model_name=MODEL, max_queued_requests=max_queued_requests,
                     media=media, **(app_options or {}))
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    live = LiveServer(server, thread, port, app.state.kvforge)
    try:
        yield live
    finally:
        if thread.is_alive():
            live.stop()
        sock.close()


def idle_audit(engine: Engine) -> dict[str, int]:
    """engine_driver.assert_idle (every page free or held by a record), run where the engine lives; the counts."""
    assert_idle(engine)
    cache = engine.cache
    cached_pages = {p for r in cache.records.least_recent_first() for p in r.page_ids}
    return {"free": cache.pages.num_free, "cached": len(cached_pages), "records": len(cache.records)}


@contextmanager
def audited_client(server: LiveServer) -> Iterator[Any]:
    """The official `openai` client on `server`; afterwards the engine must be idle (no leaked page or sequence,
    whatever the test did)."""
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as api:
        yield api
    server.on_engine(idle_audit)


def http_call(port: int, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    """(status, body text) of a GET (no `body`) or a JSON POST to 127.0.0.1:`port`: a server the test started
    as a process (a router, a replica), outside `live_server`."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is None:
            connection.request("GET", path)
        else:
            connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()
