"""Runs a request file on the engine loop: the file's batches in order (static) or all at once (continuous)."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from kvforge.runtime.engine import Engine
from kvforge.runtime.output import RequestOutput
from kvforge.runtime.request_file import RequestFile
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import Request


class Scheduling(str, Enum):
    # The seed's semantics: batch_size requests at a time, in file order; a batch starts when the last ends.
    STATIC = "static"
    # Every request of the file goes to the scheduler at once; rows join and leave at each step.
    CONTINUOUS = "continuous"


def prepare_requests(engine: Engine, request_file: RequestFile, base_dir: Path | None = None) -> list[EngineRequest]:
    """Load the file's adapters and tokenize every request: all bad input fails before the first step."""
    if request_file.batch_size > engine.engine.build.max_batch_size:
        from kvforge.contract.errors import KvforgeError

        raise KvforgeError(f"{request_file.batch_size} exceeds the engine's maxBatchSize "
                           f"{engine.engine.build.max_batch_size}", "batch_size")
    engine.load_adapters(request_file.available_lora_weights, base_dir)
    return [engine.inputs.process(r, request_file.enable_thinking, base_dir=base_dir) for r in request_file.requests]


def run_request_file(engine: Engine, request_file: RequestFile, prepared: list[EngineRequest],
                     scheduling: Scheduling = Scheduling.STATIC,
                     on_response: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Drive `engine.step()` over the file's requests; responses come back in request order.

    `batch_idx` is the request's batch in the file (index // batch_size) under both schedulings, so the
    output format does not change; under continuous scheduling it no longer says which requests ran together.
    """
    requests = request_file.requests
    size = request_file.batch_size
    groups = ([range(len(requests))] if scheduling is Scheduling.CONTINUOUS
              else [range(i, min(i + size, len(requests))) for i in range(0, len(requests), size)])
    responses: dict[int, dict[str, Any]] = {}
    for group in groups:
        ids = {engine.add_request(prepared[i]): i for i in group}
        for output in drain(engine, set(ids)):
            i = ids[output.request_id]
            text = engine.inputs.prompt_text(requests[i], request_file.enable_thinking)
            responses[i] = response_dict(output, requests[i], i // size, text)
            if on_response is not None:
                on_response(responses[i])
    return [responses[i] for i in range(len(requests))]


def drain(engine: Engine, request_ids: set[str]) -> list[RequestOutput]:
    """Step until every request in `request_ids` has finished; their final outputs in finishing order.
    Other requests in the engine advance too (they share the steps)."""
    finished = []
    pending = set(request_ids)
    while pending:
        for output in engine.step():
            if output.finished and output.request_id in pending:
                pending.discard(output.request_id)
                finished.append(output)
    return finished


def response_dict(output: RequestOutput, request: Request, batch_idx: int, formatted_prompt: str) -> dict[str, Any]:
    """One entry of the output file's `responses`, as TensorRT Edge-LLM's users read it (plus usage/timing)."""
    timing = output.timing
    response: dict[str, Any] = {
        "output_text": output.text,
        "request_idx": request.index,
        "batch_idx": batch_idx,
        "finish_reason": output.finish_reason,
        "formatted_complete_request": formatted_prompt,
        "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(output.token_ids),
                  "cached_tokens": output.cached_tokens},
        "timing": {"ttft_ms": round(timing.ttft_ms, 3), "prefill_ms": round(timing.prefill_ms, 3),
                   "decode_ms": round(timing.decode_ms, 3)} if timing else {},
    }
    if output.logprobs is not None:
        response["logprobs"] = [[{"token_id": e.token_id, "token": e.token, "bytes": list(e.token.encode("utf-8")),
                                  "logprob": round(e.logprob, 6)} for e in step] for step in output.logprobs]
    return response


def warm_up(engine: Engine, request: EngineRequest, runs: int) -> None:
    """Unprofiled runs of one request that neither look up nor publish, so they cannot warm the cache."""
    from dataclasses import replace

    enabled = engine.profiler.enabled
    engine.profiler.enabled = False
    try:
        for _ in range(runs):
            cold = replace(request, sampling=replace(request.sampling, reuse_context=False))
            drain(engine, {engine.add_request(cold)})
    finally:
        engine.profiler.enabled = enabled
