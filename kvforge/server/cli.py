"""llm_serve: serve an engine dir over HTTP with OpenAI's API, on the engine loop (continuous batching)."""

from __future__ import annotations

import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:  # a second or more of imports before run_guarded catches Ctrl-C: the same one line and 130 here
    import typer

    from kvforge.cli_common import (
        ENGINE_FLAGS,
        check_reuse_flags,
        console,
        run_app,
        run_guarded,
        set_help_panels,
        with_engine_options,
    )
    from kvforge.contract.errors import KvforgeError
    from kvforge.runtime.engine.config import EngineConfig
except KeyboardInterrupt:
    sys.stderr.write("error: interrupted\n")
    raise SystemExit(130) from None

HELP = """
Serve an engine built by llm_build with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models),
/health, /metrics (Prometheus) and a chat page at /.

[bold]Examples[/]

  llm_serve smollm2-135m-instruct        # MODEL: a GGUF file, HF dir or bundled name, exported and built once
  llm_serve --engineDir out/engines/smollm2                  # context reuse on, the default
  llm_serve --engineDir out/engines/smollm2 --disableContextReuse
  llm_serve --engineDir engines/smollm2 --apiKeys keys.json --host 0.0.0.0 --port 8000
  llm_serve --engineDir engines/smollm2-lora --loraWeights support=adapters/support.safetensors
  llm_serve --engineDir engines/smolvlm --multimodalEngineDir engines/smolvlm-visual
  llm_serve --engineDir engines/smollm2 --allowedHosts llm.lan --allowedOrigins https://notebook.lan
"""
if TYPE_CHECKING:  # imported when serving: llm_serve --help works without the serve extra
    from kvforge.server.limits import TenantLimits

MiB = 2**20
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's default, stated)
MAX_HEADER_BYTES = 16 * 1024  # a request line + headers larger than this is refused by h11 (its default, stated)
LOOPBACK = "127.0.0.1"
SERVE_FLAGS = {**ENGINE_FLAGS, "api_keys": "--apiKeys", "salt_secret": "--saltSecret",
               "served_model_name": "--servedModelName", "host": "--host", "port": "--port",
               "allowed_media_dir": "--allowedMediaDir", "allowed_hosts": "--allowedHosts",
               "allowed_origins": "--allowedOrigins", "max_body_bytes": "--maxBodyBytes",
               "body_bytes_in_flight": "--maxBodyBytesInFlight", "body_timeout": "--bodyTimeout",
               "max_connections": "--maxConnections", "body_bytes_per_tenant": "--maxBodyBytesPerTenant",
               "requests_per_tenant": "--maxRequestsPerTenant", "connections_per_tenant": "--maxConnectionsPerTenant",
               "disable_context_reuse": "--disableContextReuse"}
app = typer.Typer(add_completion=False, rich_markup_mode="rich")


