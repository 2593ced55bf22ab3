"""What the engine asks a drafter: up to `limit` tokens that may follow a sequence's tokens (verified by the base)."""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Draft tokens to verify after `token_ids` (at most `limit`; none when the drafter has no guess)."""
        ...
