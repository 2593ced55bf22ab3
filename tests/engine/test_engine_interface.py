"""The engine's public interface, what every front end reaches it through: info, prepare, stats, cache_profile;
and the proposer lifecycle's begin and end as the engine loop calls them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.engine import Engine, EngineConfig, EngineInfo
from kvforge.runtime.sequence import Sequence
from kvforge.runtime.spec.proposer import DraftLifecycle, DraftStates
from kvforge.runtime.types import Message, Request, SamplingParams


def steady(engine: Engine, length: int) -> SamplingParams:
    """Greedy with the end tokens banned: every request runs its full length (random sampling that drew an end
    token first left nothing generated, a flake CI met)."""
    return SamplingParams(top_k=1, max_generate_length=length,
                          logit_bias={eos: -100.0 for eos in engine.info.model.eos_token_ids})


@pytest.fixture(scope="module")
def engine(tiny_engine_dir: Path) -> Engine:
    return Engine(tiny_engine_dir, EngineConfig(num_threads=1, enable_context_reuse=True))


def test_info_reports_the_build_and_the_switches(engine: Engine, tiny_engine_dir: Path) -> None:
    info = engine.info
    assert isinstance(info, EngineInfo)
    assert info.max_input_len == info.build.max_input_len > 0
    assert info.max_kv_cache_capacity == info.build.max_kv_cache_capacity >= info.max_input_len
    assert 1 <= info.max_batch_size <= info.build.max_batch_size
    assert info.reuse_enabled and info.spec_decode == "off" and info.adapters == ()
    assert info.attention == info.build.attention
    assert info.tokenizer.encode("hello") == engine.prepare("hello").prompt_ids


def test_prepare_takes_chats_and_raw_prompts(engine: Engine) -> None:
    sampling = SamplingParams(max_generate_length=3)
    raw = engine.prepare([5, 6, 7], sampling, cache_salt="s")
    assert raw.prompt_ids == [5, 6, 7] and raw.cache_salt == "s" and raw.sampling.max_generate_length == 3
    chat = engine.prepare(Request(0, [Message("user", "hi")], sampling), where="")
    assert chat.prompt_ids and chat.prompt_ids != raw.prompt_ids
    assert "hi" in engine.prompt_text(Request(0, [Message("user", "hi")], sampling))
    with pytest.raises(KvforgeError) as info:  # a token outside the vocabulary, named as the prompt
        engine.prepare([engine.info.model.vocab_size], sampling)
    assert "prompt" in (info.value.field or "")


def test_stats_are_counters_and_the_cache_profile_comes_when_asked(engine: Engine) -> None:
    request = engine.prepare([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], steady(engine, 2))
    request_id = engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.cache == {}  # counters only: the cache's records are not walked
    assert stats.prefill_computed_tokens == 10 and stats.generated_tokens >= 1 and stats.waiting == stats.running == 0
    profile = engine.cache_profile()
    assert profile and profile == engine.profile()["context_cache"]
    assert not engine.abort(request_id)  # finished: nothing to abort


class RecordingProposer:
    """A proposer keeping per-request state (the lifecycle's begin and end), drafting nothing."""

    owns_kv = False

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.states: DraftStates[int] = DraftStates()

    def begin(self, seq: Sequence) -> None:
        self.events.append(("begin", seq.request_id))
        self.states.begin(seq.request_id)

    def rollback(self, seq: Sequence) -> None:
        self.events.append(("rollback", seq.request_id))

    def end(self, request_id: str) -> None:
        self.events.append(("end", request_id))
        self.states.end(request_id)

    def observe(self, rows: list, output: object, sampled: list) -> None:
        for row in rows:
            self.states.set(row.seq.request_id, row.seq.num_computed_tokens)

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [[] for _ in seqs]


def test_a_proposer_with_per_request_state_sees_begin_and_end(tiny_engine_dir: Path) -> None:
    engine = Engine(tiny_engine_dir, EngineConfig(num_threads=1, spec_decode="ngram"))
    proposer = RecordingProposer()
    assert isinstance(proposer, DraftLifecycle)
    engine.core.proposer = proposer
    sampling = steady(engine, 4)
    done = engine.add_request(engine.prepare([3, 4, 5, 6], sampling), "done")
    gone = engine.add_request(engine.prepare([7, 8, 9], sampling), "gone")
    engine.step()
    assert engine.abort(gone)
    while engine.has_unfinished():
        engine.step()
    assert proposer.events == [("begin", done), ("begin", gone), ("end", gone), ("end", done)]
    assert len(proposer.states) == 0  # nothing outlives its request


class WrongGuesser(RecordingProposer):
    """Drafts one token the model is unlikely to pick, so verify rows reject it."""

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [[(seq.output_ids[-1] + 1) % 7 + 3] if limit else [] for seq, limit in zip(seqs, limits, strict=True)]


@pytest.mark.parametrize("hybrid", [False, True])
def test_rejected_drafts_roll_the_drafter_back_on_a_recurrent_base(
        hybrid: bool, tiny_engine_dir: Path, tiny_hybrid_engine_dir: Path) -> None:
    engine = Engine(tiny_hybrid_engine_dir if hybrid else tiny_engine_dir,
                    EngineConfig(num_threads=1, spec_decode="ngram"))
    proposer = WrongGuesser()
    engine.core.proposer = proposer
    request_id = engine.add_request(engine.prepare([3, 4, 5, 6], steady(engine, 8)))
    while engine.has_unfinished():
        engine.step()
    rollbacks = [rid for event, rid in proposer.events if event == "rollback"]
    assert engine.stats().spec_draft_tokens > engine.stats().spec_accepted_tokens  # some drafts were rejected
    # Only a recurrent state is restored (attention K/V past the kept tokens is simply overwritten).
    assert rollbacks == ([request_id] * len(rollbacks) if hybrid else []) and (bool(rollbacks) == hybrid)
