"""Page math every layer agrees on: how many pages hold a number of tokens."""

from __future__ import annotations


def pages_for(tokens: int, tokens_per_page: int) -> int:
    """Pages needed to hold `tokens` tokens (a partial last page counts)."""
    return -(-tokens // tokens_per_page)
