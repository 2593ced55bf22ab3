"""The encoder embedding cache: encoder outputs by media digest, LRU over a byte budget (separate from KV reuse)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kvforge.contract.errors import InvalidConfig

DEFAULT_ENCODER_CACHE_BUDGET_BYTES = 256 * 1024 * 1024


@dataclass(slots=True)
class EncoderCache:
    """budget_bytes 0 disables it; an entry larger than the budget is never stored (it runs uncached).

    Counters are cumulative over the process (warmup included), like the context-cache counters: `misses` counts
    every item the encoder had to run for, so with the cache disabled every item is a miss."""

    budget_bytes: int = DEFAULT_ENCODER_CACHE_BUDGET_BYTES
    entries: OrderedDict[bytes, np.ndarray] = field(default_factory=OrderedDict)
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    oversize: int = 0

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise InvalidConfig(f"must be >= 0 (0 disables the cache), got {self.budget_bytes}",
                                "encoder_cache_budget_bytes")

    def get(self, digest: bytes) -> np.ndarray | None:
        embeds = self.entries.get(digest)
        if embeds is None:
            self.misses += 1
            return None
        self.entries.move_to_end(digest)
        self.hits += 1
        return embeds

    def put(self, digest: bytes, embeds: np.ndarray) -> bool:
        """Store an encoder output, evicting least recently used entries to make room; False if not stored."""
        size = int(embeds.nbytes)
        if digest in self.entries or self.budget_bytes == 0:
            return False
        if size > self.budget_bytes:
            self.oversize += 1
            return False
        while self.bytes + size > self.budget_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= int(evicted.nbytes)
            self.evictions += 1
        embeds.setflags(write=False)  # shared by every request that hits it
        self.entries[digest] = embeds
        self.bytes += size
        return True

    def to_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "bytes": self.bytes,
                "entries": len(self.entries), "budget_bytes": self.budget_bytes}
