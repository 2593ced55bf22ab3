"""What the engine asks a drafter: tokens that may follow each decoding sequence (verified by the base), and what it
tells one after each step (a drafter with its own K/V catches up on what the base computed)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

from kvforge.runtime.context_cache.types.draft_paths import draft_of

if TYPE_CHECKING:
    from kvforge.runtime.sampling.sampler import SampleResult
    from kvforge.runtime.sequence import Sequence
    from kvforge.runtime.step import BatchOutput, ScheduledRow


@dataclass(slots=True)
class DraftTree:
    """A tree proposal: `parents[i]` is the index of token i's parent in `token_ids` (-1: the sequence's pending
    token), parents before children. The base verifies every node in one call under a tree attention mask."""

    token_ids: list[int]
    parents: list[int]


class Proposer(Protocol):
    """A drafter, by the lifecycle of llama.cpp's common/speculative.h as a checklist, one step per method:

    begin     a generation starts (admission, or re-admission after preemption): `DraftLifecycle.begin`
    draft     propose tokens for each decoding sequence: `propose_batch`
    accept    the base verified them; the committed tokens (and hidden states) come back: `observe`
    rollback  a recurrent base rejected a verify row and restored its state: `DraftLifecycle.rollback`
    end       the request finished or was aborted; its state goes: `DraftLifecycle.end`

    Every proposer has draft and accept. The per-request hooks are `DraftLifecycle`'s: a proposer that keeps state
    between steps keeps it per request id in a `DraftStates` and inherits them from `KeepsDraftStates`."""

    # Drafts with K/V of its own (EAGLE3): its sequences' admissions take draft pages and reuse only records with a
    # coherent draft path; the engine also asks the base for hidden states at every position it computes.
    owns_kv: bool

    def observe(self, rows: list[ScheduledRow], output: BatchOutput, sampled: list[list[SampleResult]]) -> None:
        """A step ran (before its commit): `sampled[i]` are the tokens row i commits (none short of its end)."""
        ...

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int] | DraftTree]:
        """Draft tokens to verify after each sequence's tokens (at most `limits[i]`; none when there is no guess): a
        chain, or a tree of at most `limits[i]` nodes."""
        ...


@runtime_checkable
class DraftLifecycle(Protocol):
    """The per-request steps of the lifecycle (see `Proposer`), for a proposer that keeps its own state by request
    id: the engine calls them when a generation begins, a recurrent verify row rolls back, and a request ends."""

    def begin(self, seq: Sequence) -> None:
        """A generation starts for `seq` (from its reuse point): forget anything kept for an earlier admission."""
        ...

    def rollback(self, seq: Sequence) -> None:
        """`seq`'s last verify row was rejected on a recurrent base: drop what was drafted past its committed
        tokens (they are recomputed next step)."""
        ...

    def end(self, request_id: str) -> None:
        """The request finished or was aborted: its state goes."""
        ...


S = TypeVar("S")


@dataclass(slots=True)
class DraftStates(Generic[S]):
    """What a proposer keeps between steps, per request id (instead of an untyped field on the sequence):
    `begin` and `end` bracket a generation, so nothing outlives its request."""

    states: dict[str, S] = field(default_factory=dict)

    def begin(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def get(self, request_id: str) -> S | None:
        return self.states.get(request_id)

    def set(self, request_id: str, state: S) -> None:
        self.states[request_id] = state

    def end(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def __len__(self) -> int:
        return len(self.states)


class KeepsDraftStates(Generic[S]):
    """`DraftLifecycle` over a proposer's `states`: a generation's begin (admission, and preemption, after which it
    is recomputed) and a recurrent rollback drop what was drafted from; the request's end drops it for good."""

    states: DraftStates[S]

    def begin(self, seq: Sequence) -> None:
        self.states.begin(seq.request_id)

    def rollback(self, seq: Sequence) -> None:
        self.states.begin(seq.request_id)  # drafted past the committed tokens, which are recomputed next step

    def end(self, request_id: str) -> None:
        self.states.end(request_id)


def committed_spans(rows: list[ScheduledRow], output: BatchOutput, sampled: list[list[SampleResult]],
                    rolls_back: bool = False) -> Iterator[tuple[int, Sequence, int, int]]:
    """For a drafter with its own K/V, before the commit: (row index, sequence, start, end) of the base positions
    [start, end) each drafting row's step commits (prompt chunks, verify rows' accepted tokens) whose hidden states
    came back. The draft K/V must cover exactly [0, start) at this point. `rolls_back`: the base carries recurrent
    state, so a verify row that rejects a draft commits nothing this step (its state goes back to before the call
    and the kept tokens are recomputed next step, when the draft catches up on them)."""
    for i, (row, samples) in enumerate(zip(rows, sampled, strict=True)):
        seq, draft = row.seq, draft_of(row.seq.lease)
        if not seq.drafts_with_kv or draft is None:
            continue
        if rolls_back and max(len(samples) - 1, 0) < len(row.draft_token_ids):
            continue
        start = seq.num_computed_tokens  # the commit has not moved it yet
        if draft.computed != start and not draft.replays_to(start):
            raise AssertionError("the draft K/V lags the base's committed positions")
        end = start + row.num_new_tokens + max(len(samples) - 1, 0)
        if end <= start or output.hidden_states is None or output.hidden_states[i] is None:
            continue
        yield i, seq, start, end
