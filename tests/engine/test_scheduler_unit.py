"""The scheduler alone, in milliseconds: a stub cache that counts pages, stub stop rules and state, and batch results
made up by the test. Document producers and restored spans, the draft budget, preemption and rollback are decided
here, so they are checked here without an engine (the engine tests check them end to end)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import kvforge.runtime.engine.scheduler as scheduler_module
from kvforge.runtime.context_cache.lease import Prerequisite
from kvforge.runtime.context_cache.types.document_inputs import document_input, documents_of
from kvforge.runtime.engine.scheduler import Scheduler
from kvforge.runtime.media_spans import DocumentSpan
from kvforge.runtime.sampling.sampler import Sampler, SampleResult
from kvforge.runtime.sequence import EngineRequest, FinishReason, Sequence, Status
from kvforge.runtime.types import Deployment, SamplingParams

PAGE = 4


@dataclass(eq=False)
class StubLease:
    pages: int
    reuse_tokens: int = 0
    spans: tuple[tuple[int, int], ...] = ()  # what the cache types restored in place (a document's K/V)


@dataclass
class StubCache:
    """Pages counted, not stored: `try_acquire` takes the admission's tokens' pages, `try_grow` the difference."""

    free: int
    wanted: list[tuple[bytes, int, int]] = field(default_factory=list)  # documents without a stored form
    deployment: Deployment = Deployment.VANILLA
    reuse_tokens: int = 0
    spans: tuple[tuple[int, int], ...] = ()  # restored in place at admission (the document type's, say)
    in_flight: set[int] = field(default_factory=set)  # first prompt tokens whose prefix another sequence computes
    published: list[list[int]] = field(default_factory=list)
    released: list[StubLease] = field(default_factory=list)
    # A type's second pass (issue 53): (its first pass ends here, then it takes back these spans and resumes there).
    second_pass: tuple[int, tuple[tuple[int, int], ...], int] | None = None

    def prefix_in_flight(self, admission) -> bool:
        return admission.token_ids[0] in self.in_flight

    def try_acquire(self, admission) -> StubLease | None:
        if admission.token_ids[0] < 0:
            raise ValueError("a value only this request carries")
        need = -(-len(admission.token_ids) // PAGE)
        if need > self.free:
            return None
        self.free -= need
        return StubLease(need, self.reuse_tokens, self.spans)

    def try_grow(self, lease: StubLease, tokens: int) -> bool:
        need = -(-tokens // PAGE) - lease.pages
        if need > self.free:
            return False
        self.free -= max(need, 0)
        lease.pages += max(need, 0)
        return True

    def prerequisites(self, admission) -> list[Prerequisite]:
        """The document type's answer: a standalone prefill of each wanted span, none for a producer itself."""
        if documents_of(admission.inputs).produces:
            return []
        return [Prerequisite(key, start, length, document_input(produces=True)) for key, start, length in self.wanted]

    def restored_spans(self, lease: StubLease) -> list[tuple[int, int]]:
        return list(lease.spans)

    def repair_pass(self, lease: StubLease, computed: int) -> tuple[int, int]:
        if self.second_pass is None:
            return computed, 0
        end, spans, resume = self.second_pass
        if computed < end:
            return computed, end
        self.second_pass, lease.spans = None, spans
        return resume, 0

    def restore(self, lease: StubLease) -> None:
        pass

    def finish_restore(self, lease: StubLease) -> None:
        pass

    def index_computed(self, lease: StubLease, prompt_ids: list[int], computed: int) -> None:
        pass

    def publish(self, lease: StubLease, tokens: list[int], boundary: bool = False) -> None:
        self.published.append(list(tokens))

    def release(self, lease: StubLease) -> None:
        self.free += lease.pages
        self.released.append(lease)


class Stops:
    """Appends the token; the length limit ends the sequence."""

    def accept(self, seq: Sequence, sample: SampleResult) -> None:
        seq.output_ids.append(sample.token_id)
        if len(seq.output_ids) >= seq.request.sampling.max_generate_length:
            seq.finish_reason = FinishReason.LENGTH


@dataclass
class RowState:
    """A recurrent state: rows carried per sequence, rolled back after rejected drafts."""

    carries_rows: bool = True
    rolled_back: list[StubLease] = field(default_factory=list)
    saved: list[list[StubLease]] = field(default_factory=list)
    checkpoints: object = None

    def save_before_verify(self, leases: list[StubLease]) -> None:
        self.saved.append(leases)

    def rollback(self, lease: StubLease) -> None:
        self.rolled_back.append(lease)

    def on_admit(self, seq: Sequence) -> None:
        pass

    def on_release(self, lease: StubLease) -> None:
        pass

    def on_prompt_computed(self, seq: Sequence) -> None:
        pass


