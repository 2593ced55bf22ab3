"""The HTTP routes: OpenAI's /v1 endpoints, /health, /metrics and the chat page, all over one EngineLoop."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kvforge import __version__
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.engine.engine import Engine, EngineStats, RequestOutput
from kvforge.runtime.profile import Profiler
from kvforge.server.engine_loop import EngineLoop
from kvforge.server.guard import DEFAULT_MAX_BODY_BYTES, LOOPBACK_HOSTS, BodyLimits, Guard, read_json
from kvforge.server.handle import ClientGone, RequestHandle, ServerState
from kvforge.server.limits import TenantGate, TenantLimits, budget_key
from kvforge.server.media import MediaPolicy
from kvforge.server.metrics import CONTENT_TYPE, ServerMetrics
from kvforge.server.protocol import ApiCall, ApiError, parse_call
from kvforge.server.render import Renderer, TextStreamer, finish_reason
from kvforge.server.tenants import Tenants
from kvforge.server.tokens import detokenize, tokenize, tokenize_input, tokenize_response
from kvforge.server.vllm_metrics import VllmCollector

T = TypeVar("T")
STATIC_DIR = Path(__file__).resolve().parent / "static"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Per body unless create_app is given one (--maxBodyBytes); read per request. Why this size: kvforge/server/guard.py.
MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before the response
ENGINE_STOP_TIMEOUT_S = 30.0  # the engine thread ends after its current step; one step is seconds at most
log = logging.getLogger("uvicorn.error")  # beside uvicorn's own start and shutdown lines


class LoopSnapshot:
    """The engine loop's latest stats for /metrics, bound once the loop exists: the metrics are made before the
    engine, so that the engine's profiler streams its stage times into them from the start."""

    def __init__(self) -> None:
        self.loop: EngineLoop | None = None

    def __call__(self) -> EngineStats:
        assert self.loop is not None, "create_app binds the snapshot to its engine loop"
        return self.loop.snapshot


def server_profiler() -> tuple[Profiler, ServerMetrics, LoopSnapshot]:
    """What llm_serve builds before its Engine: the metrics, a profiler whose stage sink is their step-time
    histogram (instead of a list that grows with every step; the token counters stay the profile's), and the
    snapshot /metrics reads, which `create_app(observed=...)` binds to its engine loop."""
    snapshot = LoopSnapshot()
    metrics = ServerMetrics(snapshot)
    return Profiler(stage_sink=metrics.observe_stage), metrics, snapshot


