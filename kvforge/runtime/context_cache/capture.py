"""What the cache asks the engine to copy when it publishes a snapshot: the one seam between the cache core and bytes.

The cache decides which slot holds what; the engine's state manager moves the bytes through the runner's storage.
Passing the copier at construction (not setting callbacks afterwards) means a manager is complete once built.
"""

from __future__ import annotations

from typing import Protocol

from kvforge.runtime.context_cache.lease import Lease


class SnapshotCopier(Protocol):
    def capture_partial(self, page: int, slot: int) -> None:
        """Copy KV page `page` of every attention layer into partial-KV snapshot slot `slot`."""
        ...

    def capture_recurrent(self, lease: Lease, slot: int) -> None:
        """Copy the live recurrent + conv state of the sequence holding `lease` into recurrent snapshot slot `slot`."""
        ...