def seq_of(request_id: str, prompt: list[int], arrival: int, max_tokens: int = 4, **request) -> Sequence:
    sampling = SamplingParams(temperature=0.0, top_k=1, max_generate_length=max_tokens)
    return Sequence(request_id, EngineRequest(prompt, sampling, **request), Sampler(sampling), arrival=arrival)


def scheduler(cache: StubCache, state: RowState | None = None, **limits) -> Scheduler:
    options = dict(max_batch_size=4, max_num_tokens=64, prefill_chunk_tokens=64) | limits
    return Scheduler(cache, state, Stops(), **options)  # type: ignore[arg-type]  (stubs)


def run_step(sched: Scheduler, tokens: dict[str, list[int]] | None = None):
    """One step: schedule, then commit `tokens[request_id]` (default one token, 7) for each row that reaches its
    end; returns the batch and the updates."""
    batch = sched.schedule()
    sampled = [[SampleResult(t, 0.0) for t in (tokens or {}).get(row.seq.request_id, [7])] if row.reaches_end else []
               for row in batch.rows]
    return batch, sched.update_from_output(batch, sampled)


def test_a_prompt_runs_in_chunks_then_decodes_and_gives_its_pages_back() -> None:
    cache = StubCache(free=8)
    sched = scheduler(cache, prefill_chunk_tokens=4)
    seq = seq_of("a", list(range(10)), 0, max_tokens=2)
    sched.add(seq)
    counts = []
    while sched.has_unfinished():
        batch, _ = run_step(sched)
        counts.append([(row.num_new_tokens, row.is_prefill) for row in batch.rows])
    assert counts == [[(4, True)], [(4, True)], [(2, True)], [(1, False)]]
    # The prompt when its last chunk was computed, then (the default commit policy) what it finished with.
    assert cache.published == [list(range(10)), list(range(10)) + [7]]
    assert seq.output_ids == [7, 7] and seq.finish_reason is FinishReason.LENGTH and seq.status is Status.FINISHED
    assert cache.free == 8 and sched.stats.steps == 4


def test_a_restored_document_span_is_skipped_and_counted_as_reused() -> None:
    cache = StubCache(free=8, reuse_tokens=2, spans=((4, 8),))
    sched = scheduler(cache)
    seq = seq_of("a", list(range(12)), 0)
    sched.add(seq)
    batch, _ = run_step(sched)
    assert [row.num_new_tokens for row in batch.rows] == [2]  # from the reuse point to where the span begins
    assert seq.reused_tokens == 2 + 4
    batch, _ = run_step(sched)
    assert seq.num_computed_tokens == 12 and [row.num_new_tokens for row in batch.rows] == [4]  # 8..12: past it


def test_a_second_pass_ends_its_chunk_then_moves_the_sequence_back_and_uncounts_what_it_took_back() -> None:
    """The first pass stops before the last token (nothing sampled); the type then repairs part of a restored span
    and the sequence computes again from there, skipping what stays restored."""
    cache = StubCache(free=8, reuse_tokens=2, spans=((4, 8),), second_pass=(11, ((6, 8),), 4))
    sched = scheduler(cache)
    seq = seq_of("a", list(range(12)), 0)
    sched.add(seq)
    counts = [[row.num_new_tokens for row in run_step(sched)[0].rows] for _ in range(3)]
    assert counts[:2] == [[2], [3]]  # 2..4, then 8..11: the first pass ends before the last token, unsampled
    assert seq.reused_tokens == 2 + 2  # 4..6 is no longer restored
    assert counts[2] == [2] and seq.num_computed_tokens == 6  # back at 4: 4..6, then past the span left
    assert [row.num_new_tokens for row in run_step(sched)[0].rows] == [4] and seq.output_ids == [7]  # 8..12


def test_the_scheduler_imports_no_cache_type() -> None:
    """What a type restores or needs first reaches the scheduler through the coordinator's hooks
    (`restored_spans`, `prerequisites`), so a new type never edits it: it imports no type's module or handle."""
    tree = ast.parse(Path(scheduler_module.__file__).read_text(encoding="utf-8"))
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if name.startswith("kvforge.runtime.context_cache.types")], imported


def test_document_producers_are_queued_once_ahead_of_their_requests() -> None:
    key = b"doc"
    sched = scheduler(StubCache(free=32, wanted=[(key, 3, 5)]))
    first = seq_of("a", list(range(10)), 0, documents=(DocumentSpan(3, 5),))
    second = seq_of("b", list(range(20, 30)), 1, documents=(DocumentSpan(3, 5),))
    sched.add(first)
    sched.add(second)
    producer = sched.producers[key]
    assert list(sched.waiting) == [producer, first, second]  # one producer for the key, before the first request
    assert producer.prompt_ids == list(range(3, 8)) and documents_of(producer.request.cache_inputs).produces
    assert producer.request_id == "a/prerequisite@3" and producer.internal
    while producer.status is not Status.FINISHED:
        run_step(sched)
    assert sched.producers == {}  # a finished producer is forgotten: a later request may queue the key again


