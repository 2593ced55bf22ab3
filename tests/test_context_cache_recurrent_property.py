"""Property test: the Scheduler and the cache manager on hybrid and pure recurrent deployments with tight budgets.

A fake runner stands in for the engine: a sequence's recurrent state is the tuple of tokens it has consumed (a
restored snapshot included), KV pages hold token ids, and the next token is a hash of the state. Every computed
row first checks that the state and every earlier KV position hold exactly the sequence's tokens, so a wrong
checkpoint, a wrong hit page or a page overwritten under another record fails at once; every finished request must
equal its cold answer. Like the engine, the runner stops a prefill chunk at each capture point (chat-message
boundaries, every `interval` tokens) and publishes a checkpoint there, at the prefill end and at the decode end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.manager import ContextCacheManager, Deployment
from kvforge.runtime.scheduler import Scheduler
from kvforge.runtime.sequence import EngineRequest, Sequence
from kvforge.runtime.types import SamplingParams

T = 4
VOCAB = 97
DOCUMENTS = ([*range(1, 21)], [*range(1, 9), *range(50, 62)], [*range(70, 90)])  # two share their first 8 tokens
SEEN = {"boundary_hits": 0, "restores": 0, "preemptions": 0, "pressure_skips": 0, "snapshot_evictions": 0}


def next_token(state: tuple[int, ...]) -> int:
    value = 17
    for token in state:
        value = (value * 31 + token) % 1_000_003
    return 100 + value % VOCAB


def cold_answer(prompt: list[int], length: int) -> list[int]:
    state, out = list(prompt), []
    for _ in range(length):
        out.append(next_token(tuple(state)))
        state.append(out[-1])
    return out


@dataclass(slots=True)
class FakeRunner:
    """The engine's side of the contract: restores, computes rows, captures and publishes."""

    cache: ContextCacheManager = field(init=False)  # built with this runner as its copier, then set
    states: dict[int, tuple[int, ...]] = field(default_factory=dict)  # id(lease) -> tokens its state consumed
    kv: dict[int, list[int | None]] = field(default_factory=dict)  # page -> token ids written there
    recurrent: dict[int, tuple[int, ...]] = field(default_factory=dict)  # the two snapshot stores
    partial: dict[int, list[int | None]] = field(default_factory=dict)
    capture_points: dict[int, set[int]] = field(default_factory=dict)  # id(seq) -> lengths to publish at
    late_unpin: bool = False  # unpin restored snapshots at the prefill end (TensorRT Edge-LLM), not at once

    def capture_recurrent(self, lease: Lease, slot: int) -> None:
        self.recurrent[slot] = self.states[id(lease)]

    def capture_partial(self, page: int, slot: int) -> None:
        self.partial[slot] = list(self.kv[page])

    def restore(self, seq: Sequence) -> None:
        lease = seq.lease
        assert lease is not None
        state: tuple[int, ...] = ()
        if lease.restore_recurrent_slot is not None:
            state = self.recurrent[lease.restore_recurrent_slot]
            if lease.reuse_tokens < len(seq.prompt_ids) and lease.reuse_tokens in self.capture_points[id(seq)]:
                SEEN["boundary_hits"] += 1
        assert state == tuple(seq.all_token_ids()[:lease.reuse_tokens]), "restored a checkpoint of other tokens"
        assert lease.reuse_tokens < seq.num_tokens, "at least one token must compute (its logits give the next token)"
        if lease.restore_slot is not None:
            self.kv[lease.page_ids[lease.reuse_tokens // T]] = list(self.partial[lease.restore_slot])
        self.states[id(lease)] = state
        if not self.late_unpin:
            self.cache.finish_restore(lease)

    def compute(self, seq: Sequence, count: int) -> None:
        """Compute up to `count` tokens, stopping at the next capture point, and publish where the engine would."""
        lease, start, tokens = seq.lease, seq.num_computed_tokens, seq.all_token_ids()
        assert lease is not None
        end = min([b for b in self.capture_points[id(seq)] if start < b < start + count], default=start + count)
        assert self.states[id(lease)] == tuple(tokens[:start]), "the recurrent state is not this sequence's prefix"
        if self.cache.paged:
            for p in range(start):  # attention reads every earlier position
                assert self.kv[lease.page_ids[p // T]][p % T] == tokens[p], "a KV page holds other tokens"
            for p in range(start, end):
                self.kv.setdefault(lease.page_ids[p // T], [None] * T)[p % T] = tokens[p]
        else:
            assert lease.page_ids == []
        self.states[id(lease)] = tuple(tokens[:end])
        seq.num_computed_tokens = end
        if end in self.capture_points[id(seq)] and end < len(seq.prompt_ids):
            self.cache.publish(lease, tokens[:end], boundary=True)
        if end == len(seq.prompt_ids):
            self.cache.publish(lease, tokens[:end])  # the prefill end
        if end >= len(seq.prompt_ids):
            self.cache.finish_restore(lease)  # no-op unless late_unpin left the restored snapshots pinned

    def forget(self, seq: Sequence) -> None:
        if seq.lease is not None:
            self.states.pop(id(seq.lease), None)


arrival = st.fixed_dictionaries({
    "document": st.sampled_from(range(len(DOCUMENTS))),
    "document_len": st.integers(0, 20),
    "question": st.lists(st.integers(200, 204), min_size=1, max_size=6),
    "salt": st.sampled_from([None, None, "a"]),
    "max_generate_length": st.integers(1, 5),
    "arrives_at": st.integers(0, 30),
    "abort_at": st.one_of(st.none(), st.none(), st.integers(0, 15)),
    # a chat turn: an earlier request's prompt + answer + this question
    "extends": st.one_of(st.none(), st.integers(0, 4), st.integers(0, 1)),
})


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(arrival, min_size=1, max_size=6),
       deployment=st.sampled_from([Deployment.HYBRID, Deployment.PURE_RECURRENT]),
       pool_slack=st.sampled_from([0, 3, 40]), recurrent_slots=st.sampled_from([1, 2]),
       partial_slots=st.sampled_from([1, 2]), chunk=st.sampled_from([3, 8, 64]),
       max_records=st.sampled_from([0, 2, 1024]), interval=st.sampled_from([None, 5]), late_unpin=st.booleans())
def test_scheduler_and_checkpoints_match_each_request_alone(
        arrivals: list[dict], deployment: Deployment, pool_slack: int, recurrent_slots: int, partial_slots: int,
        chunk: int, max_records: int, interval: int | None, late_unpin: bool) -> None:
    prompts: list[list[int]] = []
    captures: list[set[int]] = []
    for i, a in enumerate(arrivals):
        earlier = a["extends"] if a["extends"] is not None and a["extends"] < i else None
        if earlier is None:
            head = DOCUMENTS[a["document"]][:a["document_len"]]
            points = {len(head)}  # the end of the system prompt / document message
        else:  # a chat turn: the earlier prompt, its answer, then a new question
            head = prompts[earlier] + cold_answer(prompts[earlier], arrivals[earlier]["max_generate_length"])
            points = captures[earlier] | {len(prompts[earlier]), len(head)}
        prompts.append(head + a["question"])
        if interval:
            points |= set(range(interval, len(prompts[-1]), interval))
        captures.append({p for p in points if p > 0})
    paged = deployment is Deployment.HYBRID
    # The pool holds the longest request alone plus `pool_slack` pages: requests wait, and running ones preempt.
    need = max(-(-(len(p) + a["max_generate_length"]) // T) for p, a in zip(prompts, arrivals, strict=True))
    runner = FakeRunner(late_unpin=late_unpin)
    runner.cache = cache = ContextCacheManager(need + pool_slack if paged else 0, T, enabled=True,
                                               max_records=max_records, partial_kv_snapshot_slots=partial_slots,
                                               recurrent_snapshot_slots=recurrent_slots, deployment=deployment,
                                               copier=runner)
    scheduler = Scheduler(cache, max_batch_size=4, max_num_tokens=32, prefill_chunk_tokens=chunk)
    sequences: dict[int, Sequence] = {}
    finished: dict[int, list[int]] = {}
    aborted: set[int] = set()
    step = 0
    while len(sequences) < len(arrivals) or scheduler.has_unfinished():
        for i, a in enumerate(arrivals):
            if a["arrives_at"] == step:
                sampling = SamplingParams(temperature=0.0, max_generate_length=a["max_generate_length"])
                seq = Sequence(str(i), EngineRequest(prompts[i], sampling, None, a["salt"]), None, i)  # type: ignore
                assert cache.fits_alone(len(prompts[i]) + a["max_generate_length"])
                runner.capture_points[id(seq)] = captures[i]
                sequences[i] = seq
                scheduler.add(seq)
            seq = sequences.get(i)
            if a["abort_at"] == step and seq is not None and i not in finished and not seq.is_finished:
                runner.forget(seq)
                scheduler.finish(seq)  # released, nothing published
                aborted.add(i)
        out = scheduler.schedule()
        for seq in out.preempted:
            runner.forget(seq)
        for seq in out.admitted:
            runner.restore(seq)
        for row in out.rows:
            seq = row.seq
            runner.compute(seq, row.num_new_tokens)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.output_ids.append(next_token(runner.states[id(seq.lease)]))  # the row's logits give the next token
            if len(seq.output_ids) == seq.request.sampling.max_generate_length:
                assert seq.lease is not None
                cache.publish(seq.lease, seq.resident_token_ids())  # the decode end, including generated tokens
                finished[int(seq.request_id)] = list(seq.output_ids)
                runner.forget(seq)
                scheduler.finish(seq)
        cache.check_invariants()
        step += 1
        assert step < 2000, "the scheduler stopped making progress"
    for i, a in enumerate(arrivals):
        if i not in aborted:
            assert finished[i] == cold_answer(prompts[i], a["max_generate_length"]), (i, a)
    assert not cache.leases and all(not any(pool.active) for pool in cache.pools)
    SEEN["restores"] += cache.metrics.restores
    SEEN["preemptions"] += scheduler.stats.preemptions
    SEEN["pressure_skips"] += cache.metrics.snapshot_pressure_skips
    SEEN["snapshot_evictions"] += cache.metrics.reclaimed["recurrent_snapshots"]


def test_property_examples_exercised_restores_pressure_and_preemption() -> None:
    """Guards the strategy above: it must keep reaching boundary hits, restores, pressure skips, preemption and
    snapshot slots reclaimed by eviction."""
    if not SEEN["restores"]:
        import pytest

        pytest.skip("run together with test_scheduler_and_checkpoints_match_each_request_alone (it fills SEEN)")
    assert all(SEEN.values()), SEEN
