"""The in-process store tier tests use; it lives in the package (kvforge/runtime/shared_tier/stores/memory.py)."""

from kvforge.runtime.shared_tier.stores.memory import MemoryStore

__all__ = ["MemoryStore"]
