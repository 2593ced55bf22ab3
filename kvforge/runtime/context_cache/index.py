"""Page index: page key → the canonical physical page holding that content (first committer wins)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class IndexEntry:
    page: int
    token_bytes: bytes  # the page's token ids, compared on every hit (a collision can never serve stale KV)


class PageIndex:
    __slots__ = ("_entries", "_key_of_page")

    def __init__(self) -> None:
        self._entries: dict[bytes, IndexEntry] = {}
        self._key_of_page: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup_longest(self, keys: Sequence[bytes], token_ids: np.ndarray, tokens_per_page: int) -> list[int]:
        """Pages of the longest run of leading keys present with matching tokens. No side effects."""
        pages = []
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None or entry.token_bytes != page_token_bytes(token_ids, i, tokens_per_page):
                break
            pages.append(entry.page)
        return pages

    def canonical(self, key: bytes, token_bytes: bytes) -> int | None:
        """The page for `key` when its stored tokens match; None when absent (or, in theory, a collision)."""
        entry = self._entries.get(key)
        return entry.page if entry is not None and entry.token_bytes == token_bytes else None

    def key_of(self, page: int) -> bytes:
        return self._key_of_page.get(page, b"")

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def insert(self, key: bytes, page: int, token_bytes: bytes) -> None:
        if key in self._entries or page in self._key_of_page:
            raise AssertionError("index insert over an existing key or page; callers check canonical() first")
        self._entries[key] = IndexEntry(page, token_bytes)
        self._key_of_page[page] = key

    def forget_page(self, page: int) -> None:
        """Called when a page returns to the free list: its content is about to be overwritten."""
        key = self._key_of_page.pop(page, None)
        if key is not None:
            del self._entries[key]

    def items(self) -> list[tuple[bytes, IndexEntry]]:
        return list(self._entries.items())


def page_token_bytes(token_ids: np.ndarray, page: int, tokens_per_page: int) -> bytes:
    """The token ids of page `page` as stored in an index entry (little-endian int32)."""
    return np.ascontiguousarray(token_ids[page * tokens_per_page:(page + 1) * tokens_per_page], dtype="<i4").tobytes()
