"""llm_bench's side of the worker processes: one process per engine (kvforge.tools.bench.worker), driven by JSON
lines, so each engine loads and runs alone and one that crashes fails only its own results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Any

from rich.markup import escape

from kvforge.cli_common import console
from kvforge.tools.bench.engines import EngineSpec

Entry = tuple[EngineSpec, str | None]  # an engine and why it is skipped (None: it runs)


class WorkerFailed(Exception):
    pass


class Worker:
    """One engine's process (kvforge.tools.bench.worker): a JSON line per command, a JSON line per reply; its
    stderr (progress) is shown as it comes, and its last lines explain a failure."""

    def __init__(self, job: dict[str, Any], work: Path) -> None:
        self.name = job["engine"]["name"]
        job_path = work / f"{len(list(work.iterdir()))}.job.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        threads = str(job["threads"])
        # Same thread count for every library an engine may use; no progress bars or hub lookups from peers.
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_VERBOSITY": "error"}
        self.process = subprocess.Popen([sys.executable, "-m", "kvforge.tools.bench.worker", str(job_path)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env)
        self.tail: deque[str] = deque(maxlen=20)
        self.reader = threading.Thread(target=self._show_stderr, daemon=True)
        self.reader.start()

    def _show_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if line.strip():
                self.tail.append(line.rstrip())
                console.print(f"  [dim]{escape(line.rstrip())}[/]")

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            self.reader.join(timeout=5)
            raise WorkerFailed(failure(code, list(self.tail)))
        return json.loads(line)

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it died: read() says how
        return self.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def failure(code: int, tail: list[str]) -> str:
    """One line for a worker that did not finish: the exception it raised, or how it died."""
    if any(line.startswith("Traceback") for line in tail):
        return tail[-1][:300]
    how = f"crashed ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"
    return f"{how}{'; last output: ' + tail[-1][:200] if tail else ''}"


def run_engines(entries: list[Entry], job: dict[str, Any]) -> list[dict[str, Any]]:
    """Every engine in a process of its own, loaded one after another; then each repeat runs on one engine at a time,
    engines in turn (the order rotating per repeat), so load that drifts on a shared machine weighs on all alike."""
    results: dict[str, dict[str, Any]] = {}
    workers: list[Worker] = []
    with tempfile.TemporaryDirectory(prefix="llm_bench-") as tmp:
        try:
            for index, (spec, reason) in enumerate(entries, 1):
                where = f"[{index}/{len(entries)}] {spec.name}"
                base = {"name": spec.name, "kind": spec.kind, "spec": spec.to_json()}
                if reason is not None:
                    console.print(f"{where}: [yellow]skipped[/]: {escape(reason)}")
                    results[spec.name] = {**base, "status": "skipped", "reason": reason}
                    continue
                console.print(f"{where} ({spec.kind}): loading, load average {os.getloadavg()[0]:.2f}")
                worker = Worker({**job, "engine": spec.to_json()}, Path(tmp))
                results[spec.name] = {**base, "status": "ok", "workloads": {w["name"]: [] for w in job["workloads"]}}
                _step(worker, {}, results, workers)
            for repeat in range(job["repeats"]):
                shift = repeat % len(workers) if workers else 0
                for worker in workers[shift:] + workers[:shift]:
                    _step(worker, {"run": repeat}, results, workers)
            for worker in list(workers):
                _step(worker, {"quit": True}, results, workers)
        finally:
            for worker in workers:
                worker.stop()
    return [results[spec.name] for spec, _ in entries]


def _step(worker: Worker, command: dict[str, Any], results: dict[str, dict[str, Any]], workers: list[Worker]) -> None:
    """One command to a worker ({} = wait until it is ready); its reply goes into its result, and a worker that
    fails is marked failed and dropped while the others go on."""
    result = results[worker.name]
    if result["status"] != "ok":
        return
    try:
        reply = worker.call(command) if command else worker.read()
    except WorkerFailed as exc:
        console.print(f"{worker.name}: [red]failed[/]: {escape(str(exc))}")
        results[worker.name] = {k: v for k, v in result.items() if k != "workloads"}
        results[worker.name].update(status="failed", reason=str(exc))
        if worker in workers:
            workers.remove(worker)
        worker.stop()
        return
    if not command:
        workers.append(worker)
        result.update({k: v for k, v in reply.items() if k != "ready"})
    elif "run" in command:
        for name, traces in reply["workloads"].items():
            result["workloads"][name].append(traces)
    else:
        result["peak_rss_bytes"] = reply["peak_rss_bytes"]
        result["skipped_points"] = reply.get("skipped_points", {})
        worker.process.wait()
