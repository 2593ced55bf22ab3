"""The encoder embedding cache: encoder outputs by (tenant scope, media digest), LRU over a byte budget, thread-safe."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kvforge.contract.errors import InvalidConfig

DEFAULT_ENCODER_CACHE_BUDGET_BYTES = 256 * 1024 * 1024
SHARED_SCOPE = b""  # requests without a cache salt (request files, kvforge.LLM) share one scope


def cache_scope(cache_salt: str | None) -> bytes:
    """The encoder-cache scope of a request's cache salt, so encoder outputs are isolated as its KV pages are.

    Without it a tenant learns from a hit (its counters on the keyless /metrics, its latency) that another tenant
    sent the same image. No salt is the shared scope; any salt, "" included, is its own (as in the page keys,
    where None and "" differ). A digest, not the salt: the salt (an HMAC of the tenant in llm_serve) is not kept
    in memory longer than the request, and every scope key has one length."""
    if cache_salt is None:
        return SHARED_SCOPE
    return hashlib.blake2b(b"kvforge-encoder-scope-v1\x00" + cache_salt.encode("utf-8"), digest_size=16).digest()


@dataclass(slots=True)
class EncoderCache:
    """budget_bytes 0 disables it; an entry larger than the budget is never stored (it runs uncached).

    Counters are cumulative over the process (warmup included), like the context-cache counters: `misses` counts
    every item the encoder had to run for, so with the cache disabled every item is a miss.

    One lock guards the entries and the counters: media may be decoded and encoded off the engine thread while
    the engine thread reads `to_dict()` for the profile and /metrics. One LRU and one budget for all scopes."""

    budget_bytes: int = DEFAULT_ENCODER_CACHE_BUDGET_BYTES
    entries: OrderedDict[tuple[bytes, bytes], np.ndarray] = field(default_factory=OrderedDict)
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    oversize: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise InvalidConfig(f"must be >= 0 (0 disables the cache), got {self.budget_bytes}",
                                "encoder_cache_budget_bytes")

    def get(self, digest: bytes, scope: bytes = SHARED_SCOPE) -> np.ndarray | None:
        """The rows stored for `digest` in `scope` (see cache_scope), counting a hit or a miss."""
        key = (scope, digest)
        with self.lock:
            embeds = self.entries.get(key)
            if embeds is None:
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
            return embeds

    def put(self, digest: bytes, embeds: np.ndarray, scope: bytes = SHARED_SCOPE) -> bool:
        """Store an encoder output, evicting least recently used entries to make room; False if not stored."""
        key = (scope, digest)
        size = int(embeds.nbytes)
        with self.lock:
            if key in self.entries or self.budget_bytes == 0:
                return False
            if size > self.budget_bytes:
                self.oversize += 1
                return False
            while self.bytes + size > self.budget_bytes:
                _, evicted = self.entries.popitem(last=False)
                self.bytes -= int(evicted.nbytes)
                self.evictions += 1
            embeds.setflags(write=False)  # shared by every request that hits it
            self.entries[key] = embeds
            self.bytes += size
            return True

    def to_dict(self) -> dict[str, int]:
        with self.lock:  # one consistent snapshot of the counters
            return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "bytes": self.bytes,
                    "entries": len(self.entries), "budget_bytes": self.budget_bytes}