def create_app(engine: Engine, tenants: Tenants, *, model_name: str, max_queued_requests: int,
               media: MediaPolicy | None = None, allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS,
               allowed_origins: frozenset[str] = frozenset(), max_body_bytes: int | None = None,
               body_bytes_in_flight: int | None = None, body_timeout_s: float | None = None,
               tenant_limits: TenantLimits | None = None,
               observed: tuple[ServerMetrics, LoopSnapshot] | None = None) -> FastAPI:
    """An app serving `engine` (with its adapters loaded) under `model_name`; the engine thread starts with it.
    `media`: where media content parts may come from (default: inline only). `allowed_hosts` (None: any Host),
    `allowed_origins` and the body bounds: kvforge/server/guard.py (defaults: loopback names, same origin only, its
    sizes). `tenant_limits`: each tenant's share of the bounds, kvforge/server/limits.py (default: half of each).
    `observed`: `server_profiler()`'s metrics and snapshot, when the engine was built with its profiler (llm_serve);
    without them the app makes its own and points the engine's profiler at them before the thread starts."""
    engine_loop = EngineLoop(engine)
    if observed is None:  # an engine built without the server's profiler (tests, embedding callers)
        profiler, made, snapshot = server_profiler()
        engine.profiler.stage_sink = profiler.stage_sink  # before the thread starts: from then on it owns the engine
        observed = made, snapshot
    metrics, snapshot = observed
    snapshot.loop = engine_loop
    info = engine.info  # the engine's public facts (limits, adapters, reuse): the server reads nothing else of it
    adapters = list(info.adapters)
    if model_name in adapters:
        raise KvforgeError(f"an adapter is named like the served model {model_name!r}", "served_model_name")
    state = ServerState(engine_loop, info.tokenizer, tenants, metrics,
                        models={model_name: None, **{name: name for name in adapters}},
                        max_in_flight=info.max_batch_size + max_queued_requests,
                        reuse_enabled=info.reuse_enabled, max_model_len=info.max_kv_cache_capacity,
                        media=media or MediaPolicy())
    metrics.in_flight.set_function(lambda: state.in_flight)
    # vLLM's series names beside ours, for the routers' load monitors (docs/scale-out.md).
    metrics.registry.register(VllmCollector(snapshot, metrics.cache_queries, metrics.cache_hits, model_name))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:  # uvicorn has let requests finish (or cancelled them): abort what is left, end the thread
            state.shutting_down = True
            log.info("stopping the engine (%d request(s) still in flight are cancelled)", state.in_flight)
            await asyncio.to_thread(engine_loop.stop, ENGINE_STOP_TIMEOUT_S)
            await asyncio.to_thread(engine.close)  # the shared tier saves what is queued (bounded)

    # No /docs or /redoc: their pages load scripts from a CDN, which an offline deployment should not reach for.
    app = FastAPI(title="kvforge llm_serve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvforge = state

    def body_cap() -> int:
        return max_body_bytes or MAX_BODY_BYTES

    limits = BodyLimits.of(body_cap(), body_bytes_in_flight)
    if body_timeout_s is not None:
        limits.timeout_s = body_timeout_s
    shares = (tenant_limits or TenantLimits()).shares(limits.budget.limit, state.max_in_flight)
    limits.per_tenant = shares.body_bytes
    # Inside starlette's error middleware, outside routing: refusals cost no body read and no JSON parse. The guard
    # is added last, so it runs first: a foreign Host or Origin is refused before it counts against anyone.
    app.add_middleware(TenantGate, tenants=tenants, shares=shares)
    app.add_middleware(Guard, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins, max_body_bytes=body_cap)
    _add_routes(app, state, limits, body_cap)
    _add_token_routes(app, state, limits, body_cap, info.model.vocab_size)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def _add_routes(app: FastAPI, state: ServerState, limits: BodyLimits, body_cap: Callable[[], int]) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:  # browsers ask for it on every page; a 404 is noise in their console
        return FileResponse(STATIC_DIR / "favicon.ico", media_type="image/x-icon")

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.engine_loop.alive and not state.shutting_down
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        # Open like /health: routers probe it to identify the engine before they hold any key, and it says only
        # which kvforge answers.
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # With --apiKeys, an operator key only: the counters are every tenant's traffic and cache hit rates, a side
        # channel between tenants. /health (ok/unavailable only) and the chat page (static files) stay open for probes.
        _tenant(state, request)
        if not state.tenants.is_operator(request.headers.get("authorization")):
            raise ApiError(403, "/metrics needs an operator key (one marked \"operator\": true in --apiKeys)",
                           code="operator_key_required")
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _tenant(state, request)
        return {"object": "list", "data": [_model_card(state, name) for name in state.models]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        _tenant(state, request)
        if model_id not in state.models:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server has "
                                f"{', '.join(sorted(state.models))}", "model", code="model_not_found")
        return _model_card(state, model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(state, request, limits, body_cap(), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(state, request, limits, body_cap(), chat=False)


def _add_token_routes(app: FastAPI, state: ServerState, limits: BodyLimits, body_cap: Callable[[], int],
                      vocab_size: int) -> None:
    """vLLM's /tokenize and /detokenize (llama.cpp's names and fields are accepted too)."""

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        body = await json_body(request, limits, body_cap(), _budget_key(state, request))
        what, generation = _checked(lambda: tokenize_input(body, state.models, state.media))
        # On a preparation worker, as a request's own tokenization: a long chat template never stalls the loop.
        future = state.engine_loop.prepare(lambda engine: tokenize(engine, what, generation))  # type: ignore
        try:
            ids = await asyncio.wrap_future(future)
        except KvforgeError as exc:
            raise ApiError(400, exc.message, exc.field) from None
        return tokenize_response(ids, state.max_model_len)  # type: ignore[arg-type]

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        body = await json_body(request, limits, body_cap(), _budget_key(state, request))
        return _checked(lambda: detokenize(body, state.models, state.tokenizer, vocab_size))


def _budget_key(state: ServerState, request: Request) -> str:
    """The caller's tenant (a 401 without a valid key) as the key of its share of the body budget."""
    tenant = _tenant(state, request)
    return budget_key(state.tenants, tenant, (request.client.host, request.client.port) if request.client else None)


def _checked(fn: Callable[[], T]) -> T:
    """`fn()`, its KvforgeError as a 400 naming the field."""
    try:
        return fn()
    except KvforgeError as exc:
        raise ApiError(400, exc.message, exc.field) from None


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    base = next(iter(state.models))
    # `root`: the served model the entry runs on (vLLM's field; routers group adapters by it). The served name,
    # never the engine dir's path: a tenant learns nothing of the server's file system.
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvforge", "root": base,
            "max_model_len": state.max_model_len, "parent": base if state.models[name] else None,
            # what requests may hold: the chat page shows Attach only when there is more than text
            "input_modalities": ["text", *sorted(state.tokenizer.media_markers)]}


async def _complete(state: ServerState, request: Request, limits: BodyLimits, cap: int, chat: bool) -> Response:
    tenant = _tenant(state, request)
    try:
        key = budget_key(state.tenants, tenant, (request.client.host, request.client.port) if request.client else None)
        call = parse_call(await json_body(request, limits, cap, key), chat, state.models, state.media)
    except ApiError:
        state.metrics.requests.labels("invalid").inc()
        raise
    salt = state.tenants.cache_salt(tenant, call.cache_salt)
    if call.n > 1 or len(call.prompts) > 1:
        return await _complete_choices(state, request, call, salt)
    handle = RequestHandle(state, call, salt)
    await handle.start()
    renderer = Renderer(call, handle.request_id, state.tokenizer)
    if call.stream:
        return _EventStream(_events(handle, renderer, TextStreamer(state.tokenizer, call.sampling.stop)), [handle])
    try:
        output = await _collect(handle, request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the request was aborted
    return JSONResponse(renderer.body(output))


def _tenant(state: ServerState, request: Request) -> str:
    tenant = state.tenants.tenant_for(request.headers.get("authorization"))
    if tenant is None:
        raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")
    return tenant


async def json_body(request: Request, limits: BodyLimits | None = None, cap: int | None = None,
                    tenant_key: str | None = None) -> Any:
    """The body as JSON, bounded in size, time and (with the app's `limits`) bytes across requests at once, the
    tenant's (`tenant_key`, kvforge/server/limits.py) among them; parsed on a worker thread, so /health and the
    streams go
    on meanwhile."""
    declared = getattr(request, "headers", {}).get("content-length")
    return await read_json(request.stream(), limits or _LIMITS, int(declared) if declared else None,
                           cap if cap is not None else MAX_BODY_BYTES, tenant_key)


_LIMITS = BodyLimits()  # json_body called without an app's limits


async def _collect(handle: RequestHandle, request: Request) -> RequestOutput:
    """Wait for the final output; a client that hangs up meanwhile aborts the request."""
    watcher = asyncio.create_task(_watch_disconnect(request, handle))
    try:
        while True:
            output = await handle.next_output()
            if output.finished:
                return output
    finally:
        watcher.cancel()
        handle.close()


async def _watch_disconnect(request: Request, *handles: RequestHandle) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.queue.put_nowait(ClientGone("the client disconnected"))


async def _events(handle: RequestHandle, renderer: Renderer, streamer: TextStreamer) -> AsyncIterator[str]:
    """Server-sent events: chunks as tokens settle, the finish reason, usage if asked for, then [DONE]."""
    final = None
    async for item in _chunks(handle, renderer, streamer):
        if isinstance(item, RequestOutput):
            final = item
        else:
            yield _sse(item)
    if final is not None and handle.call.include_usage:
        yield _sse(renderer.usage_chunk(final))
    yield "data: [DONE]\n\n"


async def _chunks(source: RequestHandle | Choice, renderer: Renderer,
                  streamer: TextStreamer) -> AsyncIterator[dict[str, Any] | RequestOutput]:
    """One choice's stream chunks (an error body ends it), then its final output (not sent: usage reads it)."""
    call = renderer.call
    if call.chat:
        yield renderer.chunk(None, [], None)
    while True:
        try:
            output = await source.next_output()
        except ApiError as exc:
            yield exc.body()
            return
        first_new = len(output.token_ids) - len(output.new_token_ids)
        samples = output.samples[first_new:len(output.token_ids)] if call.logprobs else []
        if output.finished and renderer.reads_tool_calls:  # held to the end: calls are read from the whole text
            yield renderer.tool_chunk(output, output.samples if call.logprobs else [])
            yield output
            return
        if output.finished:
            yield renderer.chunk(streamer.finish(output.text), samples, finish_reason(output))
            yield output
            return
        if renderer.reads_tool_calls:
            continue
        text = streamer.push(output.token_ids)
        if text or samples:
            yield renderer.chunk(text, samples, None)


class Choice:
    """One of several choices (n > 1, or several prompts): its handle, and the outputs read before they were wanted
    (the first one, read to know its prompt is in the cache)."""

    def __init__(self, handle: RequestHandle, renderer: Renderer) -> None:
        self.handle, self.renderer = handle, renderer
        self.read: list[RequestOutput] = []

    async def prime(self) -> None:
        self.read.append(await self.handle.next_output())

    async def next_output(self) -> RequestOutput:
        return self.read.pop(0) if self.read else await self.handle.next_output()

    async def final(self) -> RequestOutput:
        while not (output := await self.next_output()).finished:
            pass
        return output


async def _complete_choices(state: ServerState, request: Request, call: ApiCall, salt: str) -> Response:
    """n choices per prompt, `choices[i]` in order. The first of each prompt runs alone until its first token, when
    its prompt pages are published: the other n - 1 then find them in the cache and compute only their own tokens."""
    calls = call.choices()
    handles = [RequestHandle(state, c, salt, counts_cache=i % call.n == 0) for i, c in enumerate(calls)]
    choices = [Choice(h, Renderer(c, handles[0].request_id, state.tokenizer)) for h, c in zip(handles, calls,
                                                                                              strict=True)]
    try:
        for choice in choices[::call.n]:
            await choice.handle.start()
        for choice in choices[::call.n]:
            await choice.prime()
        for index, choice in enumerate(choices):
            if index % call.n:
                await choice.handle.start()
    except BaseException:
        for handle in handles:
            handle.close()
        raise
    if call.stream:
        return _EventStream(_merged_events(choices, call), handles)
    watcher = asyncio.create_task(_watch_disconnect(request, *handles))
    tasks = [asyncio.ensure_future(c.final()) for c in choices]
    try:
        outputs = await asyncio.gather(*tasks)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.close()
    bodies = [c.renderer.body(o) for c, o in zip(choices, outputs, strict=True)]
    body = {**bodies[0], "choices": [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]}
    return JSONResponse({**body, "usage": _usage(outputs, call.n)})


async def _merged_events(choices: list[Choice], call: ApiCall) -> AsyncIterator[str]:
    """Every choice's chunks as they come, each with its `index`; an error ends the stream; then usage, [DONE]."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | RequestOutput | None]] = asyncio.Queue()

    async def pump(index: int, choice: Choice) -> None:
        streamer = TextStreamer(choice.renderer.tokenizer, call.sampling.stop)
        async for item in _chunks(choice, choice.renderer, streamer):
            queue.put_nowait((index, item))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    finals: list[RequestOutput] = []
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, RequestOutput):
                finals.append(item)
            elif "error" in item:
                yield _sse(item)
                break
            else:
                yield _sse({**item, "choices": [{**item["choices"][0], "index": index}]})
        else:
            if call.include_usage:
                yield _sse({**choices[0].renderer.usage_chunk(finals[0]), "usage": _usage(finals, call.n)})
    finally:
        for task in tasks:
            task.cancel()
    yield "data: [DONE]\n\n"


def _usage(outputs: list[RequestOutput], n: int) -> dict[str, Any]:
    """Each prompt counted once (its n choices share it, as OpenAI counts them), every choice's tokens counted."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.cached_tokens for o in outputs[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that closes its request however the stream ends (a client that hangs up aborts it)."""

    def __init__(self, events: AsyncIterator[str], handles: list[RequestHandle]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.handles = handles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for handle in self.handles:
                handle.close()
