"""What the engine asks a drafter: tokens that may follow each decoding sequence (verified by the base), and what it
tells one after each step (a drafter with its own K/V catches up on what the base computed)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvforge.runtime.model_executor import BatchOutput
    from kvforge.runtime.sampling import SampleResult
    from kvforge.runtime.scheduler import ScheduledRow
    from kvforge.runtime.sequence import Sequence


class Proposer(Protocol):
    # Drafts with K/V of its own (EAGLE3): its sequences' admissions take draft pages and reuse only records with a
    # coherent draft path; the engine also asks the base for hidden states at every position it computes.
    owns_kv: bool

    def observe(self, rows: list[ScheduledRow], output: BatchOutput, sampled: list[list[SampleResult]]) -> None:
        """A step ran (before its commit): `sampled[i]` are the tokens row i commits (none short of its end)."""
        ...

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Draft tokens to verify after each sequence's tokens (at most `limits[i]`; none when there is no guess)."""
        ...
