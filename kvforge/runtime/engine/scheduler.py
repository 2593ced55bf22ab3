"""Continuous batching: which sequences run in the next engine call, how many tokens each computes, and what a
call's results change (the commit step).

Each step fills a token budget. Running sequences go first, oldest first: a decode row takes one
token (plus its draft tokens, when a drafter proposed some), a row still prefilling takes a chunk.
Waiting sequences are then admitted in arrival order while rows and budget remain. Nothing here raises
for a full pool: a waiting sequence that does not fit stays waiting (and, first come first served, so
do the ones behind it); a running sequence that cannot grow preempts the newest running sequence
(possibly itself), whose pages go back to the pool and which is recomputed later, usually from its own
published pages. A waiting sequence whose next page another running sequence is computing is skipped
until that page is done (in-flight sharing). A sequence whose pages an external loader is fetching
waits in WAITING_FOR_REMOTE with its lease, without holding up the queue behind it.

`update_from_output` applies a step: it advances `num_computed_tokens` (or rolls drafts back), makes
finished prompt pages findable, publishes prompts and checkpoints, appends the committed tokens under
the stop rules, and finishes sequences.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvforge.contract.profile_schema import SCHEDULER_KEYS
from kvforge.runtime.context_cache.lease import Lease, Prerequisite
from kvforge.runtime.context_cache.manager import ContextCacheManager
from kvforge.runtime.engine.state import StateManager
from kvforge.runtime.sampling.sampler import Sampler, SampleResult
from kvforge.runtime.sequence import EngineRequest, FinishReason, Sequence, Status
from kvforge.runtime.step import RowUpdate, ScheduledRow, SchedulerOutput
from kvforge.runtime.types import CommitPolicy, Deployment, SamplingParams

# A prerequisite (a document's standalone prefill) samples one token nobody reads (greedy, no drafts, its prompt alone
# published).
_PRODUCER_SAMPLING = SamplingParams(temperature=0.0, top_k=1, max_generate_length=1, cache_generated_tokens=False,
                                    speculative=False)


class StopRules(Protocol):
    """Appends one committed token to a sequence and sets its finish reason when a rule ends it (OutputProcessor)."""

    def accept(self, seq: Sequence, sample: SampleResult) -> None: ...


class ExternalLoader(Protocol):
    """Fills an admitted sequence's pages from outside the process (a shared KV tier) before it computes.

    `start` is asked once per admission: True means a load began and the sequence waits (WAITING_FOR_REMOTE);
    `poll` is asked each step while it waits: None = still loading, else the number of tokens now in its pages
    (from its reuse point on; 0 = nothing could be loaded, it computes them)."""

    def start(self, seq: Sequence) -> bool: ...

    def poll(self, seq: Sequence) -> int | None: ...

    def cancel(self, seq: Sequence) -> None:
        """The sequence ended while loading (aborted or failed): its pages go back, nothing may be copied in."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a load to progress (the engine has no row to run meanwhile)."""
        ...


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
    def __init__(self, cache: ContextCacheManager, state: StateManager | None = None,
                 stops: StopRules | None = None, *, max_batch_size: int, max_num_tokens: int,
                 prefill_chunk_tokens: int, max_seq_tokens: int = 1 << 62,
                 loader: ExternalLoader | None = None) -> None:
        """`state`: restores a sequence's snapshots at admission, frees its recurrent row at release and rolls it
        back after rejected drafts (None: sequences carry no state besides their pages). `stops`: the stop rules
        the commit applies (required to commit sampled tokens). `max_seq_tokens`: the engine's KV capacity per
        sequence (drafts never reach past it). `loader`: fetches pages from a shared tier before computing."""
        self.cache = cache
        self.state = state
        self.stops = stops
        self.loader = loader
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_seq_tokens = max_seq_tokens
        self.waiting: deque[Sequence] = deque()
        self.loading: list[Sequence] = []  # WAITING_FOR_REMOTE: admitted, pages held, an external load running
        self.running: list[Sequence] = []  # arrival order: the last is preempted first
        self.stats = SchedulerStats()
        # Requests the cache types need computed first (documents' standalone prefills), queued or running, by key.
        self.producers: dict[bytes, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        """Queue a request, after what the cache types need computed for it first (`prerequisites`: with document
        reuse, a standalone prefill of each of its documents without a stored form; the request then waits for
        them and restores them). The spans those requests produce for it are its own work, not cached tokens."""
        try:
            needs = self.cache.prerequisites(seq.next_admission())
        except Exception:  # the request's own admission fails it later, with its reason
            needs = []
        for need in needs:
            if need.key not in self.producers:
                self.producers[need.key] = producer = self._producer(seq, need)
                self.waiting.append(producer)
        seq.produced_for = {need.start + need.length: self.producers[need.key] for need in needs}
        self.waiting.append(seq)

    @staticmethod
    def _producer(seq: Sequence, need: Prerequisite) -> Sequence:
        """The request `need` asks for: `seq`'s tokens [start, start + length) alone, from position 0, with the
        request's adapter and salt (they are part of what it produces' key) and the inputs the type gave it."""
        request = EngineRequest(seq.prompt_ids[need.start:need.start + need.length], _PRODUCER_SAMPLING,
                                seq.request.adapter, seq.request.cache_salt, cache_inputs=need.inputs)
        return Sequence(f"{seq.request_id}/prerequisite@{need.start}", request, Sampler(_PRODUCER_SAMPLING),
                        arrival=seq.arrival, internal=True)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # --- schedule -----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_tokens
        self._finish_loads(out)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            count = self._tokens_for(seq, budget)
            drafts = self._drafts_for(seq, count, budget)
            if self._grow_or_preempt(seq, count + len(drafts), out):
                # Parents come before children, so any prefix of a tree's drafts is a tree.
                parents = seq.spec_parents[:len(drafts)] if seq.spec_parents else []
                out.rows.append(ScheduledRow(seq, count, seq.is_prefilling, drafts, parents))
                budget -= count + len(drafts)
        if not out.preempted:  # a step that had to preempt admits nobody: the pool is already short
            budget = self._admit_waiting(budget, out)
        if self.state is not None and self.state.carries_rows:
            self.state.save_before_verify([row.seq.lease for row in out.rows  # type: ignore[misc]
                                           if row.draft_token_ids])
        if out.rows:
            self.stats.steps += 1
            self.stats.mixed_steps += out.has_prefill and out.has_decode
            self.stats.max_running = max(self.stats.max_running, len(self.running))
        return out

    def _tokens_for(self, seq: Sequence, budget: int) -> int:
        """A chunk ends at the sequence's next checkpoint, so its state there can be captured after the call, and
        where a restored document range begins; a sequence at the start of one moves past it (its K/V is in place).
        A cache type's second pass (`repair_pass`) may end the chunk earlier or move the sequence back."""
        stop = self._repair_pass(seq) if seq.lease is not None and not seq.output_ids else 0  # prompts only
        count = self._chunk(seq, budget, stop)
        if seq.lease is None:
            return count
        for start, end in self.cache.restored_spans(seq.lease):
            if start <= seq.num_computed_tokens < end:
                seq.num_computed_tokens = end
                count = self._chunk(seq, budget, stop)
            elif seq.num_computed_tokens < start:
                return min(count, start - seq.num_computed_tokens)
        return count

    def _chunk(self, seq: Sequence, budget: int, stop: int) -> int:
        count = min(seq.num_pending_tokens, budget, self.prefill_chunk_tokens, seq.tokens_to_next_checkpoint())
        return min(count, stop - seq.num_computed_tokens) if stop > seq.num_computed_tokens else count

    def _repair_pass(self, seq: Sequence) -> int:
        """Ask the cache whether a second pass over the prompt moves `seq` back (issue 53: documents' `attention`
        repair reads where the question looked, then recomputes the documents it chose and the question): the
        tokens it takes back from the restored ones are no longer cached. Returns where its next chunk must end
        (0: anywhere)."""
        assert seq.lease is not None
        spans = self.cache.restored_spans(seq.lease)
        resume, stop = self.cache.repair_pass(seq.lease, seq.num_computed_tokens)
        if resume < seq.num_computed_tokens:
            if seq.num_preemptions == 0:
                base = seq.lease.reuse_tokens
                seq.reused_tokens -= self.cached_tokens(seq, base, spans) - self.cached_tokens(seq, base)
            seq.num_computed_tokens = resume
        return stop

    def cached_tokens(self, seq: Sequence, start: int | None = None,
                      spans: list[tuple[int, int]] | None = None) -> int:
        """The prompt tokens a sequence starts with from a cache: those before its computing starts (pages,
        snapshots, a shared tier's load) and the restored spans after them (a document's K/V, issue 37), except the
        tokens the requests queued for it (`prerequisites`, a document's standalone prefill) computed: those were
        computed for it (issue 52 item 3); what such a request loaded from a cache (a shared tier) existed before and
        counts. A document another request's prefill was already computing when this one arrived counts as cached,
        as a prefix in flight does. `start` and `spans` (the sequence's computing point and restored spans by default)
        ask what another point or set of spans would count."""
        start = total = seq.num_computed_tokens if start is None else start
        if spans is None:
            spans = [] if seq.lease is None else self.cache.restored_spans(seq.lease)
        for begin, end in spans:
            until = end
            producer = seq.produced_for.get(end)
            if producer is not None:  # only what its producer found in a cache (a shared tier) existed before
                until = end - len(producer.request.prompt_ids) + producer.reused_tokens
            total += max(min(end, until) - max(begin, start), 0)
        return total

    def draft_room(self, seq: Sequence) -> int:
        """How many draft tokens `seq` could verify after its next token: within the KV capacity and the tokens it
        may still generate (a draft past its last token could only be thrown away). Proposers ask it too."""
        return max(min(self.max_seq_tokens - seq.num_tokens,
                       seq.request.sampling.max_generate_length - len(seq.output_ids) - 1), 0)

    def _drafts_for(self, seq: Sequence, count: int, budget: int) -> list[int]:
        """The proposal a decode row verifies this step: within the budget and `draft_room`."""
        if not seq.spec_token_ids or count != seq.num_pending_tokens or count != 1:
            return []
        return seq.spec_token_ids[:max(min(budget - count, self.draft_room(seq)), 0)]

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
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_batch_size:
            seq = self.waiting[0]
            try:  # page keys are hashed here: a value only this request carries must not stop the queue
                admission = seq.next_admission()
                if self.cache.prefix_in_flight(admission):
                    self.stats.inflight_prefix_waits += 1
                    skipped.append(self.waiting.popleft())
                    continue
                lease = self.cache.try_acquire(admission)  # all-or-nothing: nothing changed if it raised
            except Exception as exc:
                self.fail(seq, f"admission failed ({type(exc).__name__}: {exc})")
                out.failed.append(seq)
                continue
            if lease is None:
                break  # first come, first served: later arrivals do not overtake a sequence waiting for pages
            self.waiting.popleft()
            seq.lease = lease
            seq.num_computed_tokens = lease.reuse_tokens
            if seq.num_preemptions == 0:
                seq.reused_tokens = self.cached_tokens(seq)
            if self.state is not None:
                self.state.on_admit(seq)
                self.cache.restore(lease)  # each type copies its hit in, through its copier
                self.cache.finish_restore(lease)  # the copies are done (a no-op without restores)
            if self.loader is not None and self.loader.start(seq):
                seq.status = Status.WAITING_FOR_REMOTE
                self.loading.append(seq)
                continue
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            count = self._tokens_for(seq, budget)
            # A first call that moved past a restored document needs pages a group allocates only as the row grows
            # (a sliding-window group's, issue 53); without them now, the next step grows it (or preempts).
            if seq.num_computed_tokens != lease.reuse_tokens \
                    and not self.cache.try_grow(lease, seq.num_computed_tokens + count):
                continue
            out.rows.append(ScheduledRow(seq, count, seq.is_prefilling))
            budget -= count
        self.waiting.extendleft(reversed(skipped))  # they keep their place in the queue
        return budget

    def wait_for_loads(self, timeout_s: float) -> None:
        """Nothing could run this step because every request waits for a shared tier: wait a moment for it."""
        if self.loader is not None and self.loading:
            self.loader.wait(timeout_s)

    def _finish_loads(self, out: SchedulerOutput) -> None:
        """Sequences whose external load ended run from this step on, past the tokens it brought (counted as reused
        at admission). Their checkpoints are recomputed from the new reuse point, as for a local hit there."""
        if self.loader is None:
            return
        for seq in list(self.loading):
            loaded = self.loader.poll(seq)
            if loaded is None:
                continue
            self.loading.remove(seq)
            seq.num_computed_tokens += loaded
            if seq.num_preemptions == 0:
                seq.reused_tokens = self.cached_tokens(seq)
            if loaded and self.state is not None:
                seq.checkpoints = self.state.checkpoints.positions(seq.request, seq.num_computed_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)

    # --- the commit step ----------------------------------------------------------------------------

    def update_from_output(self, batch: SchedulerOutput, sampled: list[list[SampleResult]]) -> list[RowUpdate]:
        """Apply one step's results. `sampled[i]` holds the tokens row i commits: none for a row still short of its
        end, else 1..k+1 (the accepted drafts and one more). Returns an update for every row that committed."""
        updates = []
        for row, samples in zip(batch.rows, sampled, strict=True):
            seq = row.seq
            if bool(samples) != row.reaches_end:
                raise AssertionError("a row commits tokens exactly when the call computed its last pending one")
            before = seq.num_computed_tokens
            seq.num_computed_tokens += row.num_new_tokens
            self._commit_prompt(seq, before)
            if not samples:
                continue
            updates.append(self._commit_tokens(row, samples, before))
        return updates

    def _commit_prompt(self, seq: Sequence, before: int) -> None:
        """Prompt pages finished by this call become findable; the prompt and checkpoints are published."""
        prompt_len = len(seq.prompt_ids)
        if before >= prompt_len:
            return
        assert seq.lease is not None
        self.cache.index_computed(seq.lease, seq.prompt_ids, seq.num_computed_tokens)
        if seq.num_computed_tokens >= prompt_len:  # the prompt is in the pool: publish it (both policies)
            # A recurrent state is the prompt's only when the call ended exactly there (a checkpoint).
            if self.cache.deployment is Deployment.VANILLA or seq.num_computed_tokens == prompt_len:
                self.cache.publish(seq.lease, seq.prompt_ids)
            if self.state is not None:
                self.state.on_prompt_computed(seq)
        elif seq.num_computed_tokens in seq.checkpoints:  # the chunk was ended here for this
            self.cache.publish(seq.lease, seq.prompt_ids[:seq.num_computed_tokens], boundary=True)

    def _commit_tokens(self, row: ScheduledRow, samples: list[SampleResult], before: int) -> RowUpdate:
        """Append the committed tokens until a stop rule ends the sequence; roll back what was not kept."""
        seq = row.seq
        if self.stops is None:
            raise AssertionError("a scheduler that commits tokens needs stop rules")
        appended: list[int] = []
        for sample in samples:
            self.stops.accept(seq, sample)
            appended.append(sample.token_id)
            if seq.finish_reason is not None:
                break
        kept_drafts = len(appended) - 1  # each committed token but the last was verified as a draft position
        rejected = len(row.draft_token_ids) - kept_drafts
        if rejected and self.state is not None and self.state.carries_rows:
            # A recurrent state has consumed every draft: go back to the state before the call and recompute the
            # kept tokens next step (their K/V is rewritten identically).
            assert seq.lease is not None
            self.state.rollback(seq.lease)
            seq.num_computed_tokens = before
        else:
            # K/V of rejected drafts stays in private pages past num_computed_tokens: never indexed or published,
            # overwritten by the next call.
            seq.num_computed_tokens += kept_drafts
        seq.spec_token_ids, seq.spec_parents = [], []
        if seq.finish_reason is not None:
            self._finish_normally(seq)
        return RowUpdate(seq, appended, len(row.draft_token_ids), rejected)

    def _finish_normally(self, seq: Sequence) -> None:
        seq.finish_time = time.perf_counter()
        if seq.request.sampling.commit_policy is CommitPolicy.INCLUDING_GENERATED_TOKENS and seq.lease is not None:
            self.cache.publish(seq.lease, seq.resident_token_ids())  # only sequences that finished normally
        self.finish(seq)

    # --- preempt, abort, finish ---------------------------------------------------------------------

    def preempt(self, seq: Sequence, out: SchedulerOutput | None = None) -> None:
        """Give a running sequence's pages back; it waits at the head of the queue and is recomputed later."""
        self.running.remove(seq)
        if seq.lease is not None:
            self._release(seq.lease)  # never published: its in-flight pages leave unless others hold them
        seq.lease, seq.status = None, Status.WAITING
        seq.num_computed_tokens = 0
        seq.spec_token_ids, seq.spec_parents = [], []
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)
        if out is not None:
            out.preempted.append(seq)
            out.rows = [row for row in out.rows if row.seq is not seq]

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence now: its pages are released and nothing of it is published."""
        seq.finish_reason = FinishReason.ABORTED
        seq.finish_time = time.perf_counter()
        self.finish(seq)

    def fail(self, seq: Sequence, reason: str) -> None:
        """End one sequence that a step could not run, as an abort does (pages released, nothing published)."""
        seq.finish_reason = FinishReason.ERROR
        seq.error = reason
        seq.finish_time = time.perf_counter()
        self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence from the queues and release its lease (publication, if any, happened before)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.loading:
            self.loading.remove(seq)
            assert self.loader is not None
            self.loader.cancel(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.lease is not None:
            self._release(seq.lease)
            seq.lease = None
        seq.status = Status.FINISHED
        if seq.internal:
            self.producers = {key: other for key, other in self.producers.items() if other is not seq}

    def _release(self, lease: Lease) -> None:
        self.cache.release(lease)
        if self.state is not None:
            self.state.on_release(lease)

