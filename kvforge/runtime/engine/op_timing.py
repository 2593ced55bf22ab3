"""Where an engine's time goes, per op type (`llm_build --profileOps`): ONNX Runtime's per-node trace of one prefill
and its decode steps, summed per op and set beside the Python time around each call. Not the profile JSON: that is
kvforge/runtime/profile.py (written by llm_inference) and kvforge/tools/profile/ (llm_profile, which reads it)."""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR, load_engine_dir
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.safetensors_map import map_tensor
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.execution.backend import ForwardOutput, StepInputs
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams

PHASES = ("prefill", "decode")


@dataclass(slots=True)
class _Call:
    tokens: int  # new tokens in the call (the widest row)
    forward_s: float  # OrtBackend.forward: binding, page table, ONNX Runtime, K/V scatter
    step_s: float = 0.0  # the Engine.step that made the call: + scheduling, embedding lookup, sampling
    ort_us: float = 0.0  # ONNX Runtime's model_run
    ops_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    nodes: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class _TimedBackend:
    """Records each forward call's width and wall time around the real backend."""

    def __init__(self, inner: OrtBackend) -> None:
        self.inner, self.calls = inner, []
        self.kv_store = inner.kv_store

    def forward(self, step: StepInputs) -> ForwardOutput:
        start = time.perf_counter()
        output = self.inner.forward(step)
        self.calls.append(_Call(int(step.context_lengths.max()), time.perf_counter() - start))
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def profile_ops(engine_dir: Path, prompt_tokens: int = 512, decode_tokens: int = 32,
                num_threads: int = 0, top: int = 10) -> dict[str, Any]:
    """Run one request of `prompt_tokens` (a whole-prompt prefill) and up to `decode_tokens` decode steps with
    ONNX Runtime profiling on; per phase: calls, ms per call (engine step, ONNX Runtime, Python in the runner,
    Python in the engine) and the top op types by time."""
    engine = load_engine_dir(engine_dir)
    if engine.build.backend != "onnxruntime":
        raise InvalidConfig("op profiles come from ONNX Runtime; this engine was built for "
                            f"{engine.build.backend}", "--profileOps")
    if not 1 <= prompt_tokens <= engine.build.max_input_len:
        raise InvalidConfig(f"must be in [1, maxInputLen={engine.build.max_input_len}], got {prompt_tokens}",
                            "--profilePromptTokens")
    embedding = map_tensor(engine.file(EMBEDDING_FILE), EMBEDDING_TENSOR)
    with tempfile.TemporaryDirectory(prefix="kvforge-ops-") as tmp:
        backend = _TimedBackend(OrtBackend(engine, num_threads, embedding, profile_prefix=f"{tmp}/ort"))
        llm = Engine(engine_dir, EngineConfig(num_threads=num_threads, prefill_chunk_size=0), backend=backend)
        vocab = engine.model.vocab_size
        prompt = ((np.arange(prompt_tokens) * 7919) % max(vocab - 512, 1) + 256).tolist()  # ordinary tokens
        budget = min(decode_tokens + 1, engine.build.max_kv_cache_capacity - prompt_tokens)
        llm.add_request(EngineRequest(prompt, SamplingParams(temperature=0.0, max_generate_length=max(budget, 1))))
        while llm.has_unfinished():
            before, start = len(backend.calls), time.perf_counter()
            llm.step()
            for call in backend.calls[before:]:
                call.step_s = (time.perf_counter() - start) / (len(backend.calls) - before)
        trace = json.loads(Path(backend.inner.session.end_profiling()).read_text())
    _attribute(trace, backend.calls)
    return _summary(backend.calls, top, prompt_tokens)


def _attribute(trace: list[dict[str, Any]], calls: list[_Call]) -> None:
    """Give each node event to the model_run that encloses it (runs appear in call order)."""
    runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    runs = runs[-len(calls):] if len(runs) >= len(calls) else runs
    starts = np.array([r["ts"] for r in runs])
    for call, run in zip(calls, runs, strict=False):
        call.ort_us = float(run["dur"])
    for event in trace:
        if event.get("cat") != "Node" or not str(event.get("name", "")).endswith("_kernel_time"):
            continue
        index = int(np.searchsorted(starts, event["ts"], side="right")) - 1
        if 0 <= index < len(calls):
            op = event.get("args", {}).get("op_name", "?")
            calls[index].ops_us[op] += float(event["dur"])
            calls[index].nodes[op] += 1


def _summary(calls: list[_Call], top: int, prompt_tokens: int) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    # The whole prompt is one call (prefill_chunk_size=0, prompt <= maxInputLen); every later call decodes.
    for phase, chosen in zip(PHASES, (calls[:1], calls[1:]), strict=True):
        if not chosen:
            continue
        n = len(chosen)
        ops_us: dict[str, float] = defaultdict(float)
        nodes: dict[str, int] = {}
        for call in chosen:
            for op, us in call.ops_us.items():
                ops_us[op] += us
                nodes[op] = call.nodes[op]
        ort_ms = sum(c.ort_us for c in chosen) / n / 1e3
        forward_ms = sum(c.forward_s for c in chosen) / n * 1e3
        step_ms = sum(c.step_s for c in chosen) / n * 1e3
        kernel_ms = sum(ops_us.values()) / n / 1e3
        phases[phase] = {
            "calls": n,
            "tokens_per_call": sum(c.tokens for c in chosen) / n,
            "ms_per_call": {"engine_step": step_ms, "onnxruntime_run": ort_ms, "kernels": kernel_ms,
                            "python_in_runner": max(forward_ms - ort_ms, 0.0),
                            "python_in_engine": max(step_ms - forward_ms, 0.0)},
            "top_ops": [{"op": op, "ms_per_call": us / n / 1e3, "share_pct": 100 * us / max(sum(ops_us.values()), 1e-9),
                         "nodes": nodes[op]}
                        for op, us in sorted(ops_us.items(), key=lambda kv: -kv[1])[:top]],
        }
    return {"prompt_tokens": prompt_tokens, "phases": phases}


def format_op_profile(profile: dict[str, Any]) -> str:
    lines = []
    for phase, data in profile["phases"].items():
        t = data["ms_per_call"]
        lines.append(f"{phase}: {data['calls']} call(s) of {data['tokens_per_call']:.0f} token(s); per call "
                     f"{t['engine_step']:.2f} ms = ONNX Runtime {t['onnxruntime_run']:.2f} + Python in runner "
                     f"{t['python_in_runner']:.2f} + Python in engine {t['python_in_engine']:.2f}")
        for row in data["top_ops"]:
            lines.append(f"  {row['op']:32} {row['ms_per_call']:9.3f} ms {row['share_pct']:6.1f} %  "
                         f"({row['nodes']} nodes)")
    return "\n".join(lines)
