"""Prompt-lookup speculative decoding: the proposer alone, lossless engine runs, rejection sampling's distribution,
the per-request opt-out, the profile block and the settings' one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.cli_checks import answers, assert_one_line_error, write_spec_requests
from support.engine_driver import make_engine, step_audited

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.sampling.rejection import accept_tokens
from kvforge.runtime.sampling.sampler import Sampler
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.spec.ngram import NgramProposer
from kvforge.runtime.types import SamplingParams

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

# Repetitive text, so the tiny random model's outputs and prompts share n-grams and drafts get proposed.
PROMPTS = ["abc abc abc abc abc abc abc", "the cat sat on the mat, the cat sat on the", "x" * 30, "0123456789" * 3]


def test_the_proposer_copies_what_followed_the_longest_earliest_match() -> None:
    proposer = NgramProposer(3, min_n=2, max_n=3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3], 10) == [9, 1, 2]  # n=3 matches at 0: what followed it
    assert proposer.propose([5, 1, 2, 7, 8, 4, 1, 2], 10) == [7, 8, 4]  # n=2 only (no earlier "4 1 2")
    assert proposer.propose([1, 2, 3, 4], 10) == []  # nothing repeats
    assert proposer.propose([1, 2, 7, 1, 2], 1) == [7]  # the limit (tokens left to generate) wins
    assert proposer.propose([1, 2], 5) == [] and proposer.propose([1, 2, 1, 2], 0) == []
    assert NgramProposer(4, 1, 1).propose([3, 5, 3], 4) == [5, 3]  # the continuation may reach the suffix itself


def test_rejection_sampling_keeps_the_base_distribution() -> None:
    """At temperature 1 a one-hot draft is accepted with probability p(d) and replaced otherwise by a draw from p
    without d, so the first committed token is distributed as p whichever token was drafted."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=7)
    for draft in (0, 3):
        sampler = Sampler(params)
        counts = np.zeros(4)
        draws = 20_000
        for _ in range(draws):
            first = accept_tokens(sampler, np.stack([logits, logits]), [draft])[0]
            counts[first.token_id] += 1
        # 20,000 draws: a frequency's standard error is at most 0.0035; 0.015 is over four of them.
        np.testing.assert_allclose(counts / draws, np.exp(logits), atol=0.015)


def test_greedy_acceptance_stops_at_the_first_mismatch() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0))
    rows = np.eye(6)[[2, 4, 1, 5]] * 5.0  # argmax 2, 4, 1, then the bonus position's 5
    assert [r.token_id for r in accept_tokens(sampler, rows, [2, 4, 1])] == [2, 4, 1, 5]
    assert [r.token_id for r in accept_tokens(sampler, rows, [2, 3, 1])] == [2, 4]


def run_all(engine, prompts: list[str], opt_out: set[int] = frozenset(), length: int = 20) -> dict:
    eos = engine.engine_dir.model.eos_token_ids[0]
    ids = []
    for i, text in enumerate(prompts):
        sampling = SamplingParams(temperature=0.0, num_logprobs=1, max_generate_length=length,
                                  logit_bias={eos: -100.0}, speculative=i not in opt_out)
        ids.append(engine.add_request(EngineRequest(engine.tokenizer.encode(text), sampling)))
    finished = step_audited(engine)
    return {i: (finished[rid].token_ids, [s[0].token_id for s in finished[rid].logprobs]) for i, rid in enumerate(ids)}


@pytest.mark.parametrize("engine_fixture", ["tiny_engine_dir", "tiny_hybrid_engine_dir"])
@pytest.mark.parametrize("reuse", [False, True])
def test_prompt_lookup_changes_no_token_batched_with_plain_rows_and_under_preemption(
        request: pytest.FixtureRequest, engine_fixture: str, reuse: bool) -> None:
    engine_dir: Path = request.getfixturevalue(engine_fixture)
    plain = run_all(make_engine(engine_dir), PROMPTS)
    hybrid = engine_fixture == "tiny_hybrid_engine_dir"
    budgets = {"context_cache_recurrent_snapshot_pool_bytes": 1 << 22,
               "context_cache_partial_kv_snapshot_pool_bytes": 1 << 22} if hybrid and reuse else {}
    # 6 pages of 16 tokens: four growing requests cannot all run, so rows preempt each other.
    engine = make_engine(engine_dir, reuse=reuse, spec_decode="ngram", spec_draft_step=4, num_pages=6, **budgets)
    assert run_all(engine, PROMPTS, opt_out={1}) == plain
    spec = engine.profile()["spec_decode_generation"]
    assert spec["total_draft_tokens"] > 0 and spec["total_iterations"] > 0
    assert 1.0 <= spec["acceptance_length"] <= 5.0 and 0.0 <= spec["average_acceptance_rate"] <= 1.0
    assert engine.scheduler.stats.preemptions > 0
    assert any(stage["stage_id"] == "spec_decode_draft_proposal" for stage in engine.profile()["stages"])


def test_a_request_that_opts_out_never_drafts(tiny_engine_dir: Path) -> None:
    engine = make_engine(tiny_engine_dir, spec_decode="ngram")
    run_all(engine, PROMPTS, opt_out={0, 1, 2, 3})
    assert "spec_decode_generation" not in engine.profile()


@pytest.mark.parametrize(("setting", "value", "needle"), [
    ("spec_decode", "eagle9", "must be one of off, ngram"),
    ("spec_draft_step", 0, "must be in [1, 32]"),
    ("spec_prompt_lookup_min", 5, "specPromptLookupMax"),
])
def test_bad_speculative_settings_are_refused_naming_them(tiny_engine_dir: Path, setting: str, value: object,
                                                          needle: str) -> None:
    with pytest.raises(InvalidConfig) as error:
        make_engine(tiny_engine_dir, **{"spec_decode": "ngram", setting: value})
    assert error.value.field == setting and needle in str(error.value)


def test_speculation_on_a_pure_recurrent_engine_is_refused(tiny_mamba2_engine_dir: Path) -> None:
    with pytest.raises(InvalidConfig, match="pure recurrent") as error:
        make_engine(tiny_mamba2_engine_dir, spec_decode="ngram")
    assert error.value.field == "spec_decode"


def test_llm_inference_takes_spec_decode_and_refuses_a_bad_method(run_cli, tiny_engine_dir: Path,
                                                                 tmp_path: Path) -> None:
    request_file = write_spec_requests(tmp_path / "in.json", 24)
    args = ["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", request_file, "--numThreads", "2"]
    bad = run_cli([*args, "--outputFile", tmp_path / "bad.json", "--specDecode", "medusa"])
    assert_one_line_error(bad, "--specDecode", "must be one of off, ngram")
    plain = run_cli([*args, "--outputFile", tmp_path / "plain.json"])
    spec = run_cli([*args, "--outputFile", tmp_path / "spec.json", "--specDecode", "ngram", "--specDraftStep", "3",
                    "--profileOutputFile", tmp_path / "profile.json"])
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert answers(tmp_path / "plain.json") == answers(tmp_path / "spec.json")
    assert json.loads((tmp_path / "profile.json").read_text())["spec_decode_generation"]["total_iterations"] > 0
