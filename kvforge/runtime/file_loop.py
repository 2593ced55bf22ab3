"""Runs a request file on the engine loop: the file's batches in order (static) or all at once (continuous)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any

from kvforge.contract.files import atomic_output
from kvforge.runtime.engine.engine import Engine, EngineRequest, RequestOutput
from kvforge.runtime.inputs.request_file import RequestFile
from kvforge.runtime.types import Request


class Scheduling(str, Enum):
    # The seed's semantics: batch_size requests at a time, in file order; a batch starts when the last ends.
    STATIC = "static"
    # Every request of the file goes to the scheduler at once; rows join and leave at each step.
    CONTINUOUS = "continuous"


def prepare_requests(engine: Engine, request_file: RequestFile, base_dir: Path | None = None) -> list[EngineRequest]:
    """Load the file's adapters and tokenize every request: all bad input fails before the first step."""
    if request_file.batch_size > engine.info.build.max_batch_size:
        from kvforge.contract.errors import KvforgeError

        raise KvforgeError(f"{request_file.batch_size} exceeds the engine's maxBatchSize "
                           f"{engine.info.build.max_batch_size}", "batch_size")
    engine.load_adapters(request_file.available_lora_weights, base_dir)
    return [engine.prepare(r, enable_thinking=request_file.enable_thinking, base_dir=base_dir)
            for r in request_file.requests]


def run_request_file(engine: Engine, request_file: RequestFile, prepared: list[EngineRequest],
                     scheduling: Scheduling = Scheduling.STATIC,
                     on_response: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Drive `engine.step()` over the file's requests; responses come back in request order."""
    responses = []
    for response in iter_responses(engine, request_file, prepared, scheduling):
        if on_response is not None:
            on_response(response)
        responses.append(response)
    return responses


def iter_responses(engine: Engine, request_file: RequestFile, prepared: list[EngineRequest],
                   scheduling: Scheduling = Scheduling.STATIC) -> Iterator[dict[str, Any]]:
    """Each response in request order as soon as it and every one before it have finished, so a caller that
    writes them out holds only the out-of-order few (at most a batch under static scheduling).

    `batch_idx` is the request's batch in the file (index // batch_size) under both schedulings, so the
    output format does not change; under continuous scheduling it no longer says which requests ran together.
    """
    requests = request_file.requests
    size = request_file.batch_size
    groups = ([range(len(requests))] if scheduling is Scheduling.CONTINUOUS
              else [range(i, min(i + size, len(requests))) for i in range(0, len(requests), size)])
    finished: dict[int, dict[str, Any]] = {}
    next_index = 0
    for group in groups:
        ids = {engine.add_request(prepared[i]): i for i in group}
        for output in iter_finished(engine, set(ids)):
            i = ids[output.request_id]
            text = engine.prompt_text(requests[i], request_file.enable_thinking)
            finished[i] = response_dict(output, requests[i], i // size, text)
            while next_index in finished:
                yield finished.pop(next_index)
                next_index += 1


def write_output_file(path: Path, input_file: str, responses: Iterable[dict[str, Any]],
                      before_commit: Callable[[], None] | None = None) -> int:
    """Stream responses into the output JSON (the layout `json.dumps(..., indent=4)` gives the whole object)
    through a temporary file renamed into place at the end: memory stays O(1) in the number of requests and
    a failed run leaves no output file. `before_commit` runs (writing the profile, say) before the rename, so
    its failure leaves no output either. Returns the number of responses written."""
    count = 0
    with atomic_output(path) as handle:
        handle.write('{\n    "input_file": ' + json.dumps(input_file, ensure_ascii=False) + ',\n    "responses": [')
        for response in responses:
            handle.write(",\n" if count else "\n")
            handle.write(textwrap.indent(json.dumps(response, indent=4, ensure_ascii=False), " " * 8))
            count += 1
        handle.write("\n    ]\n}\n" if count else "]\n}\n")
        if before_commit is not None:
            before_commit()
    return count


def drain(engine: Engine, request_ids: set[str]) -> list[RequestOutput]:
    """Step until every request in `request_ids` has finished; their final outputs in finishing order.
    Other requests in the engine advance too (they share the steps)."""
    return list(iter_finished(engine, request_ids))


def iter_finished(engine: Engine, request_ids: set[str]) -> Iterator[RequestOutput]:
    """`drain` yielding each final output as its request finishes."""
    pending = set(request_ids)
    while pending:
        for output in engine.step():
            if output.finished and output.request_id in pending:
                pending.discard(output.request_id)
                yield output


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
    if request.lora_name:  # the adapter as it ran: an activated one whose invocation was absent says "(not invoked)"
        response["adapter"] = output.adapter
    if output.error is not None:  # finish_reason "error": the engine failed this request alone
        response["error"] = output.error
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
