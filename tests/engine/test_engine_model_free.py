"""The product's loop without a model: scheduler + cache manager + state manager + EngineCore over a fake backend.

Random arrivals on every deployment (attention-only with partial-KV snapshots, hybrid, pure recurrent) drive
admission, chunked prefill, preemption, snapshot and checkpoint restores, multi-token commits of drafts with
rollback, and aborts; every answer must equal greedy decoding without an engine and every step must audit clean.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.fake_backend import FIRST_TOKEN, ModelFreeEngine, cold_answer, model_free_engine

from kvforge.runtime.engine.state import CheckpointPolicy
from kvforge.runtime.sampling.sampler import Sampler
from kvforge.runtime.sequence import EngineRequest, FinishReason, Sequence, Status
from kvforge.runtime.types import Deployment, SamplingParams

T = 4
# Two documents share their first 36 tokens; message boundaries after a document (>= MIN_BOUNDARY_GAP tokens) are
# captured as checkpoints, so a question on the same document hits mid-prompt.
DOCUMENTS = ([*range(1, 41)], [*range(1, 37), *range(60, 68)], [*range(70, 99)])
SEEN = {"preemptions": 0, "restores": 0, "waits": 0, "accepted_drafts": 0, "rejected_drafts": 0,
        "hit_sequences": 0, "aborts": 0, "checkpoint_hits_mid_prompt": 0, "recurrent_snapshot_evictions": 0,
        "partial_snapshot_evictions": 0}
# Not guarded: snapshot pressure skips. The loop unpins restored snapshots at admission, so a capture always finds a
# slot to evict; tests/test_context_cache*.py reach the skip with a pin held across a capture.


def make_sequence(i: int, prompt: list[int], length: int, salt: str | None = None,
                  boundaries: tuple[int, ...] = ()) -> Sequence:
    sampling = SamplingParams(temperature=0.0, max_generate_length=length)
    request = EngineRequest(prompt, sampling, None, salt, message_boundaries=boundaries)
    return Sequence(str(i), request, Sampler(sampling), arrival=i)


def propose(engine: ModelFreeEngine, rng: random.Random, answers: dict[str, list[int]], k: int) -> None:
    """A fake drafter: for each decode row, k tokens of which a random prefix is right (the cold answer)."""
    for seq in engine.scheduler.running:
        if seq.num_pending_tokens != 1 or not seq.output_ids:
            continue
        done = len(seq.output_ids)
        right = answers[seq.request_id][done:done + k]
        good = rng.randint(0, len(right))
        seq.spec_token_ids = right[:good] + [FIRST_TOKEN + (t + 1) % 97 for t in right[good:good + 1]]


def drive(engine: ModelFreeEngine, arrivals: list[dict], prompts: list[list[int]], boundaries: list[tuple[int, ...]],
          *, drafts: int, seed: int) -> dict[str, list[int]]:
    """The front end's part: add requests as they arrive, abort some, propose drafts, step until done."""
    answers = {str(i): cold_answer(p, a["max_generate_length"]) for i, (p, a) in enumerate(zip(prompts, arrivals,
                                                                                            strict=True))}
    rng = random.Random(seed)
    added: dict[str, Sequence] = {}
    finished: dict[str, list[int]] = {}
    step = 0
    while len(added) < len(arrivals) or engine.core.has_unfinished():
        for i, a in enumerate(arrivals):
            rid = str(i)
            if a["arrives_at"] == step:
                added[rid] = seq = make_sequence(i, prompts[i], a["max_generate_length"], a["salt"], boundaries[i])
                assert engine.cache.fits_alone(len(prompts[i]) + a["max_generate_length"])
                engine.core.add(seq)
            if a["abort_at"] == step and rid in added and rid not in finished and engine.core.abort(rid):
                SEEN["aborts"] += 1
        if drafts:
            propose(engine, rng, answers, drafts)
        for output in engine.core.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
                if engine.state.states is not None and 0 < output.cached_tokens < len(output.prompt_token_ids):
                    SEEN["checkpoint_hits_mid_prompt"] += 1  # resumed from a message boundary's checkpoint
        engine.cache.check_invariants()
        step += 1
        assert step < 3000, "the loop stopped making progress"
    for rid, tokens in finished.items():
        assert tokens == answers[rid], rid
    assert not engine.cache.leases and all(not any(pool.active) for pool in engine.cache.pools)
    states = engine.state.states
    assert states is None or states.num_free == engine.scheduler.max_batch_size, "a recurrent row leaked"
    return finished