@app.command(help=HELP)
@with_engine_options
def serve(
    model: str = typer.Argument(None, metavar="[MODEL]", help="A GGUF file, HF checkpoint dir, "
                                "smollm2-135m-instruct, ONNX dir or engine dir: exported and built once into "
                                "~/.cache/kvforge/models (keyed by the source, the flags and the kernel version), "
                                "limits chosen from the model and this machine and printed. Or --engineDir."),
    engine_dir: Path = typer.Option(None, "--engineDir", help="Engine dir written by llm_build (or give MODEL)."),
    host: str = typer.Option(None, "--host", help=f"Address to listen on (default {LOOPBACK}: this machine only)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0 = any free port)."),
    api_keys: Path = typer.Option(None, "--apiKeys", help='JSON file {"API_KEY": "TENANT", ...}: every /v1 call then '
                                  "needs a key, and each tenant's KV pages are its own."),
    salt_secret: Path = typer.Option(None, "--saltSecret",
                                     help="File with the secret tenant cache salts are derived from (default: a "
                                          "random one per process). Required with --sharedCache: servers sharing "
                                          "a tier must share it."),
    max_queued_requests: int = typer.Option(64, "--maxQueuedRequests",
                                            help="Requests that may wait beyond the engine's maxBatchSize running "
                                                 "ones; past that, 429."),
    served_model_name: str = typer.Option(None, "--servedModelName",
                                          help="The model id clients send (default: the engine dir's name)."),
    lora_weights: list[str] = typer.Option([], "--loraWeights",
                                           help="NAME=PATH of a converted adapter; repeat for more. Clients pick "
                                                "one with lora_name or as the model id."),
    engine_config: EngineConfig = EngineConfig(),  # with_engine_options: one flag per EngineConfig option
    allowed_media_dir: Path = typer.Option(None, "--allowedMediaDir",
                                           help="Directory whose files clients may name as media (file:// URLs or "
                                                "paths, resolved inside it); without it only inline media is "
                                                "accepted. http(s) URLs are never fetched."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdownTimeout",
                                           help="On SIGTERM/SIGINT, seconds requests in flight get to finish before "
                                                "they are cancelled."),
    allowed_hosts: list[str] = typer.Option([], "--allowedHosts",
                                            help="Host names clients may reach the server under, besides the "
                                                 "loopback ones (comma-separated or repeated; '*': any). Default "
                                                 "when bound to loopback: localhost, 127.0.0.1, ::1 only (DNS "
                                                 "rebinding); bound elsewhere: any, unless this lists them."),
    allowed_origins: list[str] = typer.Option([], "--allowedOrigins",
                                              help="Web origins (scheme://host[:port]) whose pages may call the "
                                                   "server, with CORS; others get 403. The chat page's own origin is "
                                                   "always allowed."),
    max_body_bytes: int = typer.Option(50 * MiB, "--maxBodyBytes",
                                       help="Largest request body (413 past it; declared lengths are refused "
                                            "before reading)."),
    body_bytes_in_flight: int = typer.Option(None, "--maxBodyBytesInFlight",
                                             help="Bytes of request bodies being received or parsed at once, all "
                                                  "clients together (default 2 x --maxBodyBytes); past it, 503."),
    body_timeout: float = typer.Option(30.0, "--bodyTimeout",
                                       help="Seconds a request body may take to arrive; a slower one gets 408."),
    max_connections: int = typer.Option(1000, "--maxConnections",
                                        help="Open connections (and requests) at once; past it uvicorn answers 503."),
    body_bytes_per_tenant: int = typer.Option(None, "--maxBodyBytesPerTenant",
                                              help="With --apiKeys: bytes of request bodies one tenant may be "
                                                   "sending at once (default half of --maxBodyBytesInFlight); past "
                                                   "it, 429."),
    requests_per_tenant: int = typer.Option(None, "--maxRequestsPerTenant",
                                            help="With --apiKeys: completion requests one tenant may have open, "
                                                 "body upload included (default half of maxBatchSize + "
                                                 "--maxQueuedRequests); past it, 429."),
    connections_per_tenant: int = typer.Option(None, "--maxConnectionsPerTenant",
                                               help="With --apiKeys: requests of any route one tenant may have open "
                                                    "(default half of --maxConnections); past it, 429."),
    disable_context_reuse: bool = typer.Option(
        False, "--disableContextReuse", help="Turn context reuse off. llm_serve reuses context by default "
        "(--enableContextReuse is implied), with the snapshot budgets llm_build printed for the engine where "
        "--contextCache...PoolBytes are not given, so reuse is token-exact."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    """Load the engine, then serve until SIGTERM or Ctrl-C."""

    def body() -> None:
        _check_serve_extra()
        import uvicorn

        from kvforge.runtime.api import with_build_budgets
        from kvforge.runtime.engine.engine import Engine
        from kvforge.server.app import create_app, server_profiler
        from kvforge.server.tenants import load_tenants

        if max_queued_requests < 0:
            raise KvforgeError(f"must be >= 0, got {max_queued_requests}", "--maxQueuedRequests")
        if shutdown_timeout < 0:
            raise KvforgeError(f"must be >= 0, got {shutdown_timeout}", "--shutdownTimeout")
        for flag, value in (("--maxBodyBytes", max_body_bytes), ("--maxBodyBytesInFlight", body_bytes_in_flight),
                            ("--bodyTimeout", body_timeout), ("--maxConnections", max_connections)):
            if value is not None and value <= 0:
                raise KvforgeError(f"must be > 0, got {value}", flag)
        if body_bytes_in_flight is not None and body_bytes_in_flight < max_body_bytes:
            raise KvforgeError(f"must be at least --maxBodyBytes ({max_body_bytes}), got {body_bytes_in_flight}",
                               "--maxBodyBytesInFlight")
        from kvforge.server.guard import BODY_BUDGET_FACTOR

        tenant_limits = check_tenant_limits(body_bytes_per_tenant, requests_per_tenant, connections_per_tenant,
                                            body_bytes_in_flight or BODY_BUDGET_FACTOR * max_body_bytes,
                                            max_connections)
        from kvforge.server.guard import default_allowed_hosts, parse_origins
        from kvforge.server.media import media_policy

        if disable_context_reuse and engine_config.enable_context_reuse:
            raise KvforgeError("contradicts --enableContextReuse: give one", "--disableContextReuse")
        config = replace(engine_config, enable_context_reuse=not disable_context_reuse)
        check_reuse_flags(config)
        if config.shared_cache and salt_secret is None:
            # Tenant salts are HMACs of a per-process random secret by default: servers sharing a tier would key
            # the same prompt differently, so nothing would ever be found, and a silent 0 % hit rate helps nobody.
            raise KvforgeError("--sharedCache needs --saltSecret: every server sharing the tier must derive tenant "
                               "cache salts from the same secret file", "--saltSecret")
        media = media_policy(allowed_media_dir)
        adapters = parse_lora_flags(lora_weights)
        tenants = load_tenants(api_keys, salt_secret)
        bind_host = host or LOOPBACK
        hosts = default_allowed_hosts(bind_host, allowed_hosts)
        origins = parse_origins(allowed_origins)
        for origin in origins - {"*", "null"}:
            if "://" not in origin:
                raise KvforgeError(f"expected scheme://host[:port], got {origin!r}", "--allowedOrigins")
        from kvforge.tools.testcases.models import engine_dir_of

        served_dir = engine_dir_of(model, engine_dir)
        sock = bind_socket(bind_host, port)
        profiler, metrics, snapshot = server_profiler()  # stage times stream to /metrics from the first call
        engine = Engine(served_dir, with_build_budgets(config, served_dir), profiler=profiler)
        try:
            engine.load_adapters({name: str(path) for name, path in adapters.items()})
        except KvforgeError as exc:  # its field names the request file's available_lora_weights
            raise KvforgeError(exc.message, ENGINE_FLAGS.get(exc.field, "--loraWeights")) from None
        model_name = served_model_name or (Path(model).name.removesuffix(".gguf") if model and engine_dir is None
                                           and served_dir != Path(model) else served_dir.resolve().name)
        web = create_app(engine, tenants, model_name=model_name, max_queued_requests=max_queued_requests,
                         media=media, allowed_hosts=hosts, allowed_origins=origins, max_body_bytes=max_body_bytes,
                         body_bytes_in_flight=body_bytes_in_flight, body_timeout_s=body_timeout,
                         tenant_limits=tenant_limits, observed=(metrics, snapshot))
        _announce(sock, model_name, _reuse_words(engine), tenants.required, host is not None)
        if engine.info.max_batch_size == 1:
            console.print("llm_serve: this engine was built with --maxBatchSize 1, so it runs one request at a time "
                          "(the others wait their turn); rebuild with --maxBatchSize 4 or more to serve several")
        # uvicorn re-raises the signal it shut down for; exit 0 then: requests in flight were finished or cancelled.
        for stop_signal in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop_signal, lambda *_: sys.exit(0))
        # limit_concurrency bounds open connections and tasks (past it uvicorn answers its own 503), which is also
        # what bounds connections stalled in their headers: uvicorn (0.55) has no header read timeout, and the
        # keep-alive timer only runs between requests. Bodies are bounded by the app (kvforge/server/guard.py).
        config = uvicorn.Config(web, log_level="info", timeout_graceful_shutdown=shutdown_timeout or None,
                                timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=max_connections,
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        uvicorn.Server(config).run(sockets=[sock])

    run_guarded(body, debug, SERVE_FLAGS)


def check_tenant_limits(body_bytes: int | None, requests: int | None, connections: int | None,
                        body_bytes_in_flight: int, max_connections: int) -> TenantLimits:
    """The per-tenant flags, each > 0 and at most the process-wide bound it is a share of."""
    from kvforge.server.limits import TenantLimits

    for flag, value, bound, bound_flag in (
            ("--maxBodyBytesPerTenant", body_bytes, body_bytes_in_flight, "--maxBodyBytesInFlight"),
            ("--maxRequestsPerTenant", requests, None, None),
            ("--maxConnectionsPerTenant", connections, max_connections, "--maxConnections")):
        if value is not None and value <= 0:
            raise KvforgeError(f"must be > 0, got {value}", flag)
        if value is not None and bound is not None and value > bound:
            raise KvforgeError(f"must be at most {bound_flag} ({bound}), got {value}: a share as large as the "
                               "whole lets one tenant take it all", flag)
    return TenantLimits(body_bytes, requests, connections, max_connections)


def parse_lora_flags(values: list[str]) -> dict[str, Path]:
    adapters: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise KvforgeError(f"expected NAME=PATH, got {value!r}", "--loraWeights")
        if name in adapters:
            raise KvforgeError(f"adapter {name!r} is given twice", "--loraWeights")
        adapters[name] = Path(path)
    return adapters


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket, so a taken port is a one-line error before the engine loads."""
    if not 0 <= port <= 65535:
        raise KvforgeError(f"must be in 0..65535, got {port}", "port")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise KvforgeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", "port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _reuse_words(engine: Any) -> str:
    info = engine.info
    if not info.reuse_enabled:
        return "off"
    slots = info.partial_kv_snapshot_slots
    # Not "token-exact": to the token only inside a cached prompt's last page, by whole pages elsewhere.
    return f"on, to the token in cached tails ({slots} partial-KV snapshot slots)" if slots else "on, by whole pages"


def _announce(sock: socket.socket, model: str, reuse: str, keys: bool, host_given: bool) -> None:
    address, port = sock.getsockname()[:2]
    url = f"http://{f'[{address}]' if ':' in address else address}:{port}"
    console.print(f"llm_serve: model {model!r} at {url}/v1 (chat page {url}/), context reuse {reuse}")
    if keys:
        console.print("llm_serve: API keys required; each tenant's cache pages are salted with its own secret salt")
    elif host_given and address not in (LOOPBACK, "::1", "localhost"):
        console.print(f"[bold yellow]warning:[/] no --apiKeys and listening on {address}: anyone who can reach it "
                      "can use the server, and all callers share one cache")
    else:
        console.print(f"llm_serve: no --apiKeys, so listening on {address} only (give --host to change that)")


def _check_serve_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise KvforgeError(f"llm_serve needs the serve extra ({exc.name} is missing): "
                           "pip install 'kvforge[serve]'") from None


# Where --help lists this command's own flags (kvforge.cli_common.set_help_panels; engine options carry theirs).
HELP_PANELS = {
    "Tenants and access": ("--apiKeys", "--saltSecret", "--allowedHosts", "--allowedOrigins", "--allowedMediaDir"),
    "Limits": ("--maxQueuedRequests", "--maxBodyBytes", "--maxBodyBytesInFlight", "--bodyTimeout", "--maxConnections",
               "--maxBodyBytesPerTenant", "--maxRequestsPerTenant", "--maxConnectionsPerTenant", "--shutdownTimeout"),
    "Context reuse": ("--disableContextReuse",),
}
set_help_panels(app, HELP_PANELS)


def main() -> None:
    run_app(app)
