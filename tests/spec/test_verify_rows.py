"""Verify rows on real engines: drafts proposed on running sequences change no greedy token and no top-1 logprob id.

A test drafter proposes the cold answer's next tokens with one wrong token at a random place, so every step has
accepted drafts, a rejection and a bonus token; on the hybrid engine each rejection rolls the recurrent state back.
This is the seam a proposer (prompt lookup, EAGLE3) will use: it writes `seq.spec_token_ids` between steps.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from support.engine_driver import assert_idle, make_engine

from kvforge.contract.engine_dir import load_engine_dir
from kvforge.runtime.engine.engine import Engine, snapshot_budgets
from kvforge.runtime.engine.output import RequestOutput
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams

PROMPTS = ["the tide turbines at pier 7 delivered", "a quick brown fox jumps over", "xyz " * 9]
LENGTH = 14


@pytest.fixture(params=["tiny_engine_dir", "tiny_hybrid_engine_dir", "tiny_mamba2_engine_dir"])
def engine_dir(request: pytest.FixtureRequest) -> Path:
    """The shared session engines of each family (attention-only, hybrid, pure recurrent: the rollback path; the
    support matrix rejects speculation on a pure recurrent base, which the drafter issue enforces at start-up)."""
    return request.getfixturevalue(request.param)


def requests(engine: Engine, suffix: str) -> list[EngineRequest]:
    eos = engine.engine_dir.model.eos_token_ids[0]
    sampling = SamplingParams(temperature=0.0, num_logprobs=1, max_generate_length=LENGTH,
                              logit_bias={eos: -100.0})  # exact lengths
    return [EngineRequest(engine.tokenizer.encode(text + suffix), sampling) for text in PROMPTS]


def run(engine: Engine, answers: dict[int, list[int]] | None = None, seed: int = 0,
        suffix: str = "") -> tuple[dict, int]:
    """All requests at once; with `answers` (by prompt), a drafter proposes up to 4 tokens per decode row each step.
    Returns (token ids, top-1 ids) by prompt and the number of steps."""
    rng = random.Random(seed)
    ids = [engine.add_request(r, f"{seed}-{i}") for i, r in enumerate(requests(engine, suffix))]
    finished: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        if answers is not None:
            for seq in engine.scheduler.running:
                if seq.num_pending_tokens == 1 and seq.output_ids:
                    done = len(seq.output_ids)
                    right = answers[ids.index(seq.request_id)][done:done + 4]
                    wrong_at = rng.randint(0, len(right))
                    seq.spec_token_ids = right[:wrong_at] + [(t + 1) % 200 for t in right[wrong_at:wrong_at + 1]]
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.cache.check_invariants()
        steps += 1
    assert_idle(engine)
    results = {i: (finished[rid].token_ids, [s[0].token_id for s in finished[rid].logprobs])
               for i, rid in enumerate(ids)}
    return results, steps


@pytest.mark.parametrize("reuse", [False, True])
def test_drafts_change_no_greedy_token_or_top1_id(engine_dir: Path, reuse: bool) -> None:
    budgets = snapshot_budgets(load_engine_dir(engine_dir), 8) if reuse else {}
    cold, cold_steps = run(make_engine(engine_dir))  # reuse off: every request computed from scratch
    answers = {i: tokens for i, (tokens, _) in cold.items()}
    engine = make_engine(engine_dir, reuse=reuse, **budgets)
    drafted, drafted_steps = run(engine, answers)
    assert drafted == cold
    if reuse:  # longer prompts hit what the drafted run published (a hybrid resumes from its prompt checkpoints)
        longer, _ = run(make_engine(engine_dir), suffix=" again")
        again, _ = run(engine, {i: tokens for i, (tokens, _) in longer.items()}, seed=1, suffix=" again")
        assert again == longer and engine.cache.metrics.hit_sequences > 0
    # Accepted drafts commit several tokens per step; on a recurrent engine each rejection costs a recompute row.
    if engine.states is None:
        assert drafted_steps < cold_steps
