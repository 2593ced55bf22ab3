"""The one bytes interface every shared-tier backend implements, its errors, and the checks of a store URL.

A store maps opaque byte keys to byte values. kvforge never asks a store to understand a value: values carry their
own header and checksum (values.py), so a backend is a few dozen lines over its client library. The calls are
batched because a page lookup asks for a run of keys at once, and one round trip per batch is what keeps a load
cheaper than the prefill it replaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

from kvforge.contract.errors import InvalidConfig, KvforgeError

DEFAULT_TIMEOUT_S = 0.05  # per batch; a request whose load takes longer computes cold


class StoreError(KvforgeError):
    """A store call failed (refused, full, protocol error). The tier counts it and treats the batch as a miss."""


class StoreUnavailable(StoreError):
    """The store could not be reached or did not answer in time. The tier backs off before it asks again."""


class SharedStore(Protocol):
    """Batched bytes in, bytes out. Every call returns or raises StoreError within about the store's timeout (where
    the client library allows it; the tier enforces its own deadline on top). Calls may come from several threads
    at once (the tier's load and write threads share one instance); a backend whose client is not thread-safe
    serialises them itself."""

    url: str  # where it points, without credentials (for messages and the profile)

    def connect(self) -> None:
        """Open the connection (Mooncake: set its client up, which takes a while). The tier calls it once on a
        thread of its own before anything else, and again after a failure; constructing a store does no I/O."""
        ...

    def put(self, items: Sequence[tuple[bytes, bytes]], *, replace: bool = False) -> None:
        """Store each (key, value). First writer wins: a key already present keeps its value (content addressing:
        equal keys mean equal contents, so rewriting is wasted bandwidth), unless `replace`: the tier replaces a
        value a read rejected (damaged, truncated or forged), so the store heals."""
        ...

    def get(self, keys: Sequence[bytes], *, max_bytes: int | None = None) -> list[bytes | None]:
        """The value of each key, None where absent (evicted, flushed or never written). With `max_bytes`, a value
        longer than that comes back as its first max_bytes + 1 bytes (the caller rejects it), never read whole
        where the client allows a bounded read."""
        ...

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present (cheaper than get: no value moves)."""
        ...

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove each key; absent keys are ignored."""
        ...

    def close(self) -> None:
        """Release connections (and, for Mooncake, the client's segment registration)."""
        ...


def redact(url: str) -> str:
    """`url` without a password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


REDIS_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")
MOONCAKE_SCHEMES = ("mooncake",)


def check_store_url(url: str, timeout_s: float) -> None:
    """The checks `open_store` makes before importing anything: a scheme some backend takes, a positive timeout."""
    if timeout_s <= 0:
        raise InvalidConfig(f"must be > 0, got {timeout_s * 1e3:g} ms", "shared_cache_timeout_ms")
    if urlsplit(url).scheme.lower() not in REDIS_SCHEMES + MOONCAKE_SCHEMES:
        raise InvalidConfig(f"unknown scheme in {redact(url)!r}: use redis://HOST:PORT/DB (Redis or Valkey) or "
                            "mooncake://MASTER_HOST:PORT", "shared_cache")
