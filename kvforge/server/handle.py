"""The asyncio side of one request: the bounded queue (429), its outputs from the engine thread, its metrics.

A handle is closed exactly once, however the request ends: finished, client gone (its sequence is aborted,
so it is never published), engine failure or shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.engine import RequestOutput
from kvforge.runtime.engine.engine import CompiledGrammar
from kvforge.runtime.inputs.tokenizer import ChatTokenizer
from kvforge.server.engine_loop import Accepted, EngineFailure, EngineLoop
from kvforge.server.media import MediaPolicy
from kvforge.server.metrics import ServerMetrics
from kvforge.server.protocol import ApiCall, ApiError, error_from
from kvforge.server.render import FINISH_REASONS
from kvforge.server.tenants import Tenants


@dataclass(slots=True)
class ServerState:
    """What every handler shares. `max_in_flight` = the engine's rows + --maxQueuedRequests."""

    engine_loop: EngineLoop
    tokenizer: ChatTokenizer  # immutable: handlers decode stream text with it, off the engine thread
    tenants: Tenants
    metrics: ServerMetrics
    models: dict[str, str | None]  # model id → adapter name (None: the base model)
    max_in_flight: int
    reuse_enabled: bool
    max_model_len: int
    media: MediaPolicy = field(default_factory=MediaPolicy)
    in_flight: int = 0
    shutting_down: bool = False


class ClientGone(Exception):
    """The client hung up before the request finished."""


class RequestHandle:
    def __init__(self, state: ServerState, call: ApiCall, cache_salt: str, counts_cache: bool = True) -> None:
        """`counts_cache`: whether its prompt's cache lookup counts in /metrics; False for choices 2..n of a prompt,
        which read the pages the first choice computed for the same call (usage counts each prompt once too)."""
        self.state = state
        self.call = call
        self.cache_salt = cache_salt
        self.counts_cache = counts_cache
        self.request_id = f"{'chatcmpl' if call.chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.queue: asyncio.Queue[Accepted | RequestOutput | Exception] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.last_token_time: float | None = None
        self.finished = False
        self.closed = True  # until start() has entered the queue

    async def start(self) -> int:
        """Enter the bounded queue and hand the request to the engine; its prompt token count, or an ApiError."""
        state = self.state
        if state.shutting_down or not state.engine_loop.alive:
            raise ApiError(503, "the server is shutting down", kind="server_error", code="unavailable")
        if state.in_flight >= state.max_in_flight:
            state.metrics.requests.labels("rejected").inc()
            raise ApiError(429, f"the server is at its limit of {state.max_in_flight} requests in flight; retry later",
                           kind="rate_limit_error", code="rate_limit_exceeded")
        state.in_flight += 1
        self.closed = False
        loop = asyncio.get_running_loop()

        def sink(item: Accepted | RequestOutput | Exception) -> None:  # called on the engine thread
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(self.queue.put_nowait, item)

        prepared: Future[Any] | None = None
        try:
            grammar = await self._grammar()
            prepared = state.engine_loop.prepare(lambda engine: self.call.engine_request(engine, self.cache_salt,
                                                                                         grammar))
            request = await asyncio.wrap_future(prepared)
        except asyncio.CancelledError:  # client gone while preparing: nothing reached the engine, nothing to abort
            if prepared is not None:
                prepared.cancel()  # still queued for a worker: never runs
            self.finished = True
            self.close()
            if prepared is not None and prepared.cancelled() and not state.engine_loop.alive:  # pool shut down
                raise ApiError(503, "the server is shutting down", kind="server_error", code="unavailable") from None
            raise
        except Exception as exc:  # KvforgeError: the request's fault (400)
            self.finished = True
            self.close("invalid" if isinstance(exc, KvforgeError) else "failed")
            raise self._api_error(exc) from None
        state.engine_loop.submit(self.request_id, request, sink)
        try:
            item = await self.queue.get()
        except BaseException:  # cancelled (client gone) while the engine thread was busy with a step
            self.close()
            raise
        if isinstance(item, Exception):
            self.finished = True  # the engine never took it: nothing to abort
            self.close("invalid" if isinstance(item, KvforgeError) else "failed")
            raise self._api_error(item)
        assert isinstance(item, Accepted)
        state.metrics.prompt_tokens.inc(item.prompt_tokens)
        return item.prompt_tokens

    async def _grammar(self) -> CompiledGrammar | None:
        """The request's grammar, compiled on the engine's grammar worker (never on this event loop nor the engine
        thread), once per schema: the n choices of one body, and later requests with the same schema, share it.
        A refused schema is a KvforgeError naming `response_format` (or `tools`)."""
        response_format = self.call.sampling.response_format
        if response_format is None:
            return None
        compiled = self.state.engine_loop.engine.grammars.submit(response_format, self.call.grammar_field)
        return await asyncio.wrap_future(compiled)

    async def next_output(self) -> RequestOutput:
        """The request's next step output; the last one has `finished` set (and its text, logprobs, timing)."""
        item = await self.queue.get()
        if isinstance(item, ClientGone):
            self.close()  # aborts the sequence
            raise item
        if isinstance(item, Exception):
            self.finished = True
            self.close("failed")
            raise self._api_error(item)
        assert isinstance(item, RequestOutput)
        self._observe(item)
        if item.finished:
            self.finished = True
            self.close(FINISH_REASONS.get(item.finish_reason or "", "failed"))
        return item

    def close(self, outcome: str = "aborted") -> None:
        """Leave the queue; a request that has not finished is aborted in the engine (pages freed, not published)."""
        if self.closed:
            return
        self.closed = True
        self.state.in_flight -= 1
        if not self.finished:
            self.state.engine_loop.abort(self.request_id)
        self.state.metrics.requests.labels(outcome).inc()

    def _observe(self, output: RequestOutput) -> None:
        metrics, now = self.state.metrics, time.perf_counter()
        if self.last_token_time is None:
            metrics.ttft.observe(now - self.arrival)
            if self.state.reuse_enabled and self.call.sampling.reuse_context and self.counts_cache:
                metrics.cache_queries.inc(len(output.prompt_token_ids))
                metrics.cache_hits.inc(output.cached_tokens)
        else:
            metrics.itl.observe(now - self.last_token_time)
        self.last_token_time = now
        metrics.generation_tokens.inc(len(output.new_token_ids))
        if output.finished:
            metrics.latency.observe(now - self.arrival)

    def _api_error(self, exc: Exception) -> ApiError:
        if isinstance(exc, KvforgeError):
            return error_from(exc, self.call.chat)
        if isinstance(exc, EngineFailure):
            return ApiError(503 if self.state.shutting_down else 500, str(exc), kind="server_error")
        return ApiError(500, f"internal error ({type(exc).__name__}: {exc})", kind="server_error")