arrival = st.fixed_dictionaries({
    "document": st.sampled_from(range(len(DOCUMENTS))),
    "document_len": st.sampled_from([0, 12, 36, 40]),
    "question": st.lists(st.integers(40, 59), min_size=1, max_size=6),
    "salt": st.sampled_from([None, None, "a"]),
    "max_generate_length": st.integers(1, 24),
    "arrives_at": st.integers(0, 30),
    "abort_at": st.one_of(st.none(), st.none(), st.none(), st.integers(0, 15)),
    "extends": st.one_of(st.none(), st.integers(0, 3)),  # a chat turn: an earlier prompt + its answer + a question
})


def prompts_of(arrivals: list[dict]) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    prompts: list[list[int]] = []
    boundaries: list[tuple[int, ...]] = []
    for i, a in enumerate(arrivals):
        earlier = a["extends"] if a["extends"] is not None and a["extends"] < i else None
        if earlier is None:
            head = DOCUMENTS[a["document"]][:a["document_len"]]
            marks: tuple[int, ...] = (len(head),) if head else ()
        else:
            head = prompts[earlier] + cold_answer(prompts[earlier], arrivals[earlier]["max_generate_length"])
            marks = (*boundaries[earlier], len(prompts[earlier]), len(head))
        prompts.append(head + a["question"])
        boundaries.append(marks)
    return prompts, boundaries


# Explicit examples reach preemption, a partial-KV restore, a checkpoint restore and drafts whatever the generated
# examples do (they change with this function's source text).
CHAT = [{"document": 0, "document_len": 40, "question": [41, 42, 43], "salt": None, "max_generate_length": 9,
         "arrives_at": 0, "abort_at": None, "extends": None},
        {"document": 0, "document_len": 40, "question": [44], "salt": None, "max_generate_length": 9,
         "arrives_at": 12, "abort_at": None, "extends": 0},
        {"document": 1, "document_len": 40, "question": [45, 46], "salt": None, "max_generate_length": 9,
         "arrives_at": 1, "abort_at": None, "extends": None},
        {"document": 2, "document_len": 36, "question": [47], "salt": None, "max_generate_length": 9,
         "arrives_at": 1, "abort_at": 3, "extends": None}]


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@example(arrivals=CHAT, deployment=Deployment.VANILLA, pool_slack=0, slots=2, chunk=8, max_records=1024, drafts=3)
@example(arrivals=CHAT, deployment=Deployment.HYBRID, pool_slack=0, slots=2, chunk=8, max_records=1024, drafts=3)
@example(arrivals=CHAT, deployment=Deployment.PURE_RECURRENT, pool_slack=0, slots=2, chunk=64, max_records=1024,
         drafts=2)
@given(arrivals=st.lists(arrival, min_size=1, max_size=6),
       deployment=st.sampled_from([Deployment.VANILLA, Deployment.HYBRID, Deployment.PURE_RECURRENT]),
       pool_slack=st.sampled_from([0, 0, 3, 40]), slots=st.sampled_from([1, 2, 8]), chunk=st.sampled_from([3, 8, 64]),
       max_records=st.sampled_from([0, 2, 1024]), drafts=st.sampled_from([0, 0, 1, 3]))
