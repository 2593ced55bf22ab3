"""EAGLE3 speculative decoding: the draft graph against a dense reference, lossless engine runs, the draft pool with
its coherent paths and final-page replay, base-only records, and the support matrix's EAGLE3 rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine_driver import make_engine, step_audited
from support.numpy_llama import eagle3_dense
from support.ort_support import cpu_kernel_on
from support.sampling_checks import RUNS, first_two_tokens, second_token_ranking, total_variation
from support.spec_checks import recording, run_all, sampling, step_with_abort

from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, DRAFT_HIDDEN_INPUT, load_engine_dir
from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.context_cache.types.draft_paths import draft_computed_tokens, draft_page_ids
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.load import load_backend
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.spec.eagle3 import DraftState
from kvforge.tools.export.drafts.eagle3 import load_weights

PROMPTS = ["abc abc abc abc abc abc abc", "the cat sat on the mat, the cat sat on the", "x" * 30, "0123456789" * 3]
DOCUMENT = "a shared document: three full pages of sixteen bytes."  # 53 tokens (byte-level tokenizer)


def test_the_draft_graph_matches_a_dense_eagle3_reference(tiny_eagle3_engine_dir: Path) -> None:
    """A catch-up call over n positions fed base hidden states, then one drafting step fed the draft's own output:
    logits and hidden states equal the dense reference over the same n + 1 positions."""
    draft = load_engine_dir(tiny_eagle3_engine_dir / "draft")
    model = draft.model
    weights, _, _ = load_weights(tiny_eagle3_engine_dir.parent / "draft_hf", model)
    rng = np.random.default_rng(0)
    n, H, W = 21, model.hidden_size, model.base_model_hidden_size  # 21: the call crosses a page (16 tokens)
    embeds = rng.standard_normal((n + 1, H)).astype(np.float32)
    base = rng.standard_normal((n + 1, W)).astype(np.float32)
    base[n] = 0.0
    backend = load_backend(draft, 2)
    pages = list(range(2))
    first = backend.forward(StepInputs(embeds[None, :n], np.array([n], np.int32), np.array([0], np.int32), [pages],
                                       logits_indices=np.arange(n), extra_inputs={
                                           BASE_HIDDEN_INPUT: base[None, :n],
                                           DRAFT_HIDDEN_INPUT: np.zeros((1, n, H), np.float32)}))
    own = np.zeros((n + 1, H), np.float32)
    own[n] = first.hidden_states[-1]
    second = backend.forward(StepInputs(embeds[None, n:], np.array([1], np.int32), np.array([n], np.int32), [pages],
                                        extra_inputs={BASE_HIDDEN_INPUT: base[None, n:],
                                                      DRAFT_HIDDEN_INPUT: own[None, n:]}))
    logits, hidden = eagle3_dense(model, weights, embeds, base, own)
    np.testing.assert_allclose(first.logits, logits[:n], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(first.hidden_states, hidden[:n], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(second.logits[0], logits[n], rtol=2e-3, atol=2e-3)
    assert first.logits.shape[1] == model.draft_vocab_size == 48


@pytest.mark.parametrize("reuse", [False, True])
def test_eagle3_changes_no_token_batched_with_plain_rows_and_under_preemption(tiny_eagle3_engine_dir: Path,
                                                                             reuse: bool) -> None:
    plain = run_all(make_engine(tiny_eagle3_engine_dir), PROMPTS)
    # 6 pages of 16 tokens: four growing requests cannot all run, so rows preempt each other.
    engine = make_engine(tiny_eagle3_engine_dir, reuse=reuse, spec_decode="eagle3", spec_draft_step=3, num_pages=6)
    assert run_all(engine, PROMPTS, opt_out=frozenset({1})) == plain
    assert run_all(engine, PROMPTS) == plain  # again: warm, with replayed pages when reuse is on
    profile = engine.profile()
    spec = profile["spec_decode_generation"]
    assert spec["total_draft_tokens"] > 0 and spec["total_iterations"] > 0
    assert engine.scheduler.stats.preemptions > 0
    stages = {stage["stage_id"] for stage in profile["stages"]}
    assert {"spec_decode_draft_proposal", "spec_decode_base_verification", "spec_decode_draft_accept"} <= stages
    if reuse:
        assert profile["context_cache"]["speculative"]["pair_publications"] > 0
        assert profile["context_cache"]["speculative"]["full_page_replays"] > 0


def test_a_hit_replays_its_final_matched_page_and_drafts_as_a_cold_run(tiny_eagle3_engine_dir: Path) -> None:
    cold_engine = make_engine(tiny_eagle3_engine_dir, spec_decode="eagle3", spec_draft_step=3)
    cold_drafts = recording(cold_engine)
    question = DOCUMENT + " why?"
    cold_engine.add_request(EngineRequest(cold_engine.tokenizer.encode(question), sampling(cold_engine)), "q")
    cold = step_audited(cold_engine)["q"]

    engine = make_engine(tiny_eagle3_engine_dir, reuse=True, spec_decode="eagle3", spec_draft_step=3)
    drafts = recording(engine)
    engine.add_request(EngineRequest(engine.tokenizer.encode(DOCUMENT + " how?"), sampling(engine)), "first")
    step_audited(engine)
    engine.add_request(EngineRequest(engine.tokenizer.encode(question), sampling(engine)), "q")
    warm = step_audited(engine)["q"]
    assert warm.token_ids == cold.token_ids
    assert drafts.proposals["q"] == cold_drafts.proposals["q"]  # the reused draft path is coherent
    T = engine.cache.tokens_per_page
    shared = len(engine.tokenizer.encode(DOCUMENT + " how?"))
    matched = min(shared, len(engine.tokenizer.encode(question))) // T
    cache = engine.profile()["context_cache"]
    assert cache["speculative"]["full_page_replays"] == 1  # the second request hit
    # The shared document covers `matched` full pages; the hit reuses one page fewer (the replayed one).
    assert matched == 3 and cache["reused_tokens"] == (matched - 1) * T


def test_base_only_records_serve_plain_requests_never_speculative_ones(tiny_eagle3_engine_dir: Path) -> None:
    engine = make_engine(tiny_eagle3_engine_dir, reuse=True, spec_decode="eagle3", spec_draft_step=3)
    tokens = engine.tokenizer.encode(DOCUMENT + "one")

    def run(request_id: str, speculative: bool) -> int:
        engine.add_request(EngineRequest(list(tokens), sampling(engine, 4, speculative=speculative)), request_id)
        step_audited(engine)
        return engine.cache.metrics.reused_tokens

    before = run("plain", False)  # publishes base pages only (no draft ran)
    assert before == 0 and all(not draft_page_ids(r) for r in engine.cache.records.least_recent_first())
    spec = run("spec", True)
    assert spec == before, "a speculative request must not use a base-only record"
    assert any(draft_page_ids(r) for r in engine.cache.records.least_recent_first())  # published or upgraded a path
    plain_again = run("plain2", False)
    assert plain_again > spec  # plain requests use any record's base pages
    spec_again = run("spec2", True)
    assert spec_again > plain_again  # the path is there now
    assert engine.profile()["context_cache"]["speculative"]["pair_publications"] >= 1


def test_an_upgrade_gives_a_base_only_record_its_draft_path(tiny_eagle3_engine_dir: Path) -> None:
    """prefill_state_only: the prompt is published when the base finished it; the draft caught up in the same
    step, so the record carries a path; a plain request first leaves a base-only record, which a speculative
    publication of the same endpoint upgrades in place."""
    engine = make_engine(tiny_eagle3_engine_dir, reuse=True, spec_decode="eagle3", spec_draft_step=3)
    tokens = engine.tokenizer.encode(DOCUMENT)
    for request_id, speculative in (("plain", False), ("spec", True)):
        engine.add_request(EngineRequest(list(tokens), sampling(engine, 3, speculative=speculative,
                                                                 cache_generated_tokens=False)), request_id)
        step_audited(engine)
    records = list(engine.cache.records.least_recent_first())
    assert len(records) == 1 and len(draft_page_ids(records[0])) == len(tokens) // engine.cache.tokens_per_page
    assert engine.cache.profile()["speculative"]["pair_publications"] == 1


def test_a_proposal_needs_the_drafters_state_at_the_sequences_end(tiny_eagle3_engine_dir: Path) -> None:
    engine = make_engine(tiny_eagle3_engine_dir, spec_decode="eagle3", spec_draft_step=4)
    engine.add_request(EngineRequest(engine.tokenizer.encode("abc abc"), sampling(engine, 8)), "a")
    engine.step()
    [seq] = engine.scheduler.running
    state = engine.proposer.states.get(seq.request_id)
    assert isinstance(state, DraftState) and state.position == seq.num_computed_tokens
    assert len(seq.spec_token_ids) == 4 and draft_computed_tokens(seq.lease) == seq.num_computed_tokens
    state.position -= 1  # stale: what it drafted from is not the sequence's end any more
    assert engine.proposer.propose_batch([seq], [4]) == [[]]
    step_audited(engine)
    assert len(engine.proposer.states) == 0  # the request's end took its state (no Sequence field to outlive it)


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark", "jetspec"])
@pytest.mark.parametrize(("fixture", "needle"), [
    ("tiny_engine_dir", "not built as a speculative base"),
    ("tiny_hybrid_engine_dir", "hybrid EAGLE3, DFlash, JetSpec and DSpark"),
    ("tiny_mamba2_engine_dir", "pure recurrent"),
])
def test_a_draft_model_method_on_a_base_it_cannot_run_is_refused(request: pytest.FixtureRequest, fixture: str,
                                                                 needle: str, method: str) -> None:
    """The support matrix: EAGLE3 and block drafts need an attention-only speculative base."""
    with pytest.raises(InvalidConfig, match=needle) as error:
        make_engine(request.getfixturevalue(fixture), spec_decode=method)
    assert error.value.field == "spec_decode"


def test_a_missing_or_wrong_draft_engine_is_refused_naming_the_setting(tiny_eagle3_engine_dir: Path,
                                                                       tiny_engine_dir: Path, tmp_path: Path) -> None:
    for path, needle in ((tmp_path / "nowhere", "no draft engine"), (tiny_engine_dir, "not an EAGLE3 draft")):
        with pytest.raises(InvalidConfig, match=needle) as error:
            make_engine(tiny_eagle3_engine_dir, spec_decode="eagle3", spec_draft_engine_dir=str(path))
        assert error.value.field == "spec_draft_engine_dir"
    with pytest.raises(InvalidConfig, match="eagle3, dflash, dspark, jetspec or gemma4_mtp only") as error:
        make_engine(tiny_eagle3_engine_dir, spec_draft_engine_dir=str(tmp_path))
    assert error.value.field == "spec_draft_engine_dir"



class FixedProposer:
    """Proposes one given token for every sequence: a draft the base often samples, so rejection sampling is
    exercised at every step (random drafters propose tokens outside the top-k, which are always rejected)."""

    owns_kv = False

    def __init__(self, token: int) -> None:
        self.token = token

    def observe(self, rows, output, sampled) -> None:
        pass

    def propose_batch(self, seqs, limits):
        return [[self.token] if limit > 0 else [] for limit in limits]


def test_at_temperature_one_verification_keeps_the_base_distribution(tiny_engine_dir: Path) -> None:
    """600 seeded requests each, the first two sampled tokens (top-3: 9 outcomes), the second verified against a
    draft of the base's most likely second token: with rejection sampling the joint distribution matches plain
    sampling. Two independent 600-draw histograms over 9 cells differ by a total variation of about 0.065 on average
    (sd ~0.015); 0.14 is over four of those above it. A sampler accepting the draft twice as often as p(draft)
    moves about 0.2 of the mass."""
    plain = first_two_tokens(make_engine(tiny_engine_dir), 3)
    engine = make_engine(tiny_engine_dir, spec_decode="ngram")
    engine.core.proposer = FixedProposer(second_token_ranking(plain)[0])
    spec = first_two_tokens(engine, 3)
    profile = engine.profile()["spec_decode_generation"]
    assert profile["total_draft_tokens"] == RUNS and 0 < profile["total_accepted_tokens"] < RUNS
    distance = total_variation(plain, spec)
    assert distance < 0.14, (distance, plain, spec)


def test_a_speculative_request_with_media_runs_cold_and_is_counted(tiny_eagle3_engine_dir: Path) -> None:
    """The support matrix's bypassed row: no lookup, no publication, no drafts; the same media request without
    speculation is looked up as usual."""
    from kvforge.runtime.context_cache.keys import MediaKey
    from kvforge.runtime.media_spans import MediaSpan

    engine = make_engine(tiny_eagle3_engine_dir, reuse=True, spec_decode="eagle3", spec_draft_step=3)
    tokens = engine.tokenizer.encode(DOCUMENT)
    hidden = engine.engine_dir.model.hidden_size
    span = MediaSpan(MediaKey(2, 4, b"image-digest"), np.full((4, hidden), 0.1, dtype=np.float32))
    for request_id, speculative in (("spec", True), ("spec-again", True), ("plain", False)):
        engine.add_request(EngineRequest(list(tokens), sampling(engine, 6, speculative=speculative), media=(span,)),
                           request_id)
        step_audited(engine)
    profile = engine.profile()
    assert profile["spec_decode_generation"]["media_cold_requests"] == 2
    assert profile["spec_decode_generation"]["total_draft_tokens"] == 0
    cache = profile["context_cache"]
    assert cache["lookup_bypass_sequences"] == 2 and cache["reused_tokens"] == 0  # nothing was published to hit
    assert cache["publications"]["committed"] == 1  # the plain one only


_PLAIN: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
_word = st.sampled_from(["ab", "abc", "the cat", " ", "x", "0123"])


def _plain(engine_dir: Path, text: str, length: int) -> tuple[list[int], list[int]]:
    if (text, length) not in _PLAIN:
        _PLAIN[(text, length)] = run_all(make_engine(engine_dir), [text], length=length)[0]
    return _PLAIN[(text, length)]


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prompts=st.lists(st.lists(_word, min_size=1, max_size=8).map("".join), min_size=1, max_size=4),
       method=st.sampled_from(["ngram", "eagle3"]), draft_step=st.integers(1, 5), reuse=st.booleans(),
       pages=st.sampled_from([6, 8, 64]), opt_out=st.sets(st.integers(0, 3)), abort_at=st.integers(0, 12),
       length=st.integers(2, 24), top_k=st.sampled_from([1, 3]))
def test_property_speculation_is_lossless_under_preemption_and_abort(
        tiny_eagle3_engine_dir: Path, prompts: list[str], method: str, draft_step: int, reuse: bool, pages: int,
        opt_out: set[int], abort_at: int, length: int, top_k: int) -> None:
    """Any mix of requests, drafters (EAGLE3 chains and trees), draft lengths, pool sizes (preemption), opt-outs and
    one abort mid-run: every request that finishes has the tokens and top-1 ids of a plain run, and the cache audits
    clean after each step (the draft pool included) and holds nothing leaked at the end."""
    engine = make_engine(tiny_eagle3_engine_dir, reuse=reuse, spec_decode=method, spec_draft_step=draft_step,
                         num_pages=pages, spec_draft_top_k=top_k if method == "eagle3" and cpu_kernel_on() else 1)
    ids = [engine.add_request(EngineRequest(engine.tokenizer.encode(text),
                                            sampling(engine, length, speculative=i not in opt_out)))
           for i, text in enumerate(prompts)]
    finished, aborted = step_with_abort(engine, ids, abort_at)
    for i, rid in enumerate(ids):
        if rid == aborted and rid not in finished:
            continue
        out = finished[rid]
        assert (out.token_ids, [s[0].token_id for s in out.logprobs]) == _plain(tiny_eagle3_engine_dir, prompts[i],
                                                                                length)
