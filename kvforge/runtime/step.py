"""What one engine step passes between its parts: the rows the scheduler chose (`ScheduledRow`, `SchedulerOutput`),
what the executor computed for them (`BatchOutput`) and what the commit appended (`RowUpdate`).

They live here, not in the scheduler or the executor, so proposers, the executor and the shared tier speak the
step's vocabulary without importing the loop."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvforge.runtime.sequence import Sequence


@dataclass(slots=True)
class ScheduledRow:
    seq: Sequence
    num_new_tokens: int  # tokens this step computes for the row, from seq.num_computed_tokens on
    is_prefill: bool  # computes more than the one token sampled last (a prompt chunk or a recompute)
    # Proposed tokens verified after the row's pending ones (speculative decoding): the call computes
    # num_new_tokens + len(draft_token_ids) positions and returns logits at the last pending one and each draft.
    draft_token_ids: list[int] = field(default_factory=list)
    # A tree of drafts (Sequence.spec_parents: parent index per draft, -1 = the pending token); empty = a chain.
    draft_parents: list[int] = field(default_factory=list)

    @property
    def reaches_end(self) -> bool:
        """Whether this call computes the sequence's last pending token, so its logits give the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens >= self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # admission raised for them: finished with an error

    @property
    def has_prefill(self) -> bool:
        return any(row.is_prefill for row in self.rows)

    @property
    def has_decode(self) -> bool:
        return any(not row.is_prefill for row in self.rows)


@dataclass(slots=True)
class RowUpdate:
    """What a step committed for one row that reached its end: the tokens appended (1..k+1) and drafts rejected."""

    seq: Sequence
    new_token_ids: list[int]
    num_drafts: int = 0  # draft tokens the row verified
    num_rejected: int = 0



@dataclass(slots=True)
class BatchOutput:
    """What one step's engine calls produced, per scheduled row (in the rows' order).

    `logits[i]` is [1 + len(rows[i].draft_token_ids), V]: the logits after the row's last pending token, then
    after each of its draft tokens (the positions whose next token is sampled or verified).
    `hidden_states[i]`, when the engine exports them, is [same positions, layers * H]: the hidden states of the
    layers a drafter names, at those positions; with `ModelExecutor.all_hidden` (an EAGLE3 drafter reads them) it is
    [every position the row computed, layers * H], from its first new token on.
    """

    logits: list[np.ndarray]
    hidden_states: list[np.ndarray] | None = None
