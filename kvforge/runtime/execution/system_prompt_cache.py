"""The legacy exact system-prompt cache (`save_system_prompt_kv_cache`): a private KV copy per system prompt.

Kept for users of the seed toolchain; it predates generalized context reuse and cannot be combined
with it. Key: (formatted system prompt, LoRA name). The copy is taken after a prefill and restored
into a new sequence's pages when its prompt token ids start with exactly the system prompt's ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kvforge.runtime.execution.backend import KVStorage

log = logging.getLogger("kvforge.system_prompt_cache")


@dataclass(frozen=True, slots=True)
class SavedPrompt:
    token_ids: tuple[int, ...]
    rows: list[np.ndarray]  # per layer [n, 2, Hkv, D] in the storage dtype


class SystemPromptCache:
    """Copies go through the runner's KVStorage, so the cache works the same on host and device pools."""

    __slots__ = ("_entries", "_storage")

    def __init__(self, storage: KVStorage) -> None:
        self._entries: dict[tuple[str, str], SavedPrompt] = {}
        self._storage = storage

    def __len__(self) -> int:
        return len(self._entries)

    def restore(self, key: tuple[str, str], prompt_ids: list[int], page_ids: list[int]) -> int:
        """Copy a saved system prompt into the sequence's pages; returns how many tokens are now cached."""
        saved = self._entries.get(key)
        if saved is None or not _aligned(saved.token_ids, prompt_ids):
            return 0
        self._storage.write_tokens(page_ids, saved.rows)
        return len(saved.token_ids)

    def save(self, key: tuple[str, str], system_ids: list[int], prompt_ids: list[int], page_ids: list[int]) -> bool:
        if key in self._entries or not system_ids:
            return False
        if not _aligned(tuple(system_ids), prompt_ids):
            log.warning("system prompt tokens are not a prefix of the prompt tokens; not caching it")
            return False
        self._entries[key] = SavedPrompt(tuple(system_ids), self._storage.read_tokens(page_ids, len(system_ids)))
        return True


def _aligned(system_ids: tuple[int, ...], prompt_ids: list[int]) -> bool:
    # The last prompt token must still run through the engine to produce logits.
    return len(system_ids) < len(prompt_ids) and tuple(prompt_ids[:len(system_ids)]) == system_ids
