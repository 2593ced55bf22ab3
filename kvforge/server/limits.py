"""Per-tenant shares of llm_serve's budgets, so that one tenant (an --apiKeys tenant, or one address sending no
valid key) can never hold all the body bytes, request slots or open requests and starve the others."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from kvforge.contract.errors import KvforgeError
from kvforge.server.guard import Shares, send_error
from kvforge.server.protocol import ApiError
from kvforge.server.tenants import Tenants

# Paths a tenant's share never blocks: probes must answer however busy a tenant is, and static files cost nothing.
UNGATED_PATHS = ("/health", "/static/")
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
DEFAULT_MAX_CONNECTIONS = 1000  # --maxConnections: uvicorn's limit_concurrency


@dataclass(slots=True)
class TenantShares:
    """Each tenant's share: bytes of bodies being received or parsed, completion requests open (from their headers
    to their last byte: the request slots, body reading included) and requests of any route open at once."""

    body_bytes: Shares
    requests: Shares
    exchanges: Shares


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """The per-tenant flags as given; None: half the process-wide budget, so that whatever one tenant holds, the
    other half stays for the others."""

    body_bytes: int | None = None  # --maxBodyBytesPerTenant, of --maxBodyBytesInFlight
    requests: int | None = None  # --maxRequestsPerTenant, of maxBatchSize + --maxQueuedRequests
    connections: int | None = None  # --maxConnectionsPerTenant, of --maxConnections
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def shares(self, body_bytes_in_flight: int, max_in_flight: int) -> TenantShares:
        """Each share; a request share above the requests the server holds (the engine's maxBatchSize +
        --maxQueuedRequests, known once the engine is loaded) is refused, as the other shares are by the CLI."""
        def half(value: int) -> int:
            return max(1, value // 2)

        if self.requests is not None and self.requests > max_in_flight:
            raise KvforgeError(f"must be at most the engine's maxBatchSize + --maxQueuedRequests ({max_in_flight}), "
                               f"got {self.requests}: a share as large as the whole lets one tenant take it all",
                               "--maxRequestsPerTenant")

        return TenantShares(Shares(self.body_bytes or half(body_bytes_in_flight)),
                            Shares(self.requests or half(max_in_flight)),
                            Shares(self.connections or half(self.max_connections)))


def budget_key(tenants: Tenants, tenant: str | None, client: tuple[str, int] | None) -> str | None:
    """Whom a request's use is counted against: its key's tenant, or its address when it has no valid key (it is
    refused, but holds a connection meanwhile). None without --apiKeys: every caller is then the one tenant, one
    trust domain with the whole budget (docs/serving.md)."""
    if not tenants.required:
        return None
    if tenant:
        return f"tenant:{tenant}"
    return f"address:{client[0] if client else 'unknown'}"


def tenant_limit(what: str, limit: int) -> ApiError:
    """A tenant over its own share: a 429 (its own doing; Retry-After is sent with it), never the others' 503."""
    return ApiError(429, f"your tenant already has {limit:,} {what} in flight, its share of this server; retry later",
                    kind="rate_limit_error", code="tenant_limit_exceeded")


class TenantGate:
    """ASGI middleware: counts each tenant's open requests (any route but probes and static files) and open
    completion requests, and answers 429 at once to one past its share, before a byte of its body is read."""

    def __init__(self, app: ASGIApp, *, tenants: Tenants, shares: TenantShares) -> None:
        self.app = app
        self.tenants = tenants
        self.shares = shares

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.startswith(UNGATED_PATHS) or path == "/":
            await self.app(scope, receive, send)
            return
        key = request_key(self.tenants, scope)
        if key is None:
            await self.app(scope, receive, send)
            return
        exchanges, requests = self.shares.exchanges, self.shares.requests
        completion = scope["method"] == "POST" and path in COMPLETION_PATHS
        refusal = None
        if not exchanges.take(key):
            refusal = tenant_limit("open requests", exchanges.limit)
        elif completion and not requests.take(key):
            exchanges.give(key)
            refusal = tenant_limit("completion requests", requests.limit)
        if refusal is not None:
            await send_error(send, refusal, close=True, linger=receive if scope["method"] == "POST" else None)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            exchanges.give(key)
            if completion:
                requests.give(key)


def request_key(tenants: Tenants, scope: Scope) -> str | None:
    """budget_key of an ASGI request, from its Authorization header and peer address."""
    if not tenants.required:
        return None
    authorization = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"authorization"),
                         None)
    return budget_key(tenants, tenants.tenant_for(authorization), scope.get("client"))