def test_the_draft_budget_is_the_step_budget_the_capacity_and_the_tokens_left() -> None:
    sched = scheduler(StubCache(free=32), max_seq_tokens=20)
    seq = seq_of("a", list(range(6)), 0, max_tokens=10)
    sched.add(seq)
    run_step(sched)  # the prompt and the first token
    sched.max_num_tokens = 4
    seq.spec_token_ids = [1, 2, 3, 4, 5, 6]
    batch = sched.schedule()
    assert [(row.num_new_tokens, row.draft_token_ids) for row in batch.rows] == [(1, [1, 2, 3])]  # budget 4 - 1
    assert sched.draft_room(seq) == 10 - 1 - 1  # tokens it may still generate after the next one
    seq.output_ids += [7] * 7  # 13 tokens of 20: KV capacity now bounds it below the tokens left
    assert sched.draft_room(seq) == min(20 - 14, 10 - 8 - 1) == 1
    seq.output_ids += [7]
    assert sched.draft_room(seq) == 0  # its next token is its last: a draft could only be thrown away


def test_rejected_drafts_stay_out_of_the_computed_tokens() -> None:
    sched = scheduler(StubCache(free=32))
    seq = seq_of("a", list(range(6)), 0, max_tokens=10)
    sched.add(seq)
    run_step(sched)
    seq.spec_token_ids = [1, 2, 3]
    batch, [update] = run_step(sched, {"a": [1, 9]})  # the first draft kept, then a token of the base's own
    assert batch.rows[0].draft_token_ids == [1, 2, 3]
    assert (update.new_token_ids, update.num_drafts, update.num_rejected) == ([1, 9], 3, 2)
    assert seq.output_ids == [7, 1, 9] and seq.num_computed_tokens == 6 + 1 + 1  # token 7 and the kept draft
    assert seq.spec_token_ids == []


def test_a_state_that_consumed_the_drafts_is_rolled_back_and_recomputes() -> None:
    state = RowState()
    sched = scheduler(StubCache(free=32), state)
    seq = seq_of("a", list(range(6)), 0, max_tokens=10)
    sched.add(seq)
    run_step(sched)
    seq.spec_token_ids = [1, 2, 3]
    run_step(sched, {"a": [1, 9]})
    assert state.saved[-1] == [seq.lease]  # saved before the verify call
    assert state.rolled_back == [seq.lease] and seq.num_computed_tokens == 6  # the kept tokens are computed again
    assert seq.num_pending_tokens == 3  # 7, 1 and 9


def test_the_newest_running_sequence_is_preempted_and_waits_at_the_head() -> None:
    cache = StubCache(free=4)
    sched = scheduler(cache)
    old, new = seq_of("old", list(range(8)), 0, max_tokens=9), seq_of("new", list(range(100, 108)), 1)
    later = seq_of("later", [50], 2)
    for seq in (old, new, later):
        sched.add(seq)
    batch, _ = run_step(sched)
    assert batch.admitted == [old, new] and cache.free == 0  # `later` waits: first come, first served
    batch = sched.schedule()  # old's 9th token needs a third page: new goes
    assert batch.preempted == [new] and [row.seq for row in batch.rows] == [old]
    assert batch.admitted == []  # a step that had to preempt admits nobody
    assert list(sched.waiting) == [new, later] and new.status is Status.WAITING
    assert new.lease is None and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert sched.stats.preemptions == 1 and cache.free == 1  # new's two pages back, one taken by old


def test_a_shared_prefix_in_flight_lets_the_others_pass_and_keeps_its_place() -> None:
    cache = StubCache(free=16, in_flight={0})
    sched = scheduler(cache)
    waiting, other = seq_of("w", [0, 1, 2], 0), seq_of("o", [5, 6], 1)
    sched.add(waiting)
    sched.add(other)
    batch = sched.schedule()
    assert batch.admitted == [other] and list(sched.waiting) == [waiting]
    assert sched.stats.inflight_prefix_waits == 1


def test_a_failed_admission_fails_that_request_alone() -> None:
    sched = scheduler(StubCache(free=16))
    bad, good = seq_of("bad", [-1, 2], 0), seq_of("good", [3, 4], 1)
    sched.add(bad)
    sched.add(good)
    batch = sched.schedule()
    assert batch.failed == [bad] and batch.admitted == [good]
    assert bad.finish_reason is FinishReason.ERROR and "a value only this request carries" in (bad.error or "")
