"""Shared steps of the speculative-decoding tests: greedy requests with their top-1 ids, and runs with an abort."""

from __future__ import annotations

from kvforge.runtime.context_cache.types.draft_paths import draft_page_ids
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.engine.output import RequestOutput
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams


def sampling(engine: Engine, length: int = 20, **kwargs) -> SamplingParams:
    """Greedy, top-1 logprobs, EOS banned (every request runs its full length)."""
    eos = engine.engine_dir.model.eos_token_ids[0]
    return SamplingParams(temperature=0.0, num_logprobs=1, max_generate_length=length, logit_bias={eos: -100.0},
                          **kwargs)


def step_with_abort(engine: Engine, ids: list[str], abort_at: int) -> tuple[dict[str, RequestOutput], str | None]:
    """Step to the end, aborting the last of several requests at step `abort_at` and auditing the cache after each
    step; (the finished outputs by id, the aborted id). Afterwards no lease is left and the draft pool holds only
    what records hold."""
    aborted = ids[-1] if len(ids) > 1 else None
    finished: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == abort_at and aborted is not None:
            engine.abort(aborted)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.cache.check_invariants()
        steps += 1
    assert not engine.cache.leases
    draft_pool = engine.cache.pools.draft_kv_pages
    held = {p for r in engine.cache.records.least_recent_first() for p in draft_page_ids(r)}
    assert draft_pool.num_free == draft_pool.capacity - len(held)
    return finished, aborted


def greedy_ids(out: RequestOutput) -> tuple[list[int], list[int]]:
    return out.token_ids, [s[0].token_id for s in out.logprobs]


def add_all(engine: Engine, prompts: list[str], length: int, opt_out: frozenset[int] | set[int] = frozenset()
            ) -> list[str]:
    return [engine.add_request(EngineRequest(engine.tokenizer.encode(text),
                                             sampling(engine, length, speculative=i not in opt_out)))
            for i, text in enumerate(prompts)]


def run_all(engine: Engine, prompts: list[str], opt_out: frozenset[int] = frozenset(), length: int = 20) -> dict:
    """Every prompt to the end (audited); {prompt index: (tokens, top-1 ids)}."""
    from support.engine_driver import step_audited

    ids = add_all(engine, prompts, length, opt_out)
    finished = step_audited(engine)
    return {i: greedy_ids(finished[rid]) for i, rid in enumerate(ids)}


class RecordingProposer:
    """Wraps an engine's proposer and keeps every proposal it makes, per request id (a draft's output depends on its
    K/V: a stale or incoherent reused path would propose other tokens)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.owns_kv = inner.owns_kv
        self.proposals: dict[str, list] = {}

    def observe(self, rows, output, sampled) -> None:
        self.inner.observe(rows, output, sampled)

    def propose_batch(self, seqs, limits):
        proposals = self.inner.propose_batch(seqs, limits)
        for seq, proposal in zip(seqs, proposals, strict=True):
            self.proposals.setdefault(seq.request_id, []).append(proposal)
        return proposals


def recording(engine: Engine) -> RecordingProposer:
    """Swap a RecordingProposer in for the engine's proposer."""
    proposer = RecordingProposer(engine.proposer)
    engine.proposer = engine.core.proposer = proposer
    return proposer


class OracleProposer:
    """Wraps an engine's proposer (which runs as usual: its K/V and calls unchanged) but proposes a plain run's next
    tokens with every third one wrong: acceptance, partial acceptance and the drafter catching up on several accepted
    positions are exercised, which random drafts (never accepted) leave out. `answers`: prompt ids -> plain tokens."""

    def __init__(self, inner, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.inner = inner
        self.owns_kv = inner.owns_kv
        self.answers = answers

    def observe(self, rows, output, sampled) -> None:
        self.inner.observe(rows, output, sampled)

    def propose_batch(self, seqs, limits):
        proposals = self.inner.propose_batch(seqs, limits)
        for i, seq in enumerate(seqs):
            if not proposals[i]:
                continue
            full = self.answers[tuple(seq.request.prompt_ids)]
            done = len(seq.output_ids)
            guess = full[done:done + len(proposals[i])]
            proposals[i] = [t if (done + j) % 3 else (t + 1) % 200 for j, t in enumerate(guess)]
        return proposals


def with_oracle(engine: Engine, prompts: list[str], plain: dict) -> None:
    """Swap an OracleProposer in, answering with `plain` (run_all's result on `prompts`)."""
    answers = {tuple(engine.tokenizer.encode(text)): plain[i][0] for i, text in enumerate(prompts)}
    engine.proposer = engine.core.proposer = OracleProposer(engine.proposer, answers)


def assert_lossless_with_abort(engine: Engine, plain_engine: Engine, prompts: list[str], length: int,
                               opt_out: set[int], abort_at: int) -> None:
    """Every request of `prompts` (those in `opt_out` undrafted) stepped to the end with one abort at `abort_at`
    (step_with_abort): each that finished has the tokens and top-1 ids of a plain run on `plain_engine`."""
    ids = add_all(engine, prompts, length, opt_out)
    finished, aborted = step_with_abort(engine, ids, abort_at)
    for i, rid in enumerate(ids):
        if rid == aborted and rid not in finished:
            continue
        assert greedy_ids(finished[rid]) == run_all(plain_engine, [prompts[i]], length=length)[0]


def assert_media_runs_cold(engine: Engine, text: str) -> None:
    """The support matrix's bypassed row: two speculative requests with the same image run undrafted and cold (no
    lookup, nothing published to hit), counted in the profile."""
    import numpy as np

    from kvforge.runtime.context_cache.keys import MediaKey
    from kvforge.runtime.media_spans import MediaSpan
    from support.engine_driver import step_audited

    tokens = engine.tokenizer.encode(text)
    span = MediaSpan(MediaKey(2, 4, b"image-digest"), np.full((4, engine.engine_dir.model.hidden_size), 0.1,
                                                              dtype=np.float32))
    for request_id in ("spec", "spec-again"):
        engine.add_request(EngineRequest(list(tokens), sampling(engine, 6), media=(span,)), request_id)
        step_audited(engine)
    spec = engine.profile()["spec_decode_generation"]
    assert spec["media_cold_requests"] == 2 and spec["total_draft_tokens"] == 0
    assert engine.profile()["context_cache"]["reused_tokens"] == 0
