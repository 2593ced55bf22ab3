"""Continuous batching: which sequences run in the next engine call, and how many tokens each computes.

Each step fills a token budget. Running sequences go first, oldest first: a decode row takes one
token, a row still prefilling takes a chunk. Waiting sequences are then admitted in arrival order
while rows and budget remain. Nothing here raises for a full pool: a waiting sequence that does not
fit stays waiting (and, first come first served, so do the ones behind it); a running sequence that
cannot grow preempts the newest running sequence (possibly itself), whose pages go back to the pool
and which is recomputed later, usually from its own published pages. A waiting sequence whose next
page another running sequence is computing is skipped until that page is done (in-flight sharing).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvforge.contract.profile_schema import SCHEDULER_KEYS
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.manager import ContextCacheManager
from kvforge.runtime.sequence import Sequence, Status
from kvforge.runtime.state_manager import StateManager


@dataclass(slots=True)
class ScheduledRow:
    seq: Sequence
    num_new_tokens: int  # tokens this step computes for the row, from seq.num_computed_tokens on
    is_prefill: bool  # computes more than the one token sampled last (a prompt chunk or a recompute)
    # Proposed tokens verified after the row's pending ones (speculative decoding): the call computes
    # num_new_tokens + len(draft_token_ids) positions and returns logits at the last pending one and each draft.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def has_prefill(self) -> bool:
        return any(row.is_prefill for row in self.rows)

    @property
    def has_decode(self) -> bool:
        return any(not row.is_prefill for row in self.rows)


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    mixed_steps: int = 0  # prefill chunks and decode rows in one engine call
    preemptions: int = 0
    max_running: int = 0
    inflight_prefix_waits: int = 0  # times a waiting sequence let another finish a shared prefix first

    def to_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in SCHEDULER_KEYS}  # field names are the profile's keys


class Scheduler:
    def __init__(self, cache: ContextCacheManager, state: StateManager | None = None, *, max_batch_size: int,
                 max_num_tokens: int, prefill_chunk_tokens: int) -> None:
        """`state`: restores a sequence's snapshots at admission and frees its recurrent row at release (None: a
        model-free test whose sequences carry no state besides their pages)."""
        self.cache = cache
        self.state = state
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order: the last is preempted first
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            count = self._tokens_for(seq, budget)
            if self._grow_or_preempt(seq, count, out):
                out.rows.append(ScheduledRow(seq, count, seq.is_prefilling))
                budget -= count
        if not out.preempted:  # a step that had to preempt admits nobody: the pool is already short
            budget = self._admit_waiting(budget, out)
        if out.rows:
            self.stats.steps += 1
            self.stats.mixed_steps += out.has_prefill and out.has_decode
            self.stats.max_running = max(self.stats.max_running, len(self.running))
        return out

    def _tokens_for(self, seq: Sequence, budget: int) -> int:
        """A chunk ends at the sequence's next checkpoint, so its state there can be captured after the call."""
        return min(seq.num_pending_tokens, budget, self.prefill_chunk_tokens, seq.tokens_to_next_checkpoint())

    def _grow_or_preempt(self, seq: Sequence, count: int, out: SchedulerOutput) -> bool:
        """Pages for `count` more tokens of `seq`, preempting the newest running sequences until they fit."""
        assert seq.lease is not None
        while not self.cache.try_grow(seq.lease, seq.num_computed_tokens + count):
            victim = self.running[-1]
            alone = len(self.running) == 1
            self.preempt(victim, out)
            if victim is seq:
                # Engine.add_request refuses requests that cannot complete alone, so this cannot happen.
                assert not alone, "a sequence alone in the pool cannot grow"
                return False
        return True

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            admission = seq.next_admission()
            if self.cache.prefix_in_flight(admission):
                self.stats.inflight_prefix_waits += 1
                skipped.append(self.waiting.popleft())
                continue
            lease = self.cache.try_acquire(admission)
            if lease is None:
                break  # first come, first served: later arrivals do not overtake a sequence waiting for pages
            self.waiting.popleft()
            seq.lease, seq.status = lease, Status.RUNNING
            seq.num_computed_tokens = lease.reuse_tokens
            if seq.num_preemptions == 0:
                seq.reused_tokens = lease.reuse_tokens
            if self.state is not None:
                self.state.on_admit(seq)
                self.cache.finish_restore(lease)  # the copies are done (a no-op without restores)
            self.running.append(seq)
            out.admitted.append(seq)
            count = self._tokens_for(seq, budget)
            out.rows.append(ScheduledRow(seq, count, seq.is_prefilling))
            budget -= count
        self.waiting.extendleft(reversed(skipped))  # they keep their place in the queue
        return budget

    def preempt(self, seq: Sequence, out: SchedulerOutput | None = None) -> None:
        """Give a running sequence's pages back; it waits at the head of the queue and is recomputed later."""
        self.running.remove(seq)
        if seq.lease is not None:
            self._release(seq.lease)  # never published: its in-flight pages leave unless others hold them
        seq.lease, seq.status = None, Status.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)
        if out is not None:
            out.preempted.append(seq)
            out.rows = [row for row in out.rows if row.seq is not seq]

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence from the queues and release its lease (publication, if any, happened before)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.lease is not None:
            self._release(seq.lease)
            seq.lease = None
        seq.status = Status.FINISHED

    def _release(self, lease: Lease) -> None:
        self.cache.release(lease)
        if self.state is not None:
            self.state.on_release(lease)