def test_the_loop_matches_greedy_decoding_on_every_deployment(arrivals: list[dict], deployment: Deployment,
                                                              pool_slack: int, slots: int, chunk: int,
                                                              max_records: int, drafts: int) -> None:
    prompts, boundaries = prompts_of(arrivals)
    # The pool holds the longest request alone (its drafts included) plus `pool_slack` pages: rows wait and preempt.
    need = max(-(-(len(p) + a["max_generate_length"] + drafts) // T) for p, a in zip(prompts, arrivals, strict=True))
    recurrent = deployment is not Deployment.VANILLA
    engine = model_free_engine(deployment, num_pages=need + pool_slack, tokens_per_page=T, partial_slots=slots,
                               recurrent_slots=slots if recurrent else 0, max_records=max_records, chunk=chunk,
                               checkpoints=CheckpointPolicy(enabled=recurrent, interval_tokens=0))
    drive(engine, arrivals, prompts, boundaries, drafts=drafts, seed=len(arrivals))
    SEEN["preemptions"] += engine.scheduler.stats.preemptions
    SEEN["waits"] += engine.scheduler.stats.inflight_prefix_waits
    SEEN["restores"] += engine.cache.metrics.restores
    SEEN["hit_sequences"] += engine.cache.metrics.hit_sequences
    SEEN["recurrent_snapshot_evictions"] += engine.cache.metrics.reclaimed["recurrent_snapshots"]
    SEEN["partial_snapshot_evictions"] += engine.cache.metrics.reclaimed["partial_kv_snapshots"]


def test_property_examples_exercised_the_loop() -> None:
    """Guards the property test's strategy: preemption, in-flight waits, restores (mid-prompt checkpoints too), hits,
    aborts, accepted and rejected drafts, and snapshot slots reclaimed by eviction."""
    if not SEEN["restores"]:
        pytest.skip("run together with test_the_loop_matches_greedy_decoding_on_every_deployment (it fills SEEN)")
    assert all(SEEN.values()), SEEN


@pytest.fixture(autouse=True)
def count_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts verified and rejected drafts through the scheduler's own RowUpdate (no behaviour changes)."""
    from kvforge.runtime.engine import scheduler

    commit = scheduler.Scheduler._commit_tokens

    def counted(self, row, samples, before):  # type: ignore[no-untyped-def]
        update = commit(self, row, samples, before)
        SEEN["rejected_drafts"] += update.num_rejected
        SEEN["accepted_drafts"] += update.num_drafts - update.num_rejected
        return update

    monkeypatch.setattr(scheduler.Scheduler, "_commit_tokens", counted)


# --- the commit step, one case each ------------------------------------------------------------------------------

@pytest.mark.parametrize("deployment", [Deployment.VANILLA, Deployment.HYBRID, Deployment.PURE_RECURRENT])
def test_a_verify_row_commits_the_accepted_prefix_and_one_more_token(deployment: Deployment) -> None:
    engine = model_free_engine(deployment, num_pages=16, tokens_per_page=T, reuse=False)
    prompt = [*range(1, 11)]
    answer = cold_answer(prompt, 8)
    seq = make_sequence(0, prompt, 8)
    engine.core.add(seq)
    [first] = engine.core.step()  # the prefill: one token
    assert first.new_token_ids == answer[:1]
    states = engine.state.states
    if states is not None:  # a step without drafts copies no state
        assert seq.lease is not None and not states.is_saved(engine.state.rows[seq.lease])
    seq.spec_token_ids = [answer[1], answer[2], answer[3] + 1]  # two right, then a wrong one
    [second] = engine.core.step()
    assert second.new_token_ids == answer[1:4]  # two drafts kept and the base's own token for the third
    # Attention keeps the verified K/V (the wrong draft's position is overwritten later); a recurrent state consumed
    # the wrong draft, so it goes back to before the call and the kept tokens are recomputed.
    expected = len(prompt) + 3 if deployment is Deployment.VANILLA else len(prompt)
    assert seq.num_computed_tokens == expected
    done = 4
    if deployment is not Deployment.VANILLA:  # the recompute of the kept tokens is a row of its own (no drafts)
        [recompute] = engine.core.step()
        assert recompute.new_token_ids == answer[4:5] and seq.num_computed_tokens == len(prompt) + 4
        done = 5
    seq.spec_token_ids = answer[done:8] + [FIRST_TOKEN]  # all right; the last is past max_generate_length: dropped
    [third] = engine.core.step()
    assert third.new_token_ids == answer[done:8] and third.finished
    assert engine.cache.check_invariants() is None and not engine.cache.leases


@pytest.mark.parametrize("deployment", [Deployment.VANILLA, Deployment.HYBRID])
def test_a_stop_inside_the_drafts_ends_the_sequence_there(deployment: Deployment) -> None:
    prompt = [*range(1, 11)]
    answer = cold_answer(prompt, 5)
    hybrid = deployment is Deployment.HYBRID
    engine = model_free_engine(deployment, num_pages=16, tokens_per_page=T, recurrent_slots=2 if hybrid else 0,
                               partial_slots=2, checkpoints=CheckpointPolicy(enabled=hybrid), eos_ids={answer[1]})
    seq = make_sequence(0, prompt, 5)
    engine.core.add(seq)
    engine.core.step()
    seq.spec_token_ids = answer[1:4]  # all right, but the first is end-of-sequence
    [out] = engine.core.step()
    assert out.new_token_ids == answer[1:2] and out.finish_reason == FinishReason.EOS.value
    # Nothing past the stop is resident: attention kept only the row's own token; the hybrid state had consumed the
    # drafts, so it was rolled back, and its finished checkpoint is no longer than what it holds.
    longest = max(len(r.token_ids) for r in engine.cache.records.least_recent_first())
    assert longest == (len(prompt) if hybrid else len(prompt) + 1)
    engine.cache.check_invariants()


def test_an_aborted_sequence_publishes_nothing_and_frees_its_row() -> None:
    engine = model_free_engine(Deployment.HYBRID, num_pages=16, tokens_per_page=T, recurrent_slots=2,
                               partial_slots=2, chunk=4, checkpoints=CheckpointPolicy(enabled=True))
    seq = make_sequence(0, [*range(1, 31)], 5)
    engine.core.add(seq)
    engine.core.step()  # a first chunk of 4
    assert engine.core.abort("0") and seq.status is Status.FINISHED
    assert seq.finish_reason is FinishReason.ABORTED and not engine.core.has_unfinished()
    assert len(engine.cache.records) == 0 and engine.state.states.num_free == 4  # type: ignore[union-attr]
    engine.cache.check_invariants()


class FakeLoader:
    """A shared tier holding pages for request "0" only: its load takes `steps` polls and brings `tokens` tokens."""

    def __init__(self, steps: int, tokens: int) -> None:
        self.steps, self.tokens, self.polls = steps, tokens, 0
        self.cancelled: list[str] = []

    def start(self, seq: Sequence) -> bool:
        return seq.request_id == "0"

    def poll(self, seq: Sequence) -> int | None:
        self.polls += 1
        return self.tokens if self.polls >= self.steps else None

    def cancel(self, seq: Sequence) -> None:
        self.cancelled.append(seq.request_id)

    def wait(self, timeout_s: float) -> None:
        pass


def test_a_sequence_waiting_for_remote_pages_does_not_hold_up_the_others() -> None:
    engine = model_free_engine(Deployment.VANILLA, num_pages=16, tokens_per_page=T, loader=FakeLoader(4, 0))
    first, second = make_sequence(0, [*range(1, 9)], 2), make_sequence(1, [*range(20, 28)], 2)
    engine.core.add(first)
    engine.core.add(second)
    [out] = engine.core.step()  # the first waits for its pages; the second, behind it in the queue, runs
    assert out.request_id == "1" and first.status is Status.WAITING_FOR_REMOTE and first.lease is not None
    while engine.core.has_unfinished():
        engine.core.step()
    assert first.output_ids == cold_answer(first.prompt_ids, 2)
    assert second.output_ids == cold_answer(second.prompt_ids, 2)
    engine.cache.check_invariants()
    assert not engine.cache.leases
