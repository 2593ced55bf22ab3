"""What llm_serve refuses before a route runs: foreign Hosts and Origins, non-JSON POSTs, oversized or slow bodies."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import loads_json
from kvforge.server.protocol import ApiError

# OpenAI's own limit on a request's total payload is 50 MB; media items are at most 20 MiB each as sent
# (kvforge/server/media.py), so two full-size items and their text fit. Parsing costs a multiple of the body (up to
# ~20x for arrays of small numbers), which is why the cap is not larger.
DEFAULT_MAX_BODY_BYTES = 50 * 2**20
BODY_BUDGET_FACTOR = 2  # default bytes being received and parsed at once, process-wide: two full bodies
DEFAULT_BODY_TIMEOUT_S = 30.0  # a whole body must arrive within this (1.7 MB/s for a full one)
# json's C scanner holds the GIL for a whole run of numbers (50 MiB of "1," holds it 1.2 s, even off the
# event loop), so bodies are refused before parsing when they hold more values than any request needs: a prompt
# of token ids is at most maxInputLen long, logit_bias and messages are small. Commas and colons separate values.
MAX_JSON_SEPARATORS = 2**20
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
CORS_HEADERS = ("Authorization", "Content-Type")  # what the chat page and the openai clients send
CORS_METHODS = ("GET", "POST")
# After refusing a body, what the client keeps sending is read and dropped for up to this long before the
# connection closes: closing on unread bytes resets the connection, and a client still writing its body (most do,
# before they read) would see the reset instead of the answer (nginx's lingering close does the same).
LINGER_S = 2.0
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before the response


def _host_name(value: str) -> str:
    """The host part of a Host header or netloc, lower-case, without port or trailing dot ('[::1]' stays bracketed)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[:end + 1] if end > 0 else value
    return value.rsplit(":", 1)[0].rstrip(".") if value.count(":") == 1 else value.rstrip(".")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str, extra: Collection[str]) -> frozenset[str] | None:
    """The Host names the server answers; None: any. Bound to loopback, only loopback names (DNS rebinding makes a
    foreign name resolve to 127.0.0.1, so the name is what tells a page's request from a local client's); bound to
    another address, any Host unless `extra` lists them. '*' in `extra` turns the check off."""
    names = {name.strip().lower() for item in extra for name in item.split(",") if name.strip()}
    if "*" in names:
        return None
    if not names and not is_loopback(bind_host):
        return None  # reachable under names we cannot know (the machine's DNS names, a proxy's): --allowedHosts
    return frozenset(LOOPBACK_HOSTS | names | ({bind_host.lower()} if is_loopback(bind_host) else set()))


def parse_origins(values: Collection[str]) -> frozenset[str]:
    """--allowedOrigins: 'scheme://host[:port]' each (comma-separated or repeated), or '*'; lower-case, no slash."""
    return frozenset(o.strip().lower().rstrip("/") for item in values for o in item.split(",") if o.strip())


@dataclass(slots=True)
class BodyBudget:
    """Bytes of request bodies being received or parsed at once, across every connection (one event loop: no lock).

    Each body reserves its bytes chunk by chunk as they arrive (never what it declares: a client that declares the
    maximum and trickles a byte a second would hold the budget with nothing sent), and gives them back once parsed;
    a body that does not fit is refused, so N slow uploads cannot hold N full bodies in memory."""

    limit: int
    used: int = 0

    def reserve(self, count: int) -> bool:
        if self.used + count > self.limit:
            return False
        self.used += count
        return True

    def release(self, count: int) -> None:
        self.used -= count


