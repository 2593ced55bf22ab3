"""What the cache asks the engine to copy: the one seam between the cache core and bytes, one copier per type.

The cache decides which slot holds what; the engine moves the bytes. Each type that copies reads its copier from
`CacheSetup.copiers[its name]` (its module defines the copier's protocol: `TailCopier`, `CheckpointCopier`,
`DocumentCopier`, `CorrectionCopier`), so a type's captures and restores go one way, through its own copier. Passing
the copiers at construction (not setting callbacks afterwards) means a manager is complete once built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvforge.contract.profile_schema import PARTIAL_KV_SNAPSHOTS, RECURRENT_SNAPSHOTS
from kvforge.runtime.context_cache.lease import Lease

Copiers = Mapping[str, Any]  # cache type name -> the object that moves that type's bytes


class SnapshotCopier(Protocol):
    """The engine's state manager: the copier of both snapshot types (partial tails, recurrent checkpoints)."""

    def capture_partial(self, page: int, slot: int) -> None:
        """Copy KV page `page` of every attention layer into partial-KV snapshot slot `slot`."""
        ...

    def restore_partial(self, slot: int, page: int) -> None:
        """Copy partial-KV snapshot `slot` into KV page `page` (copy-on-partial-reuse)."""
        ...

    def capture_recurrent(self, lease: Lease, slot: int) -> None:
        """Copy the live recurrent + conv state of the sequence holding `lease` into recurrent snapshot slot `slot`."""
        ...

    def restore_recurrent(self, slot: int, lease: Lease) -> None:
        """Copy recurrent snapshot `slot` into the state of the sequence holding `lease`."""
        ...


def snapshot_copiers(copier: SnapshotCopier | None) -> dict[str, Any]:
    """`copier` as the copier of both snapshot types (the manager's `copier=` shortcut)."""
    return {} if copier is None else {PARTIAL_KV_SNAPSHOTS: copier, RECURRENT_SNAPSHOTS: copier}
