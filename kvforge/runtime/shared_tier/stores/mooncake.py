"""Mooncake Store as a shared-tier store: the KV pool vLLM, SGLang and LMCache talk to, over its Python client.

    mooncake://MASTER_HOST:PORT?metadata=P2PHANDSHAKE&protocol=tcp&host=127.0.0.1&local_buffer_mb=256&segment_mb=0

The client contributes no memory by default (`segment_mb=0`): values live in a long-running `mooncake_client`
holder process, so they outlive the process that wrote them (an embedded segment dies with its owner). Keys are
hex strings of the tier's binary keys under a prefix (`?prefix=`, default `kvf-`). A duplicate put keeps the
first value, which suits content addressing. Mooncake's calls cannot be interrupted and block for seconds while
its master is away (its set-up retries for about 90 s, holding the interpreter): so `connect` first checks that the
master accepts a TCP connection, within PROBE_TIMEOUT_S, and sets the client up only then; a dead master is one
fast failure, retried by the tier in the background. The tier runs every call on its own threads and stops waiting
at its deadline. Its clients listen on
0.0.0.0 whatever host they are given: keep them on a private network (docs/shared-tier.md).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.shared_tier.store import StoreError, StoreUnavailable, redact

DEFAULT_PREFIX = "kvf-"
SETUP_RETRY_S = 1.0  # a failed setup is tried again on a later call, at most this often
PROBE_TIMEOUT_S = 1.0  # a master that does not accept a connection in this long is down: no set-up is tried
# Return codes of mooncake-store/include/types.h that mean "not reachable now" (the rest are refusals).
UNAVAILABLE = {-200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS", -800: "TRANSFER_FAIL", -900: "RPC_FAIL"}
OBJECT_ALREADY_EXISTS = -705  # a put of a key another writer put first: the value is there, which is success
NAMES = {-704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", **UNAVAILABLE}


def _import_client() -> Any:
    # Its glog lines (INFO for every connection and set-up step) would bury a CLI's one-line output; the tier
    # reports a dead store itself, in one line. Mooncake ignores GLOG_minloglevel: its own MC_LOG_LEVEL decides
    # (checked on 0.3.13), and a value the user set wins.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        hint = "apt-get install libibverbs1" if "libibverbs" in str(exc) else \
            "pip install 'kvforge[mooncake]'"
        raise InvalidConfig(f"the Mooncake backend cannot load its client ({exc}); {hint}", "shared_cache") from None
    return MooncakeDistributedStore


@contextlib.contextmanager
def _quiet_stderr(quiet: bool) -> Iterator[None]:
    """File descriptor 2 on /dev/null for the client's set-up: even a set-up that works logs an ERROR line
    ("Local segment descriptor not found") and glog's notice that it is not initialised, and C++ writes them
    past Python's sys.stderr. The set-up takes milliseconds once the master answered the probe."""
    if not quiet:
        yield
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class MooncakeStore:
    """A SharedStore on a Mooncake master. The client object is shared by the tier's threads behind one lock: its
    thread safety is not documented, and the tier's calls are few and large."""

    def __init__(self, url: str, timeout_s: float, client_class: Any = None) -> None:
        """`client_class`: MooncakeDistributedStore (imported here when None; tests pass a stand-in)."""
        self._client_class = client_class if client_class is not None else _import_client()
        self.url = redact(url)
        parts = urlsplit(url)
        if not parts.hostname or not parts.port:
            raise InvalidConfig(f"expected mooncake://MASTER_HOST:PORT, got {self.url!r}", "shared_cache")
        query = dict(parse_qsl(parts.query))
        try:
            self.local_buffer = int(query.pop("local_buffer_mb", "256")) << 20
            self.segment = int(query.pop("segment_mb", "0")) << 20
        except ValueError as exc:
            raise InvalidConfig(f"{self.url}: {exc}", "shared_cache") from None
        self.master = f"{parts.hostname}:{parts.port}"
        self.master_address = (parts.hostname, parts.port)
        self.metadata = unquote(query.pop("metadata", "P2PHANDSHAKE"))
        self.protocol = query.pop("protocol", "tcp")
        self.host = query.pop("host", "127.0.0.1")
        self.device = query.pop("device", "")
        self.prefix = query.pop("prefix", DEFAULT_PREFIX)
        if query:
            raise InvalidConfig(f"unknown option(s) {', '.join(sorted(query))} in {self.url!r}", "shared_cache")
        self.timeout_s = timeout_s
        self._client: Any = None
        self._last_setup = 0.0
        self._lock = threading.Lock()

    def _ready(self) -> Any:
        """The set-up client (lazily: constructing a store does no I/O); a failed setup raises StoreUnavailable."""
        if self._client is not None:
            return self._client
        if time.monotonic() - self._last_setup < SETUP_RETRY_S:
            raise StoreUnavailable(f"{self.url}: setup failed less than {SETUP_RETRY_S:g} s ago", "shared_cache")
        self._last_setup = time.monotonic()
        try:  # a socket call releases the interpreter and is bounded, unlike the client's set-up
            socket.create_connection(self.master_address, timeout=PROBE_TIMEOUT_S).close()
        except OSError as exc:
            raise StoreUnavailable(f"{self.url}: the master does not answer ({exc})", "shared_cache") from None
        # Without it the transfer engine looks for a LAN address and finds none in a loopback-only namespace.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.host)
        client = self._client_class()
        with _quiet_stderr(os.environ.get("MC_LOG_LEVEL") == "ERROR"):
            code = client.setup(self.host, self.metadata, self.segment, self.local_buffer, self.protocol,
                                self.device, self.master)
        if code != 0:
            raise StoreUnavailable(f"{self.url}: setup returned {code}", "shared_cache")
        self._client = client
        return client

    def _key(self, key: bytes) -> str:
        return self.prefix + bytes(key).hex()

    def _check(self, code: int, what: str) -> None:
        if code >= 0 or code == OBJECT_ALREADY_EXISTS:
            return
        message = f"{self.url}: {what} returned {code} ({NAMES.get(code, 'error')})"
        raise (StoreUnavailable if code in UNAVAILABLE else StoreError)(message, "shared_cache")

    def connect(self) -> None:
        with self._lock:
            self._last_setup = 0.0  # asked for explicitly: no retry spacing
            self._ready()

    def put(self, items: Sequence[tuple[bytes, bytes]], *, replace: bool = False) -> None:
        if not items:
            return
        names = [self._key(k) for k, _ in items]
        with self._lock:
            client = self._ready()
            if replace:  # a put never overwrites here: remove the damaged values first (force: ignore read leases)
                for code in client.batch_remove(names, True):
                    if code != -704:  # already gone
                        self._check(code, "batch_remove")
            self._check(client.put_batch(names, [v for _, v in items]), "put_batch")

    def get(self, keys: Sequence[bytes], *, max_bytes: int | None = None) -> list[bytes | None]:
        if not keys:
            return []
        with self._lock:
            # The client has no ranged read: a value past `max_bytes` arrives whole and is cut here, at once.
            values = self._ready().get_batch([self._key(k) for k in keys])
        if len(values) != len(keys):
            raise StoreUnavailable(f"{self.url}: get_batch answered {len(values)} of {len(keys)} keys", "shared_cache")
        end = None if max_bytes is None else max_bytes + 1
        return [bytes(v[:end]) if len(v) else None for v in values]  # a missing key reads as b""

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        with self._lock:
            found = self._ready().batch_is_exist([self._key(k) for k in keys])
        for code in found:
            self._check(code, "batch_is_exist")
        return [code == 1 for code in found]

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        with self._lock:  # force: a read within the last 10 s holds a lease that would refuse the removal
            codes = self._ready().batch_remove([self._key(k) for k in keys], True)
        for code in codes:
            if code != -704:  # already gone
                self._check(code, "batch_remove")

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