class Shares:
    """How much of one budget each key holds now, each key at most `limit` (one event loop: no lock). Keys at zero
    are dropped, so the table holds only the keys with something in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def take(self, key: str, count: int = 1) -> bool:
        held = self._held.get(key, 0)
        if held + count > self.limit:
            return False
        self._held[key] = held + count
        return True

    def give(self, key: str, count: int = 1) -> None:
        held = self._held.get(key, 0) - count
        if held > 0:
            self._held[key] = held
        else:
            self._held.pop(key, None)

    def held(self, key: str) -> int:
        return self._held.get(key, 0)


@dataclass(slots=True)
class BodyLimits:
    """How request bodies are bounded: size per body (413), bytes at once process-wide (503) and per tenant (429,
    kvforge/server/limits.py), arrival time (408)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    budget: BodyBudget = field(default_factory=lambda: BodyBudget(BODY_BUDGET_FACTOR * DEFAULT_MAX_BODY_BYTES))
    timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    per_tenant: Shares | None = None  # None: no tenant shares (json_body called without an app's limits)

    @classmethod
    def of(cls, max_body_bytes: int, budget_bytes: int | None = None,
           timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> BodyLimits:
        return cls(max_body_bytes, BodyBudget(budget_bytes or BODY_BUDGET_FACTOR * max_body_bytes), timeout_s)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is more than {limit:,} bytes", code="body_too_large")


def _busy() -> ApiError:
    return ApiError(503, "the server is receiving too many request bodies at once; retry later", kind="server_error",
                    code="overloaded")


async def read_json(chunks: AsyncIterator[bytes], limits: BodyLimits, declared: int | None = None,
                    max_body_bytes: int | None = None, tenant_key: str | None = None) -> Any:
    """The body as JSON, read within the size cap, the shared budget, the tenant's share of it (`tenant_key`, with
    `limits.per_tenant`) and the deadline, parsed off the event loop.

    `declared`: the Content-Length; one over the cap is refused at once, and a body longer than it declared is
    refused as too large. Nothing is reserved for it: bytes are reserved as they arrive."""
    cap = max_body_bytes if max_body_bytes is not None else limits.max_body_bytes
    if declared is not None and declared > cap:
        raise too_large(cap)
    budget = limits.budget
    share, key = (limits.per_tenant, tenant_key) if tenant_key is not None else (None, "")
    held = 0  # bytes reserved in the budget and, with `share`, in the tenant's share
    body = bytearray()
    chunks = aiter(chunks)  # one iterator: a refused body is drained from where it stopped
    refused: ApiError | None = None
    try:
        try:
            async with asyncio.timeout(limits.timeout_s):
                async for chunk in chunks:
                    body += chunk
                    if len(body) > cap or (declared is not None and len(body) > declared):
                        refused = too_large(cap)
                        break
                    more = len(body) - held
                    if share is not None and not share.take(key, more):
                        refused = _tenant_busy(share.limit)
                        break
                    if not budget.reserve(more):
                        if share is not None:
                            share.give(key, more)
                        refused = _busy()
                        break
                    held = len(body)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {limits.timeout_s:g} s",
                           code="request_timeout") from None
        except ClientDisconnect:  # nobody reads the answer; an ApiError keeps it out of the internal-error log
            raise ApiError(CLIENT_CLOSED_REQUEST, "the client disconnected while sending the body") from None
        if refused is not None:
            del body[:]
            await _drain(chunks, LINGER_S)
            raise refused
        data = bytes(body)
        del body[:]  # one copy of the body from here on
        return await asyncio.to_thread(_parse, data)
    finally:
        budget.release(held)
        if share is not None:
            share.give(key, held)


def _tenant_busy(limit: int) -> ApiError:
    # The words of limits.tenant_limit (which imports this module, so it cannot be imported here).
    return ApiError(429, f"your tenant already has {limit:,} bytes of request bodies in flight, its share of this "
                    "server; retry later", kind="rate_limit_error", code="tenant_limit_exceeded")


async def _drain(chunks: AsyncIterator[bytes], seconds: float) -> None:
    with contextlib.suppress(TimeoutError, ClientDisconnect):
        async with asyncio.timeout(seconds):
            async for _ in chunks:
                pass


