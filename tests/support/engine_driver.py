"""Test helpers that drive the product's own loop (`run_request_file` over `Engine.step`), with audits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.lora import LORA_TARGETS
from kvforge.runtime.context_cache.types.partial_tails import partial_slot
from kvforge.runtime.engine.engine import Engine, EngineConfig, EngineRequest
from kvforge.runtime.engine.output import RequestOutput
from kvforge.runtime.execution.backend import Backend
from kvforge.runtime.file_loop import Scheduling, prepare_requests, run_request_file
from kvforge.runtime.inputs.request_file import parse_request_file
from kvforge.runtime.media_spans import DocumentSpan
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.lora import write_converted_adapter, write_random_peft_adapter
from kvforge.tools.export.sources.base import LoadedModel
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

_BUILT: dict[tuple[str, BuildOptions], Path] = {}


def build_once(onnx_dir: Path, engine_dir: Path, build: BuildOptions) -> Path:
    """`build_engine` once per session for an ONNX dir and a geometry: the first caller's `engine_dir`, returned to
    every later caller whatever dir it names (the same engine is built at a dozen sites otherwise). Tests only read
    these dirs; copy one to change it."""
    key = (str(Path(onnx_dir).resolve()), build)
    if key not in _BUILT:
        build_engine(onnx_dir, engine_dir, build)
        _BUILT[key] = Path(engine_dir)
    return _BUILT[key]


def make_engine(engine_dir: Path, runner: Backend | None = None, *, reuse: bool = False,
                num_pages: int | None = None, **config: Any) -> Engine:
    """Engines may share a runner one after another (a fresh cache treats every page as free and pages are
    written before they are read), never interleaved: a warm cache needs its pages left alone. `num_pages` runs
    on the first pages only, to force waiting, eviction, preemption and snapshot pressure."""
    return Engine(engine_dir, EngineConfig(num_threads=config.pop("num_threads", 2), enable_context_reuse=reuse,
                                           **config), backend=runner, num_pages=num_pages)


def run_file(engine: Engine, data: dict, scheduling: Scheduling = Scheduling.STATIC,
             base_dir: Path | None = None) -> list[dict]:
    """Run a request file (as a dict) to completion; then audit the cache and check every page came back."""
    request_file = parse_request_file(data)
    responses = run_request_file(engine, request_file, prepare_requests(engine, request_file, base_dir), scheduling)
    assert_idle(engine)
    return responses


def assert_idle(engine: Engine) -> None:
    cache = engine.cache
    cache.check_invariants()
    assert not cache.leases and not engine.has_unfinished()
    cached_pages = {p for r in cache.records.least_recent_first() for p in r.page_ids}
    assert cache.pages.num_free == cache.pages.capacity - len(cached_pages)  # nothing leaked
    snapshots = [partial_slot(r) for r in cache.records.least_recent_first() if partial_slot(r) is not None]
    assert cache.partial_snapshots.num_free == cache.partial_snapshots.capacity - len(snapshots)


def top1_ids(response: dict) -> list[int]:
    return [step[0]["token_id"] for step in response["logprobs"]]


def lora_model_with_adapters(root: Path, build: BuildOptions, kv_cache_dtype: str,
                             adapters: tuple[tuple[str, int, int], ...]) -> tuple[LoadedModel, dict[str, Path]]:
    """A tiny synthetic model exported with every LoRA target to root/onnx, built to root/engine, plus random
    PEFT adapters (name, seed, rank) converted to root/NAME.safetensors."""
    loaded = synthetic_model("tiny-llama", kv_cache_dtype=kv_cache_dtype)
    loaded.config.lora_targets = list(LORA_TARGETS)
    write_onnx_dir(loaded, root / "onnx")
    build_engine(root / "onnx", root / "engine", build)
    paths = {}
    for name, seed, rank in adapters:
        write_random_peft_adapter(root / "onnx", root / f"peft_{name}", rank=rank, alpha=2.0 * rank, seed=seed,
                                  scale=0.3)
        paths[name] = root / f"{name}.safetensors"
        write_converted_adapter(root / f"peft_{name}", root / "onnx", paths[name])
    return loaded, paths


def step_audited(engine: Engine) -> dict[str, RequestOutput]:
    """Step until every request finished, auditing the cache after each step; the finished outputs by request id."""
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.cache.check_invariants()
    assert_idle(engine)
    return finished


def document_prompt(system: list[int], docs: list[list[int]], question: list[int],
                    sampling: SamplingParams) -> EngineRequest:
    """A prompt of `system`, the documents in order, then `question`, with each document's span recorded."""
    ids, spans = list(system), []
    for doc in docs:
        spans.append(DocumentSpan(len(ids), len(doc)))
        ids += doc
    return EngineRequest(ids + question, sampling, documents=tuple(spans))


def first_layer_rows(engine: Engine, request: EngineRequest) -> np.ndarray:
    """Layer 0's stored K/V rows of `request`'s prompt once it is computed (they depend on each token alone)."""
    request_id = engine.add_request(request)
    seq = engine.core.sequences[request_id]
    while not seq.output_ids:
        engine.step()
    assert seq.lease is not None
    rows = engine.backend.kv_store.read_tokens(seq.lease.page_ids, len(request.prompt_ids))[0].astype(np.float32)
    while engine.has_unfinished():
        engine.step()
    return rows


def run_alone(engine: Engine, request: EngineRequest) -> RequestOutput:
    """Runs one request to its end, checking the cache's invariants each step and that no other output (a
    document's standalone prefill) reaches the caller."""
    request_id = engine.add_request(request)
    final = None
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id == request_id, "a standalone prefill's output reached the caller"
            final = output
        engine.cache.check_invariants()
    assert final is not None and final.finished
    return final
