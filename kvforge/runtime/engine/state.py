"""A sequence's state beside its KV pages: recurrent state rows, snapshot restores at admission, captures on publish.

The scheduler calls `on_admit` / `on_release`; the cache's snapshot types call `capture_*` / `restore_*` (this is
their copier: `SnapshotCopier`); the model runner reads `rows`. One object built with everything it moves bytes through,
instead of callbacks set on three collaborators after they were built.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.execution.recurrent_state import RecurrentStates
from kvforge.runtime.execution.snapshots import PartialKVSnapshotStore, RecurrentSnapshotStore
from kvforge.runtime.execution.system_prompt_cache import SystemPromptCache
from kvforge.runtime.sequence import EngineRequest, Sequence

# Message-boundary checkpoints closer than this to the previous one are skipped: experiments/reuse/recurrent_reuse.py
# measured a chat turn on Mamba2-130m at 2x the TTFT when the boundary 5 tokens past its restored checkpoint split the
# call.
MIN_BOUNDARY_GAP = 32


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Where a recurrent or hybrid sequence's state is captured mid-prompt (besides the prompt's end)."""

    enabled: bool = False  # a recurrent snapshot pool exists
    message_boundaries: bool = True
    interval_tokens: int = 0  # 0 = no periodic checkpoints

    def positions(self, request: EngineRequest, start: int = 0) -> tuple[int, ...]:
        """Prompt positions after `start` (the reuse point) where this request's recurrent state is captured.

        The prompt's end always: a recompute after preemption (prompt + output in one go) must stop there, or the
        prompt's checkpoint would hold the state after some generated tokens. Every `interval_tokens` multiple.
        Message boundaries at least MIN_BOUNDARY_GAP tokens after the previous kept one (the reuse point first):
        each one ends an engine call early and copies the state, which a boundary a few tokens past the restored
        checkpoint (the last answer's end marker in a chat) would pay for nothing.
        """
        if not self.enabled:
            return ()
        end = len(request.prompt_ids)
        positions = {end}
        if self.message_boundaries:
            last = start
            for boundary in request.message_boundaries:
                if boundary - last >= MIN_BOUNDARY_GAP:
                    positions.add(boundary)
                    last = boundary
        if self.interval_tokens:
            positions.update(range(self.interval_tokens, end, self.interval_tokens))
        return tuple(sorted(p for p in positions if start < p <= end))


class StateManager:
    """Owns the running sequences' recurrent rows and every copy between snapshots, the legacy cache and the pool."""

    __slots__ = ("tokens_per_page", "states", "partial", "recurrent", "system_prompts", "checkpoints", "rows")

    def __init__(self, *, tokens_per_page: int, states: RecurrentStates | None,
                 partial: PartialKVSnapshotStore | None, recurrent: RecurrentSnapshotStore | None,
                 system_prompts: SystemPromptCache | None, checkpoints: CheckpointPolicy = CheckpointPolicy()) -> None:
        self.tokens_per_page = tokens_per_page
        self.states = states
        self.partial = partial
        self.recurrent = recurrent
        self.system_prompts = system_prompts
        self.checkpoints = checkpoints
        self.rows: dict[Lease, int] = {}  # running sequences' recurrent state rows, by lease

    # --- the scheduler's calls -----------------------------------------------------------------------

    def on_admit(self, seq: Sequence) -> None:
        """Give an admitted sequence its state: a zeroed recurrent row and the legacy system prompt's K/V. The
        scheduler then has the cache restore its hits (each type through its copier: this object for the
        snapshots) and tells it the restores are done."""
        lease = seq.lease
        assert lease is not None
        seq.checkpoints = self.checkpoints.positions(seq.request, seq.num_computed_tokens)
        if self.states is not None:
            self.rows[lease] = self.states.allocate()  # zeroed: the state before any token
        self._restore_system_prompt(seq)

    def on_release(self, lease: Lease) -> None:
        """A sequence finished or was preempted: its state row goes back (a preempted one restarts from a checkpoint
        or from zero, like its pages)."""
        row = self.rows.pop(lease, None)
        if row is not None:
            assert self.states is not None
            self.states.free(row)

    def on_prompt_computed(self, seq: Sequence) -> None:
        """The prompt is in the pool: the legacy cache keeps a copy of its system prompt (first computation only)."""
        key = seq.request.system_prompt_key
        if key is not None and self.system_prompts is not None and not seq.reused_tokens and seq.lease is not None:
            self.system_prompts.save(key, seq.request.system_prompt_ids, seq.prompt_ids, seq.lease.page_ids)

    @property
    def carries_rows(self) -> bool:
        """Whether sequences carry recurrent state rows (a rejected draft then needs the state before the call)."""
        return self.states is not None

    def save_before_verify(self, leases: list[Lease]) -> None:
        """Keep the recurrent rows of sequences about to verify drafts, so a rejection can go back to them."""
        if self.states is not None and leases:
            self.states.save([self.rows[lease] for lease in leases])

    def rollback(self, lease: Lease) -> None:
        """Put the sequence's recurrent row back to its value before the last call (saved for rows with drafts)."""
        assert self.states is not None
        self.states.rollback(self.rows[lease])

    # --- the snapshot types' copier (context_cache/capture.py SnapshotCopier) ------------------------------

    def capture_partial(self, page: int, slot: int) -> None:
        assert self.partial is not None, "a partial-KV capture without a snapshot store"
        self.partial.capture(page, slot)

    def restore_partial(self, slot: int, page: int) -> None:
        assert self.partial is not None, "a snapshot hit without a snapshot store"
        self.partial.restore(slot, page)

    def capture_recurrent(self, lease: Lease, slot: int) -> None:
        assert self.recurrent is not None, "a checkpoint capture without a recurrent snapshot store"
        self.recurrent.capture(self.rows[lease], slot)

    def restore_recurrent(self, slot: int, lease: Lease) -> None:
        assert self.recurrent is not None, "a checkpoint hit without a recurrent snapshot store"
        self.recurrent.restore(slot, self.rows[lease])

    def _restore_system_prompt(self, seq: Sequence) -> None:
        key = seq.request.system_prompt_key
        if key is None or self.system_prompts is None or seq.num_computed_tokens or seq.lease is None:
            return
        restored = self.system_prompts.restore(key, seq.prompt_ids, seq.lease.page_ids)
        if restored:
            seq.num_computed_tokens = restored
            if seq.num_preemptions == 0:
                seq.reused_tokens = restored
