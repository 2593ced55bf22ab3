"""`open_store`: the backend a `--sharedCache` URL names, imported only when asked for (each has its own client)."""

from __future__ import annotations

from urllib.parse import urlsplit

from kvforge.runtime.shared_tier.store import DEFAULT_TIMEOUT_S, REDIS_SCHEMES, SharedStore, check_store_url


def open_store(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> SharedStore:
    """The store `url` names: redis:// rediss:// unix:// valkey:// (Redis or Valkey over RESP) or mooncake:// (a
    Mooncake Store master). Raises InvalidConfig naming `shared_cache` for a URL no backend takes, or for a backend
    whose client library is not installed; connecting is lazy, so an unreachable store is not an error here."""
    check_store_url(url, timeout_s)
    if urlsplit(url).scheme.lower() in REDIS_SCHEMES:
        from kvforge.runtime.shared_tier.stores.redis import RedisStore

        return RedisStore(url, timeout_s)
    from kvforge.runtime.shared_tier.stores.mooncake import MooncakeStore

    return MooncakeStore(url, timeout_s)