def _parse(data: bytes) -> Any:
    separators = data.count(b",") + data.count(b":")
    if separators > MAX_JSON_SEPARATORS:
        raise ApiError(413, f"the request body holds more than {MAX_JSON_SEPARATORS:,} JSON values",
                       code="body_too_large")
    try:
        return loads_json(data, "body", standard=True)  # duplicate keys, NaN and Infinity refused, named
    except KvforgeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc.message}") from None


class Guard:
    """ASGI middleware in front of the routes (and of CORS for the allowed origins). In order, it refuses:

    - a Host not in `allowed_hosts` (400): DNS rebinding gives a foreign page our address under its own name;
    - an Origin that is neither this server's (same host and port as the Host header) nor in `allowed_origins`
      (403, no CORS headers): without it any page the user opens could POST to a keyless loopback server;
    - a POST whose Content-Type is not application/json (415): a page may send text/plain cross-origin without a
      preflight, application/json it may not;
    - a declared Content-Length over the cap (413) before a byte of the body is read.

    It also answers 503 (not uvicorn's plain 500) for a request that the graceful shutdown cancels before its
    response started: that cancellation is the only one a request task gets."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: frozenset[str] | None, allowed_origins: frozenset[str],
                 max_body_bytes: Callable[[], int]) -> None:
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = allowed_origins
        self.max_body_bytes = max_body_bytes
        # Starlette's CORS for the listed origins only: preflights answered, headers added. Same-origin requests need
        # none, and every other origin was refused before it.
        listed = sorted(allowed_origins)
        self.app = CORSMiddleware(app, allow_origins=listed, allow_methods=CORS_METHODS,
                                  allow_headers=CORS_HEADERS) if listed else app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(scope)
        if error is not None:
            await send_error(send, error, close=True, linger=receive if scope["method"] == "POST" else None)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if started:
                raise
            # uvicorn's graceful shutdown ran out of time (--shutdownTimeout) with this request still waiting;
            # the handler's `finally` has aborted its sequence. Answer as a request arriving now would be.
            await send_error(send, ApiError(503, "the server is shutting down", kind="server_error",
                                            code="unavailable"), close=True)

    def refusal(self, scope: Scope) -> ApiError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.allowed_hosts is not None and _host_name(host) not in self.allowed_hosts \
                and host.strip().lower() not in self.allowed_hosts:
            return ApiError(400, f"the Host header {host[:100]!r} is not one this server answers to (see its "
                            "--allowedHosts)", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return ApiError(403, f"requests from the web origin {origin[:100]!r} are not allowed (see the server's "
                            "--allowedOrigins)", code="origin_not_allowed")
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                return ApiError(415, "the request body must be sent with Content-Type: application/json",
                                code="unsupported_media_type")
            length = headers.get("content-length")
            if length is not None:
                if not length.strip().isdigit():
                    return ApiError(400, "the Content-Length header is not a number")
                if int(length) > self.max_body_bytes():
                    return too_large(self.max_body_bytes())
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if origin in self.allowed_origins or "*" in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        # Same origin: the page this server served (the chat page) sends its own origin on POST. The scheme is not
        # compared: behind a TLS proxy the page is https while we see http; the Host check covers the name.
        return parts.scheme in ("http", "https") and bool(parts.netloc) and parts.netloc == host.strip().lower()


async def send_error(send: Send, error: ApiError, close: bool = False, linger: Receive | None = None) -> None:
    """An OpenAI-style error object as the whole response; `close`: the connection is not reused (the body, if any,
    was not read). `linger`: once the answer is out, drop what the request still sends for up to LINGER_S first."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    if error.status in (429, 503):
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": linger is not None})
    if linger is not None:  # the client can read the whole answer now (Content-Length); the exchange ends after
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_S):
                while (message := await linger())["type"] == "http.request" and message.get("more_body"):
                    pass
        await send({"type": "http.response.body", "body": b""})
