"""What a huge request costs before it is refused, and what another client sees meanwhile.

    .venv/bin/python -m experiments.server.server_admission --engineDir out/engines/smollm2 [--json out/admission.json]

Run it with another checkout's interpreter
(`/path/to/other/.venv/bin/python -m experiments.server.server_admission ...`) to measure that code: each case runs
in a fresh process of the interpreter given by --python (default: this one).

1. completion: llm_serve in-process; one client streams a greedy answer while another posts a 12 MiB
   /v1/completions prompt. Reported: the refusal's wall time, the RSS the process grew by, and the streaming
   client's largest and median inter-token gap, next to its median gap alone.
2. chat file: llm_inference on a file with one request of 64 messages of 128 KB each. Reported: wall time and
   peak RSS of the whole process (its start included, shown alone as `baseline`: a one-message file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER_CASE = r"""
import json, resource, statistics, sys, threading, time
import http.client
import uvicorn
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.server.app import create_app
from kvforge.server.cli import bind_socket
from kvforge.server.tenants import load_tenants

engine = Engine(sys.argv[1], EngineConfig(num_threads=2, enable_context_reuse=True))
app = create_app(engine, load_tenants(None, None), model_name="m", max_queued_requests=8)
sock = bind_socket("127.0.0.1", 0)
port = sock.getsockname()[1]
server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
while not server.started:
    time.sleep(0.02)

def post(body, stream=False):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if not stream:
        text = response.read()
        connection.close()
        return response.status, text
    gaps, last = [], None
    for line in response:
        if not line.startswith(b"data:"):
            continue
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
    connection.close()
    return gaps

normal = {"model": "m", "prompt": "The harbor at dawn was", "max_tokens": 200, "temperature": 0, "stream": True,
          "reuse_context": False}
alone = post(normal, stream=True)
rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = {}
def hostile():
    time.sleep(0.3)  # the stream is flowing
    started = time.perf_counter()
    status, _ = post({"model": "m", "prompt": "tide " * (12 * 2**20 // 5), "max_tokens": 4})
    result.update(status=status, refusal_s=time.perf_counter() - started)
attacker = threading.Thread(target=hostile)
attacker.start()
beside = post(normal, stream=True)
attacker.join()
result.update(rss_growth_mb=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024,
              itl_alone_median_ms=statistics.median(alone) * 1e3, itl_beside_median_ms=statistics.median(beside) * 1e3,
              itl_beside_max_ms=max(beside) * 1e3, stream_s=sum(beside))
server.should_exit = True
print(json.dumps(result))
"""

FILE_CASE = r"""
import json, resource, sys, time
from kvforge.cli_common import run_app
from kvforge.runtime.cli import app
sys.argv = ["llm_inference", *sys.argv[1:]]
started = time.perf_counter()
code = 0
try:
    run_app(app)
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "wall_s": time.perf_counter() - started,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), file=sys.stderr)
"""


def run_case(python: str, script: str, *args: str) -> dict:
    # From a neutral directory: a checkout's own `kvforge/` folder must not shadow the interpreter's install.
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, timeout=900,
                              check=False, cwd=cwd)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"the case failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def chat_file(path: Path, messages: int, content_bytes: int) -> Path:
    content = ("tide " * (content_bytes // 5 + 1))[:content_bytes]
    request = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": content}
                            for i in range(messages)]}
    path.write_text(json.dumps({"max_generate_length": 2, "requests": [request]}), encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engineDir", required=True)
    parser.add_argument("--python", default=sys.executable, help="the interpreter (and so the checkout) to measure")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict = {"python": args.python}
    report["completion_12mib"] = run_case(args.python, SERVER_CASE, args.engineDir)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, messages, size in (("baseline", 1, 16), ("chat_64x128kb", 64, 128_000)):
            path = chat_file(root / f"{name}.json", messages, size)
            report[name] = run_case(args.python, FILE_CASE, "--engineDir", args.engineDir, "--inputFile", str(path),
                                    "--outputFile", str(root / f"{name}.out.json"))
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
