"""The engine loop without an engine dir: schedule → run → sample → update, over any step executor.

`Engine` builds one from an engine dir (tokenizer, backend, cache, scheduler); model-free tests build one from a
fake executor and a small cache, so the loop they test is the product's, not a copy of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvforge.contract.profile_schema import (
    ENGINE_CALL_PYTHON_STAGE,
    SPEC_BASE_VERIFICATION_STAGE,
    SPEC_DRAFT_ACCEPT_STAGE,
    SPEC_DRAFT_PROPOSAL_STAGE,
)
from kvforge.runtime.adapters import base_pages_reused, corrected_pages_reused
from kvforge.runtime.engine.output import OutputProcessor, RequestOutput
from kvforge.runtime.engine.scheduler import Scheduler
from kvforge.runtime.profile import GENERATION_STAGE, PREFILL_STAGE, Profiler
from kvforge.runtime.sampling.rejection import accept_tokens, accept_tree
from kvforge.runtime.sampling.sampler import SampleResult
from kvforge.runtime.sequence import Sequence
from kvforge.runtime.spec.proposer import DraftLifecycle, DraftTree, Proposer
from kvforge.runtime.step import BatchOutput, RowUpdate, ScheduledRow, SchedulerOutput

LOAD_WAIT_S = 0.005  # a step with nothing to run but shared-tier loads waits this long for one to progress


class StepExecutor(Protocol):
    """Computes a step's scheduled rows (ModelExecutor over a backend, or a test's fake)."""

    def run(self, rows: list[ScheduledRow]) -> BatchOutput: ...

    def keep_paths(self, rows: list[ScheduledRow], output: BatchOutput, paths: list[list[int] | None]) -> None:
        """Tree rows (paths[i] not None): move the accepted drafts' K/V to consecutive positions and their hidden
        states to the order a chain would have had. Only called when a step verified a tree."""
        ...


def _onnxruntime_ns(executor: StepExecutor) -> int | None:
    """The time its backend has spent inside ONNX Runtime so far (kvforge/runtime/execution/ort.py counts it); None for
    backends that do not count it (TensorRT, tests' fakes)."""
    return getattr(getattr(executor, "backend", None), "onnxruntime_ns", None)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What servers and benchmarks read about a running engine, copied at one moment (no attribute walks)."""

    waiting: int
    running: int
    loading: int  # waiting for pages from a shared tier
    pool_free: int
    pool_capacity: int
    prefill_reused_tokens: int
    prefill_computed_tokens: int
    generated_tokens: int
    spec_draft_tokens: int  # drafts verified (speculative decoding)
    spec_accepted_tokens: int  # drafts kept
    scheduler: dict[str, int]
    encoder_cache: dict[str, int]  # the profile's multimodal.encoder_cache; empty without an encoder
    # The profile's context_cache block: Engine.stats() leaves it empty (counters only); a front end that exports
    # it (llm_serve's /metrics) adds Engine.cache_profile(), which walks the cache's records.
    cache: dict[str, Any] = field(default_factory=dict)
    adapter_base_pages: int = 0  # base pages reused by adapter requests (the profile's per_adapter, summed)
    adapter_corrected_pages: int = 0  # base pages corrected adapters started from (per_adapter, summed)


def sample_rows(rows: list[ScheduledRow], output: BatchOutput
                ) -> tuple[list[list[SampleResult] | Exception], list[list[int] | None]]:
    """The tokens each row commits (none for a row short of its end, else its verified drafts and one more) and, for
    a row that verified a tree, the drafts on its accepted path (None for every other row). A row whose sampling
    raised gets its exception in place of its tokens: one request's values must not fail the others'."""
    sampled: list[list[SampleResult] | Exception] = []
    paths: list[list[int] | None] = []
    for row, logits in zip(rows, output.logits, strict=True):
        path = None
        try:
            if not row.reaches_end:
                samples: list[SampleResult] | Exception = []
            elif row.draft_parents:
                samples, path = accept_tree(row.seq.sampler, logits, row.draft_token_ids, row.draft_parents)
            else:
                samples = accept_tokens(row.seq.sampler, logits, row.draft_token_ids)
        except Exception as exc:
            samples, path = exc, None
        sampled.append(samples)
        paths.append(path)
    return sampled, paths


def _visible(seq: Sequence) -> bool:
    """Whether a sequence's outputs go to the front end: not a request the scheduler queued itself for a cache type
    (a document's standalone prefill, issue 37); its tokens are counted in the profile like any prefill, its output
    is dropped."""
    return not (seq.internal or seq.request.produces_document)


class EngineCore:
    __slots__ = ("scheduler", "executor", "outputs", "profiler", "_proposer", "lifecycle", "sequences")

    def __init__(self, scheduler: Scheduler, executor: StepExecutor, outputs: OutputProcessor,
                 profiler: Profiler, proposer: Proposer | None = None) -> None:
        """`proposer`: drafts tokens for the decoding rows after each step (speculative decoding; None = off)."""
        self.scheduler = scheduler
        self.executor = executor
        self.outputs = outputs
        self.profiler = profiler
        self.proposer = proposer
        self.sequences: dict[str, Sequence] = {}

    @property
    def proposer(self) -> Proposer | None:
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        self._proposer = proposer
        # Checked once: isinstance against a runtime-checkable Protocol walks its members (~10 us, every step).
        self.lifecycle: DraftLifecycle | None = proposer if isinstance(proposer, DraftLifecycle) else None

    def add(self, seq: Sequence) -> None:
        self.sequences[seq.request_id] = seq
        if self.lifecycle is not None:
            self.lifecycle.begin(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its pages are released and nothing of it is published. False if unknown."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        self._end(seq)
        return True

    def _roll_back_drafters(self, updates: list[RowUpdate]) -> None:
        """The lifecycle's rollback: on a recurrent base the scheduler restored each row that rejected a draft to
        its state before the call; a proposer keeping per-request state drops what it drafted past it."""
        state = self.scheduler.state
        if self.lifecycle is None or state is None or not state.carries_rows:
            return
        for update in updates:
            if update.num_rejected:
                self.lifecycle.rollback(update.seq)

    def _end(self, seq: Sequence) -> None:
        """The lifecycle's end: a proposer keeping per-request state drops this request's."""
        if self.lifecycle is not None:
            self.lifecycle.end(seq.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule → run the rows → sample → update. Returns an output for every row that committed tokens, and
        for every request the step had to fail (finish_reason "error", its error set; the others go on).

        Per-row work (page keys at admission, sampling) fails only its row. When the batched engine call itself
        raises, which row caused it cannot be known: every row of that call fails with the reason, while the
        requests not in it (waiting ones) go on; a broken backend thus fails each request once, never hangs one."""
        batch = self.scheduler.schedule()
        if self.lifecycle is not None:
            for seq in batch.preempted:  # recomputed from scratch later: what was drafted from goes
                self.lifecycle.begin(seq)
        failed = [self._failed(seq) for seq in batch.failed if _visible(seq)]
        if not batch.rows:
            if not failed and (self.scheduler.running or (self.scheduler.waiting and not self.scheduler.loading)):
                raise AssertionError("nothing schedulable while requests wait (a scheduler bug)")
            self.scheduler.wait_for_loads(LOAD_WAIT_S)  # no busy loop while loads run on the tier's threads
            return failed  # idle, or every request waits for pages from a shared tier
        started = time.perf_counter()
        for row in batch.rows:
            if row.seq.first_scheduled_time is None:
                row.seq.first_scheduled_time = started
        verifies = any(row.draft_token_ids for row in batch.rows)
        try:
            with self.profiler.stage(PREFILL_STAGE if batch.has_prefill else GENERATION_STAGE):
                run_started, inside = time.perf_counter(), _onnxruntime_ns(self.executor)
                output = self.executor.run(batch.rows)
                run_ms = (time.perf_counter() - run_started) * 1e3
                if verifies:
                    self.profiler.record(SPEC_BASE_VERIFICATION_STAGE, run_ms)
                if inside is not None:
                    inside = (_onnxruntime_ns(self.executor) or 0) - inside
                    self.profiler.record(ENGINE_CALL_PYTHON_STAGE, max(run_ms - inside / 1e6, 0.0))
        except Exception as exc:
            reason = f"the engine call failed ({type(exc).__name__}: {exc})"
            outputs = [(row.seq, self._fail(row.seq, reason)) for row in batch.rows]
            return failed + [output for seq, output in outputs if _visible(seq)]
        if verifies:
            with self.profiler.stage(SPEC_DRAFT_ACCEPT_STAGE):
                sampled, paths = sample_rows(batch.rows, output)
                if any(path is not None for path in paths):
                    self.executor.keep_paths(batch.rows, output, paths)
        else:
            sampled, _ = sample_rows(batch.rows, output)
        committed = self._drop_failed_rows(batch, sampled, failed)
        if self.proposer is not None and self.proposer.owns_kv:
            with self.profiler.stage(SPEC_DRAFT_PROPOSAL_STAGE):  # the draft catches up before anything is published
                self.proposer.observe(batch.rows, output, committed)  # failed rows hold no lease: skipped
        elif self.proposer is not None:  # keeps what it reads from the step (an assistant: the last hidden state)
            self.proposer.observe(batch.rows, output, committed)
        batch.rows, committed = ([row for row in batch.rows if not row.seq.is_finished],
                                 [s for row, s in zip(batch.rows, committed, strict=True) if not row.seq.is_finished])
        reused = self._reused_at_admission(batch)  # before the update moves num_computed_tokens
        updates = self.scheduler.update_from_output(batch, committed)
        self._roll_back_drafters(updates)
        self._count(batch, updates, reused)
        outputs = failed + [self._output(update) for update in updates if _visible(update.seq)]
        if self.proposer is not None:
            self._propose()
        return outputs

    def _drop_failed_rows(self, batch: SchedulerOutput, sampled: list[list[SampleResult] | Exception],
                          failed: list[RequestOutput]) -> list[list[SampleResult]]:
        """Fail each row whose sampling raised (its output joins `failed`); the rows' samples, none for those."""
        committed: list[list[SampleResult]] = []
        for row, samples in zip(batch.rows, sampled, strict=True):
            if isinstance(samples, Exception):
                output = self._fail(row.seq, f"sampling failed ({type(samples).__name__}: {samples})")
                if _visible(row.seq):
                    failed.append(output)
                samples = []
            committed.append(samples)
        return committed

    def _fail(self, seq: Sequence, reason: str) -> RequestOutput:
        """End one request with an error: pages released, nothing of it published, its error output."""
        self.scheduler.fail(seq, reason)
        return self._failed(seq)

    def _failed(self, seq: Sequence) -> RequestOutput:
        self.sequences.pop(seq.request_id, None)
        self._end(seq)
        return self.outputs.output(seq, [])

    def _propose(self) -> None:
        """Drafts for the next step: each running sequence about to decode one token, unless it is not speculative
        (it opted out, or the speculation table's media row turned it off at admission: Engine.add_request)."""
        assert self.proposer is not None
        with self.profiler.stage(SPEC_DRAFT_PROPOSAL_STAGE):
            seqs = [seq for seq in self.scheduler.running if seq.num_pending_tokens == 1 and seq.output_ids
                    and seq.request.sampling.speculative]
            if not seqs:
                return
            proposals = self.proposer.propose_batch(seqs, [self.scheduler.draft_room(seq) for seq in seqs])
            for seq, proposal in zip(seqs, proposals, strict=True):
                if isinstance(proposal, DraftTree):
                    seq.spec_token_ids, seq.spec_parents = proposal.token_ids, proposal.parents
                else:
                    seq.spec_token_ids, seq.spec_parents = proposal, []

    def _reused_at_admission(self, batch: SchedulerOutput) -> int:
        """Tokens a sequence starts with at admission were served from a cache (pages, the legacy copy, a shared
        tier's load, and restored documents further on)."""
        admitted = {id(seq) for seq in batch.admitted}
        return sum(self.scheduler.cached_tokens(row.seq) for row in batch.rows if id(row.seq) in admitted)

    def _count(self, batch: SchedulerOutput, updates: list[RowUpdate], reused: int) -> None:
        if batch.has_prefill or batch.admitted:
            self.profiler.add_prefill(reused_tokens=reused,
                                      computed_tokens=sum(r.num_new_tokens for r in batch.rows if r.is_prefill))
        if not batch.has_prefill:
            self.profiler.add_generation(sum(len(update.new_token_ids) for update in updates))
        for update in updates:
            if update.num_drafts:
                self.profiler.add_speculation(update.num_drafts, update.num_drafts - update.num_rejected,
                                              len(update.new_token_ids))

    def _output(self, update: RowUpdate) -> RequestOutput:
        seq = update.seq
        if seq.is_finished:
            self.sequences.pop(seq.request_id, None)
            self._end(seq)
            base_pages = base_pages_reused(seq.request.adapter, seq.request.adapter_start, seq.reused_tokens,
                                           self.scheduler.cache.tokens_per_page)
            corrected = corrected_pages_reused(seq.request.adapter, seq.reused_tokens,
                                               self.scheduler.cache.tokens_per_page)
            self.profiler.add_adapter_request(seq.adapter_label, seq.reused_tokens, base_pages, corrected)
        return self.outputs.output(seq, update.new_token_ids)
