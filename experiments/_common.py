"""Helpers shared by the engine-level benches: command line, workload text, engines, medians, progress.

Imported as `experiments._common` by the scripts of every topic folder (run from the repository root as
`python -m experiments.TOPIC.NAME`, which puts the root on sys.path); not part of the kvforge package. Helpers one
topic shares live in that folder's `_common.py`; a script never imports another script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.engine.output import RequestOutput
from kvforge.runtime.execution.backend import Backend
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import Message, Request, SamplingParams

# The workload text lives in the package, where llm_bench reads it too; the scripts import it from here.
from kvforge.tools.bench.text import DOCUMENT_SECTIONS, GLOSSARY, fit_document, text_tokens  # noqa: F401

# --- command line -------------------------------------------------------------------------------------


def bench_parser(doc: str, repeats: int = 3, onnx_dir: bool = True) -> argparse.ArgumentParser:
    """--onnxDir (unless the bench exports its own model), --threads, --repeats and --json, which every engine-level
    bench takes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if onnx_dir:
        parser.add_argument("--onnxDir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser


def write_json(path: Path | None, figures: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(figures, indent=2) + "\n")


class Progress:
    """Elapsed time and load average on stderr, so a slow run shows whether the machine was busy."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.load_start = os.getloadavg()

    def __call__(self, step: str) -> None:
        print(f"[{self.elapsed:5.0f}s, load {os.getloadavg()[0]:.2f}] {step}", file=sys.stderr)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# --- engines ------------------------------------------------------------------------------------------


def build_and_open(onnx_dir: Path, engine_dir: Path, options: BuildOptions, threads: int,
                   reuse: bool = False, runner: Backend | None = None, **config: Any) -> Engine:
    """Build `onnx_dir` into `engine_dir` (once) and open an Engine on it."""
    if not (engine_dir / "config.json").is_file():
        build_engine(onnx_dir, engine_dir, options)
    return Engine(engine_dir, EngineConfig(num_threads=threads, enable_context_reuse=reuse, **config), backend=runner)


def greedy(max_generate_length: int, **changes: Any) -> SamplingParams:
    """Greedy decoding (top_k 1, so no draw and no seed matters)."""
    return SamplingParams(temperature=1.0, top_k=1, top_p=1.0, max_generate_length=max_generate_length, **changes)


def chat_request(engine: Engine, text: str, sampling: SamplingParams) -> EngineRequest:
    """One user message through the engine's chat template."""
    return engine.inputs.process(Request(index=0, messages=[Message("user", text)], sampling=sampling,
                                         apply_chat_template=True, add_generation_prompt=True))


def run_alone(engine: Engine, request: EngineRequest) -> RequestOutput:
    """Run one request to its end on counters reset first (so `engine.profile()` describes it alone)."""
    engine.reset_counters()
    request_id = engine.add_request(request)
    output: RequestOutput | None = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                output = out
    assert output is not None and output.timing is not None
    return output


# --- a script that runs itself again in a fresh process (quality.py's variants, shared_tier.py's workers) -----

ROOT = Path(__file__).resolve().parents[1]  # the repository root, above experiments/


def rerun_command(module: str) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run script module `module` (its `__spec__.name`, e.g. `experiments.quality.quality`) in a
    fresh interpreter: `python -m`, with the repository root first on PYTHONPATH so `experiments` imports from any
    working directory."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *([path] if path else [])])}
    return [sys.executable, "-m", module], env


# --- models in torch (imported inside: a bench that never asks for one needs no torch) ----------------------

def tiny_llama(seed: int) -> Any:
    """A 4-layer float32 llama with weights large enough for peaked next-token distributions."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    return model


def torch_llama(loaded: Any) -> Any:
    """transformers' float32 LlamaForCausalLM holding a loaded model's weights (kvforge's own loader, e.g. the
    SmolLM2 GGUF: scripts/train_eagle3.py's target, experiments.adapters.adapter_correction's reference), refusing
    weights that do not fit the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = loaded.config
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                         tie_word_embeddings=c.tie_word_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
    model = LlamaForCausalLM(config).eval()
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in loaded.weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"weights do not fit the torch model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if c.tie_word_embeddings:
        model.tie_weights()
    return model


# --- a live llm_serve process (serve.py, server_load.py, shared_tier.py) -----------------------------------

START_TIMEOUT_S = 300


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Server:
    def __init__(self, engine_dir: Path, threads: int, reuse: bool, extra_args: list[str] | None = None) -> None:
        args = [str(Path(sys.executable).parent / "llm_serve"), "--engineDir", str(engine_dir), "--port", "0",
                "--numThreads", str(threads), "--servedModelName", "smollm2", "--maxQueuedRequests", "64",
                *(extra_args or [])]
        self.process = subprocess.Popen(args + (["--enableContextReuse"] if reuse else []), stderr=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, text=True, env={**os.environ, "NO_COLOR": "1"})
        self.url: str | None = None
        ready = threading.Event()

        def read() -> None:
            assert self.process.stderr is not None
            for line in self.process.stderr:
                found = re.search(r"at (http://\S+/v1) ", line)
                self.url = found.group(1) if found else self.url
                if "startup complete" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(START_TIMEOUT_S) or self.url is None:
            raise SystemExit("llm_serve did not start")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
