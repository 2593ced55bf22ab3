"""Page math every layer agrees on: how many pages hold a number of tokens, and the page groups of an engine."""

from __future__ import annotations

from dataclasses import dataclass

GLOBAL_PAGE_TABLE = "kv_page_table"  # the graph input of the global group: every layer not in another group


@dataclass(frozen=True, slots=True)
class PageGroup:
    """Layers that keep their own pages (a pool of `pages` each), read and written through their own page table
    (graph input `table_input`); the cache type named for the group fills each row's table. Every other attention
    layer is in the global group (`GLOBAL_PAGE_TABLE`, the lease's page ids)."""

    name: str
    layers: tuple[int, ...]  # layer ids (past_key_values_{i})
    pages: int
    table_input: str


def pages_for(tokens: int, tokens_per_page: int) -> int:
    """Pages needed to hold `tokens` tokens (a partial last page counts)."""
    return -(-tokens // tokens_per_page)
