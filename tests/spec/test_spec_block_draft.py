"""Block drafts (DFlash, DSpark): the draft graph against a dense reference of the Hugging Face model, lossless runs
(with reuse, preemption, abort, and drafts that are partly right), hits that reuse every matched draft page without
replay, DSpark's schedulers, and the support matrix's refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine_driver import make_engine, step_audited
from support.numpy_llama import block_draft_dense
from support.spec_checks import assert_lossless_with_abort, recording, run_all, sampling, with_oracle

from kvforge.builder.build import build_engine
from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, CONTEXT_TOKEN_MASK_INPUT, load_engine_dir
from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.files import read_json, write_json
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.load import load_backend
from kvforge.runtime.execution.tree_attention import causal_masks, start_positions
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.spec.block_draft import DsparkHeads, schedule
from kvforge.runtime.spec.methods import SCHEDULER_OFF, SCHEDULER_SPS, SCHEDULER_THRESHOLD
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.drafts.block_draft import export_block_draft, load_weights, write_random_block_draft
from kvforge.tools.export.drafts.common import base_head

PROMPTS = ["abc abc abc abc abc abc abc", "the cat sat on the mat, the cat sat on the", "x" * 30, "0123456789" * 3]
DOCUMENT = "a shared document: three full pages of sixteen bytes."  # 53 tokens (byte-level tokenizer)


def spec_engine(engines: dict[str, Path], method: str, **config):
    if method == "dspark":
        config.setdefault("spec_draft_engine_dir", str(engines["dspark"]))
    return make_engine(engines["base"], spec_decode=method, **config)


def test_the_draft_graph_matches_a_dense_reference_of_the_hf_model(tiny_block_draft_engines: dict[str, Path]) -> None:
    """A context call over n positions (the base's hidden states), then a block call: the block's logits and normed
    hidden states equal the dense model over the same context and block, so K/V written by one call serve the
    next and the block sees itself both ways."""
    draft = load_engine_dir(tiny_block_draft_engines["base"] / "draft")
    model = draft.model
    weights, _ = load_weights(tiny_block_draft_engines["dflash_hf"], model)
    base = load_engine_dir(tiny_block_draft_engines["base"]).model
    head = base_head(tiny_block_draft_engines["base_onnx"], base)
    rng = np.random.default_rng(0)
    n, b, H, W = 21, 6, model.hidden_size, model.base_model_hidden_size  # 21: the context crosses a page (16)
    features = rng.standard_normal((n, W)).astype(np.float32)
    block = rng.standard_normal((b, H)).astype(np.float32)
    backend = load_backend(draft, 2)
    pages = [0, 1]

    def call(start: int, embeds: np.ndarray, feats: np.ndarray, context: int, outputs: np.ndarray):
        m = len(embeds)
        mask = causal_masks(1, m)
        mask[0, context:, :] = True
        ctx = np.zeros((1, m, 1), np.float32)
        ctx[0, :context] = 1.0
        return backend.forward(StepInputs(embeds[None], np.array([m], np.int32), np.array([start], np.int32), [pages],
                                          logits_indices=outputs, extra_inputs={BASE_HIDDEN_INPUT: feats[None],
                                                                                CONTEXT_TOKEN_MASK_INPUT: ctx},
                                          position_ids=start_positions(np.array([start]), m), attention_mask=mask))

    call(0, np.zeros((n, H), np.float32), features, n, np.array([n - 1]))
    out = call(n, block, np.zeros((b, W), np.float32), 0, np.arange(b))
    logits, hidden = block_draft_dense(model, weights, head, features, block)
    np.testing.assert_allclose(out.logits, logits, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(out.hidden_states, hidden, rtol=2e-3, atol=2e-3)
    # Non-causal: the first block position's output depends on the last one.
    changed = block.copy()
    changed[-1] += 1.0
    call(0, np.zeros((n, H), np.float32), features, n, np.array([n - 1]))
    assert not np.allclose(call(n, changed, np.zeros((b, W), np.float32), 0, np.arange(b)).logits[0], out.logits[0])


@pytest.mark.parametrize("method", ["dflash", "dspark"])
@pytest.mark.parametrize("reuse", [False, True])
def test_block_drafts_change_no_token_with_plain_rows_and_under_preemption(tiny_block_draft_engines: dict[str, Path],
                                                                          method: str, reuse: bool) -> None:
    plain = run_all(make_engine(tiny_block_draft_engines["base"]), PROMPTS)
    # 6 pages of 16 tokens: four growing requests cannot all run, so rows preempt each other.
    engine = spec_engine(tiny_block_draft_engines, method, reuse=reuse, num_pages=6)
    assert run_all(engine, PROMPTS, opt_out=frozenset({1})) == plain
    assert run_all(engine, PROMPTS) == plain  # again: warm when reuse is on
    profile = engine.profile()
    spec = profile["spec_decode_generation"]
    assert spec["total_draft_tokens"] > 0 and spec["total_iterations"] > 0
    assert engine.scheduler.stats.preemptions > 0
    stages = {stage["stage_id"] for stage in profile["stages"]}
    assert {"spec_decode_draft_proposal", "block_diffusion_denoise", "spec_decode_base_verification"} <= stages
    if reuse:
        assert profile["context_cache"]["speculative"]["pair_publications"] > 0
        assert profile["context_cache"]["speculative"]["full_page_replays"] == 0  # block drafts never replay


@pytest.mark.parametrize("reuse", [False, True])
def test_accepted_blocks_are_lossless_and_keep_the_draft_coherent(tiny_block_draft_engines: dict[str, Path],
                                                                  reuse: bool) -> None:
    plain = run_all(make_engine(tiny_block_draft_engines["base"]), PROMPTS, length=24)
    engine = spec_engine(tiny_block_draft_engines, "dflash", reuse=reuse, num_pages=8)
    with_oracle(engine, PROMPTS, plain)
    assert run_all(engine, PROMPTS, length=24) == plain  # observe asserts the draft K/V never lags the base
    assert run_all(engine, PROMPTS, length=24) == plain
    spec = engine.profile()["spec_decode_generation"]
    assert spec["total_accepted_tokens"] > 0 and spec["acceptance_length"] > 1.5


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_hit_reuses_every_matched_page_without_replay_and_drafts_as_a_cold_run(
        tiny_block_draft_engines: dict[str, Path], method: str) -> None:
    cold_engine = spec_engine(tiny_block_draft_engines, method)
    cold_drafts = recording(cold_engine)
    question = DOCUMENT + " why?"
    cold_engine.add_request(EngineRequest(cold_engine.tokenizer.encode(question), sampling(cold_engine)), "q")
    cold = step_audited(cold_engine)["q"]

    engine = spec_engine(tiny_block_draft_engines, method, reuse=True)
    drafts = recording(engine)
    engine.add_request(EngineRequest(engine.tokenizer.encode(DOCUMENT + " how?"), sampling(engine)), "first")
    step_audited(engine)
    draft_free = engine.cache.pools.draft_kv_pages.num_free
    engine.add_request(EngineRequest(engine.tokenizer.encode(question), sampling(engine)), "q")
    warm = step_audited(engine)["q"]
    assert (warm.token_ids, [s[0].token_id for s in warm.logprobs]) == \
        (cold.token_ids, [s[0].token_id for s in cold.logprobs])
    assert drafts.proposals["q"] == cold_drafts.proposals["q"]  # the restored draft pages are the cold run's K/V
    T = engine.cache.tokens_per_page
    cache = engine.profile()["context_cache"]
    assert cache["speculative"]["full_page_replays"] == 0
    assert cache["reused_tokens"] == 3 * T  # all three shared pages, none dropped (EAGLE3 reuses two)
    assert engine.cache.pools.draft_kv_pages.num_free <= draft_free  # the hit's draft pages stayed cached


def test_the_dspark_scheduler_proposes_the_prefix_its_scores_support() -> None:
    heads = DsparkHeads(np.zeros((4, 2)), np.zeros((4, 2)), np.zeros(3), 0.0)
    scores = np.array([0.9, 0.8, 0.5, 0.9])  # running products 0.9, 0.72, 0.36, 0.324
    assert schedule(scores, heads) == 4
    assert schedule(scores, replace(heads, scheduler=SCHEDULER_THRESHOLD, threshold=0.7)) == 2
    assert schedule(scores, replace(heads, scheduler=SCHEDULER_THRESHOLD, threshold=0.95)) == 1  # min length 1
    assert schedule(scores, replace(heads, scheduler=SCHEDULER_THRESHOLD, threshold=0.95, min_len=3)) == 3
    assert schedule(scores, replace(heads, scheduler=SCHEDULER_OFF, max_len=2)) == 2
    # sps, cost(L) = 1 + 0.9 + 0.13 L past L = 0: running products 0.9, 0.27, 0.054, 0.049 give (1 + their sum) /
    # cost(L) = 1, 0.94, 1.005, 0.97, 0.94 for L = 0..4: two tokens.
    assert schedule(np.array([0.9, 0.3, 0.2, 0.9]), replace(heads, scheduler=SCHEDULER_SPS)) == 2
    assert schedule(np.array([0.99] * 4), replace(heads, scheduler=SCHEDULER_SPS)) == 4
    # Guesses not worth a verify call: none, but the minimum length.
    assert schedule(np.array([0.3, 0.1]), replace(heads, scheduler=SCHEDULER_SPS)) == 1
    assert schedule(np.array([0.3, 0.1]), replace(heads, scheduler=SCHEDULER_SPS, min_len=0)) == 0


@pytest.mark.parametrize("scheduler", [SCHEDULER_THRESHOLD, SCHEDULER_SPS])
def test_dspark_schedulers_shorten_proposals_and_change_no_token(tiny_block_draft_engines: dict[str, Path],
                                                                 scheduler: str) -> None:
    plain = run_all(make_engine(tiny_block_draft_engines["base"]), PROMPTS[:2])
    full = spec_engine(tiny_block_draft_engines, "dspark")
    assert run_all(full, PROMPTS[:2]) == plain
    scheduled = spec_engine(tiny_block_draft_engines, "dspark", dspark_scheduler=scheduler,
                            dspark_confidence_threshold=0.5, dspark_max_proposal_len=3)
    assert run_all(scheduled, PROMPTS[:2]) == plain
    per_row = [p["spec_decode_generation"]["total_draft_tokens"] / p["spec_decode_generation"]["total_iterations"]
               for p in (full.profile(), scheduled.profile())]
    assert per_row[1] < per_row[0] and per_row[1] <= 3


def test_a_smaller_block_proposes_fewer_tokens(tiny_block_draft_engines: dict[str, Path]) -> None:
    engine = spec_engine(tiny_block_draft_engines, "dflash", dflash_block_size=3)
    drafts = recording(engine)
    assert run_all(engine, PROMPTS[:1]) == run_all(make_engine(tiny_block_draft_engines["base"]), PROMPTS[:1])
    assert max(len(p) for ps in drafts.proposals.values() for p in ps) == 2


@pytest.mark.parametrize(("config", "field", "needle"), [
    ({"spec_decode": "dflash", "dflash_block_size": 9}, "dflash_block_size", r"\[2, 6\]"),
    ({"spec_decode": "ngram", "dflash_block_size": 4}, "dflash_block_size", "dflash or dspark"),
    ({"spec_decode": "dflash", "dspark_scheduler": "sps"}, "dspark_scheduler", "--specDecode dspark"),
    ({"spec_decode": "dflash", "dspark_min_proposal_len": 2}, "dspark_min_proposal_len", "--specDecode dspark"),
    ({"spec_decode": "dflash", "dspark_scheduler": "always"}, "dspark_scheduler", "one of"),
    ({"spec_decode": "dflash", "dspark_confidence_threshold": 1.5}, "dspark_confidence_threshold", r"\[0, 1\]"),
    ({"spec_decode": "dspark"}, "spec_draft_engine_dir", "not a DSpark draft engine; it holds a dflash draft"),
    ({"spec_decode": "eagle3"}, "spec_draft_engine_dir", "not an EAGLE3 draft engine; .* --specDecode dflash"),
])
def test_bad_block_draft_settings_are_refused_naming_the_field(tiny_block_draft_engines: dict[str, Path],
                                                               config: dict, field: str, needle: str) -> None:
    with pytest.raises(InvalidConfig, match=needle) as error:
        make_engine(tiny_block_draft_engines["base"], **config)
    assert error.value.field == field


def test_export_and_build_refuse_what_they_cannot_run(tiny_block_draft_engines: dict[str, Path],
                                                      tmp_path: Path) -> None:
    base_onnx = tiny_block_draft_engines["base_onnx"]
    hf = write_random_block_draft(base_onnx, tmp_path / "hf", seed=1, layers=[1])
    with pytest.raises(KvforgeError, match="re-export the base with --hiddenStateLayers 1"):
        export_block_draft(hf, base_onnx, tmp_path / "onnx_layers")
    hf = write_random_block_draft(base_onnx, tmp_path / "hf2", seed=1)
    config = read_json(hf / "config.json", "x")
    write_json(hf / "config.json", {**config, "final_logit_softcapping": 30.0})
    with pytest.raises(KvforgeError, match="final_logit_softcapping") as error:
        export_block_draft(hf, base_onnx, tmp_path / "onnx_softcap")
    assert error.value.field == "--draftDir"
    write_json(hf / "config.json", {**config, "dflash_config": {"target_layer_ids": [0, 1]}})
    with pytest.raises(KvforgeError, match="mask_token_id"):
        export_block_draft(hf, base_onnx, tmp_path / "onnx_mask")
    write_json(hf / "config.json", config)
    export_block_draft(hf, base_onnx, tmp_path / "onnx")
    from kvforge.builder.build import BuildOptions
    options = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=4, tokens_per_page=16)
    with pytest.raises(InvalidConfig, match="--specDraft") as error:
        build_engine(tmp_path / "onnx", tmp_path / "engine_plain", options)
    with pytest.raises(InvalidConfig, match="--cpuAttention kernel") as error:
        build_engine(tmp_path / "onnx", tmp_path / "engine_ops",
                     replace(options, spec_draft=True, cpu_attention="onnx"))
    assert error.value.field == "cpu_attention"
    build_engine(tmp_path / "onnx", tmp_path / "engine",
                 replace(options, spec_draft=True, cpu_attention="kernel"))
    written = read_json(tmp_path / "engine" / "config.json", "x")
    assert (written["spec_decode_type"], written["engine_role"]) == ("dflash", "draft")
    assert read_json(tiny_block_draft_engines["base"] / "config.json", "x")["engine_role"] == "base"


_word = st.sampled_from(["ab", "cab ", "the ", "x", "01", " "])


@given(prompts=st.lists(st.lists(_word, min_size=1, max_size=8).map("".join), min_size=1, max_size=4),
       method=st.sampled_from(["dflash", "dspark"]), reuse=st.booleans(), pages=st.sampled_from([6, 8, 64]),
       opt_out=st.sets(st.integers(0, 3)), abort_at=st.integers(0, 12), length=st.integers(2, 24),
       block=st.sampled_from([0, 2, 4]))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_property_block_drafting_is_lossless_under_preemption_and_abort(
        tiny_block_draft_engines: dict[str, Path], prompts: list[str], method: str, reuse: bool, pages: int,
        opt_out: set[int], abort_at: int, length: int, block: int) -> None:
    engine = spec_engine(tiny_block_draft_engines, method, reuse=reuse, num_pages=pages, dflash_block_size=block)
    assert_lossless_with_abort(engine, make_engine(tiny_block_draft_engines["base"]), prompts, length, opt_out,
                               abort_at)


def test_kvforge_llm_takes_a_block_draft(tiny_block_draft_engines: dict[str, Path]) -> None:
    """The Python API drives the same loop: kvforge.LLM(spec_decode="dspark", ...) answers as the plain engine."""
    from kvforge import LLM

    params = SamplingParams(temperature=0.0, max_generate_length=16, num_logprobs=1)
    plain = LLM(str(tiny_block_draft_engines["base"]), num_threads=2).generate(PROMPTS[:2], params)
    with LLM(str(tiny_block_draft_engines["base"]), num_threads=2, enable_context_reuse=True, spec_decode="dspark",
             spec_draft_engine_dir=str(tiny_block_draft_engines["dspark"]), dspark_scheduler="sps") as llm:
        spec = llm.generate(PROMPTS[:2], params)
        assert llm.engine.profile()["spec_decode_generation"]["total_iterations"] > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
