"""The llm_serve console script: one-line errors for bad flags, and SIGTERM lets requests in flight finish."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import BIN_DIR, CLI_TIMEOUT_S
from support.server_harness import build_server_engine

from kvforge.server.cli import bind_socket


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("serve_cli_engine"))


def one_line_error(result: subprocess.CompletedProcess[str], flag: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}"), result.stderr


@pytest.mark.parametrize(("args", "flag"), [
    (["--maxQueuedRequests", "-1"], "--maxQueuedRequests"),
    (["--loraWeights", "no-equals-sign"], "--loraWeights"),
    (["--loraWeights", "a=/nowhere.safetensors"], "--loraWeights"),
    (["--port", "70000"], "--port"),
    (["--shutdownTimeout", "-2"], "--shutdownTimeout"),
    (["--disableContextReuse", "--contextCacheRecurrentSnapshotPoolBytes", "1000000"],
     "--contextCacheRecurrentSnapshotPoolBytes"),
    (["--disableContextReuse", "--contextCachePartialKVSnapshotPoolBytes", "1000000"],
     "--contextCachePartialKVSnapshotPoolBytes"),
    (["--disableContextReuse", "--enableContextReuse"], "--disableContextReuse"),
    (["--enableContextReuse", "--contextCacheRecurrentSnapshotPoolBytes", "1000000"],
     "--contextCacheRecurrentSnapshotPoolBytes"),  # an attention-only engine has no recurrent state
    (["--disableContextReuse", "--sharedCache", "redis://127.0.0.1:1/0"], "--sharedCache"),  # needs reuse
    # Salts from a per-process random secret would never match another server's: refused, not a silent 0 % hit.
    (["--sharedCache", "redis://127.0.0.1:1/0"], "--saltSecret"),
])
def test_bad_flags_are_one_line(engine_dir: Path, run_cli: Callable[..., Any], args: list[str], flag: str) -> None:
    one_line_error(run_cli(["llm_serve", "--engineDir", engine_dir, *args]), flag)


def test_bad_files_and_a_taken_port_are_one_line(engine_dir: Path, run_cli: Callable[..., Any],
                                                 tmp_path: Path) -> None:
    one_line_error(run_cli(["llm_serve", "--engineDir", tmp_path / "missing"]), "--engineDir")
    keys = tmp_path / "keys.json"
    for content in ("{not json", "[]", '{"": "team"}', '{"key": 3}'):
        keys.write_text(content)
        one_line_error(run_cli(["llm_serve", "--engineDir", engine_dir, "--apiKeys", keys]), "--apiKeys")
    secret = tmp_path / "secret"
    secret.write_text("short")
    one_line_error(run_cli(["llm_serve", "--engineDir", engine_dir, "--saltSecret", secret]), "--saltSecret")
    taken = bind_socket("127.0.0.1", 0)
    try:
        one_line_error(run_cli(["llm_serve", "--engineDir", engine_dir, "--port", taken.getsockname()[1]]), "--port")
    finally:
        taken.close()


class ServeProcess:
    """`llm_serve` in a subprocess on a free loopback port; stderr is collected while it runs."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "300"}
        self.process = subprocess.Popen([str(BIN_DIR / "llm_serve"), "--port", "0", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.url: str | None = None
        self.started = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert self.started.wait(CLI_TIMEOUT_S) and self.url, "llm_serve did not start:\n" + self.stderr

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            found = re.search(r"at (http://\S+)/v1 ", line)
            if found:
                self.url = found.group(1)
            if "Uvicorn running" in line or "Application startup complete" in line:
                self.started.set()
        self.started.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(CLI_TIMEOUT_S)


def test_sigterm_lets_requests_in_flight_finish(engine_dir: Path) -> None:
    server = ServeProcess(["--engineDir", str(engine_dir), "--enableContextReuse", "--numThreads", "2"])
    try:
        stderr_start = server.stderr
        assert "listening on 127.0.0.1 only" in stderr_start  # no --apiKeys: loopback, and it says so
        # llm_build's partial-KV budget (64 slots) came with reuse; the engine runs 4 rows, so no one-at-a-time note
        assert "context reuse on, to the token in cached tails (64 partial-KV snapshot slots)" in stderr_start
        assert "one request at a time" not in stderr_start
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            model = client.models.list().data[0].id
            assert model == engine_dir.name
            stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=300, stream=True,
                                               stream_options={"include_usage": True}, logit_bias={"2": -100})
            chunks = iter(stream)
            next(chunks)
            server.process.send_signal(signal.SIGTERM)
            rest = list(chunks)
        assert rest[-1].usage.completion_tokens == 300  # it finished after the signal
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
        assert server.process.wait(CLI_TIMEOUT_S) == 0
        server.reader.join(CLI_TIMEOUT_S)
        assert "Shutting down" in server.stderr and "stopping the engine (0 request(s)" in server.stderr
        assert "Traceback" not in server.stderr
    finally:
        server.stop()


def test_api_keys_change_the_start_message(engine_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"secret-key": "team"}))
    server = ServeProcess(["--engineDir", str(engine_dir), "--apiKeys", str(keys), "--servedModelName", "m",
                           "--disableContextReuse"])
    try:
        assert "API keys required" in server.stderr and "context reuse off" in server.stderr
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="secret-key", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == ["m"]
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(CLI_TIMEOUT_S) == 0  # Ctrl-C stops it as cleanly as SIGTERM
        server.reader.join(CLI_TIMEOUT_S)
        assert "Application shutdown complete" in server.stderr and "error" not in server.stderr
    finally:
        server.stop()
