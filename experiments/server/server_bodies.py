"""What a huge request body costs llm_serve: time to its answer, server memory added, /health latency meanwhile.

    .venv/bin/python -m experiments.server.server_bodies [--json out/server_bodies.json]

Each case runs against a fresh server process (a tiny synthetic engine, defaults otherwise) so its peak RSS
(VmHWM) belongs to that body alone. While the body uploads and is parsed, another client polls /health every
10 ms. Run it with another checkout's interpreter
(e.g. /work/main/.venv/bin/python -m experiments.server.server_bodies) to measure that code: the script only uses
create_app, bind_socket and the exporter, which both have.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 2**20
SERVER = """
import sys, uvicorn
from pathlib import Path
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.server.app import create_app
from kvforge.server.cli import bind_socket
from kvforge.server.tenants import load_tenants
engine = Engine(Path(sys.argv[1]), EngineConfig(num_threads=1))
app = create_app(engine, load_tenants(None, None), model_name="tiny", max_queued_requests=64)
sock = bind_socket("127.0.0.1", 0)
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="error")).run(sockets=[sock])
"""


def build_engine(root: Path) -> Path:
    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    write_onnx_dir(synthetic_model("tiny-llama"), root / "onnx")
    build_engine(root / "onnx", root / "engine", BuildOptions(max_input_len=256, max_kv_cache_capacity=512,
                                                              max_batch_size=4, tokens_per_page=16))
    return root / "engine"


def hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def post(port: int, body: bytes, timeout: float = 300) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")[:200]
    except (TimeoutError, ConnectionError) as exc:  # a server that answers before reading may reset the upload
        return -1, type(exc).__name__
    finally:
        connection.close()


def health_ms(port: int) -> float:
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", "/health")
        connection.getresponse().read()
    finally:
        connection.close()
    return (time.perf_counter() - started) * 1e3


def run_case(engine: Path, name: str, body: bytes) -> dict[str, Any]:
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(engine)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        for _ in range(200):  # started: /health answers
            try:
                health_ms(port)
                break
            except OSError:
                time.sleep(0.05)
        post(port, json.dumps({"model": "tiny", "prompt": "warm", "max_tokens": 2}).encode())
        baseline = hwm_kib(server.pid)
        latencies: list[float] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                latencies.append(health_ms(port))
                time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        started = time.perf_counter()
        status, text = post(port, body)
        elapsed = time.perf_counter() - started
        done.set()
        poller.join()
        return {"case": name, "body_mib": round(len(body) / MiB, 1), "status": status, "seconds": round(elapsed, 3),
                "rss_added_mib": round((hwm_kib(server.pid) - baseline) / 1024, 1),
                "health_max_ms": round(max(latencies), 1), "health_p50_ms": round(statistics.median(latencies), 1),
                "answer": text[:100]}
    finally:
        server.terminate()
        server.wait(30)


def cases(largest: int) -> dict[str, bytes]:
    def padded(padding: Any) -> bytes:
        return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1, "padding": padding}).encode()

    return {"126MiB string": padded("x" * (126 * MiB)),
            "126MiB of small ints": padded([1] * (126 * MiB // 3)),
            f"{largest // MiB}MiB string (largest allowed)": padded("x" * (largest - 200)),
            f"{largest // MiB}MiB of small ints": padded([1] * ((largest - 200) // 3))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--largest", type=int, default=50 * MiB, help="the largest allowed body (today's default)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(Path(tmp))
        rows = [run_case(engine, name, body) for name, body in cases(args.largest).items()]
    code = Path(__import__("kvforge").__file__).resolve().parents[1]
    print(f"code: {code} (pid {os.getpid()})")
    for row in rows:
        print(f"{row['case']:34} {row['body_mib']:>6} MiB  status {row['status']:>4}  {row['seconds']:>7.3f} s  "
              f"+{row['rss_added_mib']:>7.1f} MiB RSS  /health max {row['health_max_ms']:>7.1f} ms "
              f"(p50 {row['health_p50_ms']} ms)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"code": str(code), "rows": rows}, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
