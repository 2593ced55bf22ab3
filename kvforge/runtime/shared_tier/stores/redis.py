"""Redis and Valkey as a shared-tier store, over RESP with redis-py (and hiredis's parser when it is installed).

Binary keys go in as they are, under a prefix (`?prefix=`, default `kvf:`) so one database can hold other data.
`SET NX` keeps the first writer's value (content addressing; a plain SET replaces a damaged one), and a bounded get
is `GETRANGE` (a value past the bound never crosses the wire whole); one pipelined round trip per batch. redis-py's own
retries are off: a dead store must fail in one timeout, not after a retry schedule of seconds; its connection
pool reconnects on the next call by itself, so a restarted server needs nothing from us.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.shared_tier.store import StoreError, StoreUnavailable, redact

DEFAULT_PREFIX = "kvf:"
T = TypeVar("T")


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise InvalidConfig("the Redis backend needs redis-py: pip install 'kvforge[tier]'", "shared_cache") from None
    return redis


class RedisStore:
    """A SharedStore on one Redis or Valkey database. redis-py clients are thread-safe (a connection per call from
    its pool), so the tier's load and write threads share one instance."""

    def __init__(self, url: str, timeout_s: float) -> None:
        redis = _import_redis()
        self._errors = redis.exceptions
        self.url = redact(url)
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        self.prefix = query.pop("prefix", DEFAULT_PREFIX).encode("utf-8")
        scheme = {"valkey": "redis", "valkeys": "rediss"}.get(parts.scheme.lower(), parts.scheme.lower())
        client_url = parts._replace(scheme=scheme, query=urlencode(query)).geturl()
        try:  # parses only: redis-py connects on the first command
            self.client = redis.Redis.from_url(client_url, socket_timeout=timeout_s,
                                               socket_connect_timeout=timeout_s, retry_on_timeout=False,
                                               retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
                                               health_check_interval=0)
        except ValueError as exc:
            raise InvalidConfig(f"{self.url}: {exc}", "shared_cache") from None

    def _call(self, action: Callable[[], T]) -> T:
        """One round trip; redis-py's exceptions become the tier's two kinds, in one line naming the store."""
        try:
            return action()
        except (self._errors.ConnectionError, self._errors.TimeoutError) as exc:
            raise StoreUnavailable(f"{self.url}: {_first_line(exc)}", "shared_cache") from None
        except self._errors.RedisError as exc:  # OOM under noeviction, a wrong password, a read-only replica
            raise StoreError(f"{self.url}: {_first_line(exc)}", "shared_cache") from None

    def connect(self) -> None:
        self._call(self.client.ping)

    def put(self, items: Sequence[tuple[bytes, bytes]], *, replace: bool = False) -> None:
        if not items:
            return

        def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self.prefix + bytes(key), value, nx=not replace)
            pipe.execute()
        self._call(run)

    def get(self, keys: Sequence[bytes], *, max_bytes: int | None = None) -> list[bytes | None]:
        if not keys:
            return []
        names = [self.prefix + bytes(key) for key in keys]
        if max_bytes is None:
            return self._call(lambda: self.client.mget(names))

        def run() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=False)
            for name in names:  # GETRANGE's end is inclusive: one byte more than allowed marks a value too large
                pipe.getrange(name, 0, max_bytes)
            # An absent key reads as b"", and so would an empty value: neither is a tier value, both are misses.
            return [value or None for value in pipe.execute()]
        return self._call(run)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.prefix + bytes(key))
            return [bool(found) for found in pipe.execute()]
        return self._call(run)

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call(lambda: self.client.delete(*[self.prefix + bytes(key) for key in keys]))

    def close(self) -> None:
        self.client.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
