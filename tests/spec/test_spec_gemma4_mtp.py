"""Gemma4-style MTP: the assistant graph against transformers' Gemma4AssistantForCausalLM over the K/V in the base's
pool, lossless runs (with reuse, preemption, abort, and guesses that are partly right), a hit that needs no draft
page, the mtp_generation profile block, and the support matrix's refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine_driver import make_engine, step_audited
from support.spec_checks import (
    assert_lossless_with_abort,
    assert_media_runs_cold,
    recording,
    run_all,
    sampling,
    with_oracle,
)

from kvforge.builder.build import build_engine
from kvforge.contract.engine_dir import (
    BASE_HIDDEN_INPUT,
    DRAFT_HIDDEN_INPUT,
    EMBEDDING_FILE,
    EMBEDDING_TENSOR,
    load_engine_dir,
)
from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.files import read_json, write_json
from kvforge.contract.safetensors_map import map_tensor
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.runtime.sequence import EngineRequest
from kvforge.tools.export.drafts.common import base_final_norm
from kvforge.tools.export.drafts.gemma4_assistant import export_gemma4_assistant, write_random_gemma4_assistant

PROMPTS = ["abc abc abc abc abc abc abc", "the cat sat on the mat, the cat sat on the", "x" * 30, "0123456789" * 3]
DOCUMENT = "a shared document: three full pages of sixteen bytes."  # 53 tokens (byte-level tokenizer)


def spec_engine(engines: dict[str, Path], centroids: bool = False, **config):
    if centroids:
        config.setdefault("spec_draft_engine_dir", str(engines["centroids"]))
    return make_engine(engines["base"], spec_decode="gemma4_mtp", **config)


@pytest.mark.parametrize("which", ["base", "centroids"])
def test_the_assistant_matches_transformers_over_the_bases_pool(tiny_gemma4_mtp_engines: dict[str, Path],
                                                               which: str) -> None:
    """A base prefill of 20 tokens (crossing a page) fills its pool; the assistant's logits and projected state at
    position 20 equal transformers' Gemma4AssistantForCausalLM given that pool's last-layer K/V as shared_kv_states
    (the HF checkpoint the export read), the base's normed hidden state and the next token's embedding."""
    torch = pytest.importorskip("torch", reason="torch (a test dependency) runs the transformers reference")
    transformers = pytest.importorskip("transformers", reason="transformers runs the reference assistant")
    engines = tiny_gemma4_mtp_engines
    base_dir = load_engine_dir(engines["base"])
    draft_dir = load_engine_dir(engines["base"] / "draft" if which == "base" else engines["centroids"])
    base = OrtBackend(base_dir, 2)
    table = np.asarray(map_tensor(base_dir.file(EMBEDDING_FILE), EMBEDDING_TENSOR), np.float32)
    tokens = np.random.default_rng(0).integers(0, base_dir.model.vocab_size, 21)
    C, pages = 20, [0, 1]
    out = base.forward(StepInputs(table[tokens[:C]][None], np.array([C], np.int32), np.array([0], np.int32),
                                  [pages]))
    weight, eps = base_final_norm(engines["base_onnx"], base_dir.model)
    raw = out.hidden_states[0]
    hidden = raw / np.sqrt(np.mean(raw * raw) + eps) * weight  # transformers' hidden_states[-1]
    shared = dict(zip(base_dir.model.attention_layer_ids, base.kv_store.layers, strict=True))
    assistant = OrtBackend(draft_dir, 2, shared_pools=shared)

    def call(base_hidden: np.ndarray, own_hidden: np.ndarray):
        return assistant.forward(StepInputs(table[tokens[C:]][None], np.array([1], np.int32), np.array([C], np.int32),
                                            [pages], extra_inputs={BASE_HIDDEN_INPUT: base_hidden[None, None],
                                                                   DRAFT_HIDDEN_INPUT: own_hidden[None, None]}))

    got = call(raw, np.zeros_like(raw))  # the round's first step: the base's raw state, normed in the graph
    # A later step's input (the assistant's own state) is used as it is: feeding the normed state there agrees.
    np.testing.assert_allclose(call(np.zeros_like(raw), hidden).logits, got.logits, rtol=1e-4, atol=1e-4)
    pool = base.kv_store.layers[-1].astype(np.float32)  # [pages, 2, Hkv, T, D]: the layer the assistant reads
    kv = np.concatenate([pool[p] for p in pages], axis=2)[:, :, :C]
    keys, values = torch.tensor(kv[0][None]), torch.tensor(kv[1][None])
    reference = transformers.Gemma4AssistantForCausalLM.from_pretrained(
        str(engines["hf" if which == "base" else "centroids_hf"])).eval()
    with torch.no_grad():
        expected = reference(inputs_embeds=torch.tensor(np.concatenate([table[tokens[C:]], hidden[None]], -1))[None],
                             position_ids=torch.tensor([[C]]), attention_mask=torch.ones(1, C + 1, dtype=torch.long),
                             shared_kv_states={"full_attention": (keys, values), "sliding_attention": (keys, values)})
    np.testing.assert_allclose(got.logits[0], expected.logits[0, -1].numpy(), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(got.hidden_states[0], expected.last_hidden_state[0, -1].numpy(), rtol=1e-3, atol=1e-3)
    assert draft_dir.kv_pool_bytes == 0  # it owns no pool


@pytest.mark.parametrize("centroids", [False, True])
@pytest.mark.parametrize("reuse", [False, True])
def test_gemma4_mtp_changes_no_token_with_plain_rows_and_under_preemption(tiny_gemma4_mtp_engines: dict[str, Path],
                                                                         centroids: bool, reuse: bool) -> None:
    plain = run_all(make_engine(tiny_gemma4_mtp_engines["base"]), PROMPTS)
    # 6 pages of 16 tokens: four growing requests cannot all run, so rows preempt each other.
    engine = spec_engine(tiny_gemma4_mtp_engines, centroids, reuse=reuse, num_pages=6)
    assert run_all(engine, PROMPTS, opt_out=frozenset({1})) == plain
    assert run_all(engine, PROMPTS) == plain  # again: warm when reuse is on
    profile = engine.profile()
    spec = profile["spec_decode_generation"]
    assert spec["total_draft_tokens"] > 0 and spec["total_iterations"] > 0
    assert profile["mtp_generation"] == spec  # TensorRT Edge-LLM's block for MTP drafters
    assert engine.scheduler.stats.preemptions > 0
    assert engine.cache.pools.draft_kv_pages.capacity == 0  # no draft pool at all
    stages = {stage["stage_id"] for stage in profile["stages"]}
    assert {"spec_decode_draft_proposal", "spec_decode_base_verification"} <= stages


@pytest.mark.parametrize("reuse", [False, True])
def test_accepted_guesses_are_lossless_and_the_next_round_starts_where_they_end(
        tiny_gemma4_mtp_engines: dict[str, Path], reuse: bool) -> None:
    plain = run_all(make_engine(tiny_gemma4_mtp_engines["base"]), PROMPTS, length=24)
    engine = spec_engine(tiny_gemma4_mtp_engines, reuse=reuse, num_pages=8)
    with_oracle(engine, PROMPTS, plain)
    assert run_all(engine, PROMPTS, length=24) == plain
    assert run_all(engine, PROMPTS, length=24) == plain
    spec = engine.profile()["spec_decode_generation"]
    # Rounds are proposed only where the kept state sits at the pending token: a state left at the wrong position
    # after a partly accepted round would propose nothing and keep acceptance near 1.
    assert spec["total_accepted_tokens"] > 0 and spec["acceptance_length"] > 1.5


def test_a_hit_needs_only_the_bases_pages_and_drafts_as_a_cold_run(tiny_gemma4_mtp_engines: dict[str, Path]) -> None:
    cold_engine = spec_engine(tiny_gemma4_mtp_engines)
    cold_drafts = recording(cold_engine)
    question = DOCUMENT + " why?"
    cold_engine.add_request(EngineRequest(cold_engine.tokenizer.encode(question), sampling(cold_engine)), "q")
    cold = step_audited(cold_engine)["q"]

    engine = spec_engine(tiny_gemma4_mtp_engines, reuse=True)
    drafts = recording(engine)
    engine.add_request(EngineRequest(engine.tokenizer.encode(DOCUMENT + " how?"), sampling(engine)), "first")
    step_audited(engine)
    engine.add_request(EngineRequest(engine.tokenizer.encode(question), sampling(engine)), "q")
    warm = step_audited(engine)["q"]
    assert (warm.token_ids, [s[0].token_id for s in warm.logprobs]) == \
        (cold.token_ids, [s[0].token_id for s in cold.logprobs])
    assert drafts.proposals["q"] == cold_drafts.proposals["q"]  # the assistant read the restored pages as computed
    cache = engine.profile()["context_cache"]
    assert cache["reused_tokens"] == 3 * engine.cache.tokens_per_page  # every shared page, none dropped
    assert cache["speculative"]["full_page_replays"] == 0
    assert cache["resource_pools"]["draft_kv_pages"]["capacity"] == 0


_word = st.sampled_from(["ab", "cab ", "the ", "x", "01", " "])


@given(prompts=st.lists(st.lists(_word, min_size=1, max_size=8).map("".join), min_size=1, max_size=4),
       centroids=st.booleans(), reuse=st.booleans(), pages=st.sampled_from([6, 8, 64]),
       opt_out=st.sets(st.integers(0, 3)), abort_at=st.integers(0, 12), length=st.integers(2, 24),
       step=st.sampled_from([1, 3, 6]))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_property_gemma4_mtp_is_lossless_under_preemption_and_abort(
        tiny_gemma4_mtp_engines: dict[str, Path], prompts: list[str], centroids: bool, reuse: bool, pages: int,
        opt_out: set[int], abort_at: int, length: int, step: int) -> None:
    engine = spec_engine(tiny_gemma4_mtp_engines, centroids, reuse=reuse, num_pages=pages, spec_draft_step=step)
    assert_lossless_with_abort(engine, make_engine(tiny_gemma4_mtp_engines["base"]), prompts, length, opt_out,
                               abort_at)


def test_standard_mtp_on_an_attention_only_base_is_refused(tiny_gemma4_mtp_engines: dict[str, Path]) -> None:
    with pytest.raises(InvalidConfig, match="rejects it on an attention-only base") as error:
        make_engine(tiny_gemma4_mtp_engines["base"], spec_decode="mtp")
    assert error.value.field == "spec_decode"
    with pytest.raises(InvalidConfig, match="not a Gemma4 MTP draft engine") as error:
        make_engine(tiny_gemma4_mtp_engines["base"], spec_decode="gemma4_mtp",
                    spec_draft_engine_dir=str(tiny_gemma4_mtp_engines["base"]))
    assert error.value.field == "spec_draft_engine_dir"


def test_export_and_build_refuse_what_they_cannot_run(tiny_gemma4_mtp_engines: dict[str, Path],
                                                      tmp_path: Path) -> None:
    base_onnx = tiny_gemma4_mtp_engines["base_onnx"]
    hf = write_random_gemma4_assistant(base_onnx, tmp_path / "hf", seed=1)
    config = read_json(hf / "config.json", "x")
    text = config["text_config"]
    for change, needle in [
        ({"text_config": {**text, "layer_types": ["sliding_attention", "full_attention"]}}, "sliding-attention"),
        ({"backbone_hidden_size": 32}, "backbone_hidden_size 32"),
        ({"text_config": {**text, "rope_parameters": {"full_attention": {"rope_type": "proportional",
                                                                         "rope_theta": 1e6}}}}, "RoPE"),
        ({"text_config": {**text, "hidden_size_per_layer_input": 8}}, "per-layer inputs"),
    ]:
        write_json(hf / "config.json", {**config, **change})
        with pytest.raises(KvforgeError, match=needle) as error:
            export_gemma4_assistant(hf, base_onnx, tmp_path / "refused")
        assert error.value.field == "--draftDir"
    write_json(hf / "config.json", config)
    from kvforge.builder.build import BuildOptions
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir
    write_onnx_dir(synthetic_model("tiny-llama", hidden_state_layers=[0]), tmp_path / "layer0_onnx")
    with pytest.raises(KvforgeError, match="--hiddenStateLayers 1"):
        export_gemma4_assistant(hf, tmp_path / "layer0_onnx", tmp_path / "refused")
    export_gemma4_assistant(hf, base_onnx, tmp_path / "onnx")
    options = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=4, tokens_per_page=16)
    with pytest.raises(InvalidConfig, match="--cpuAttention kernel") as error:
        build_engine(tmp_path / "onnx", tmp_path / "engine_ops", replace(options, spec_draft=True,
                                                                          cpu_attention="onnx"))
    assert error.value.field == "cpu_attention"
    build_engine(tmp_path / "onnx", tmp_path / "engine", replace(options, spec_draft=True, cpu_attention="kernel"))
    written = read_json(tmp_path / "engine" / "config.json", "x")
    assert (written["spec_decode_type"], written["engine_role"]) == ("gemma4_mtp", "draft")
    # The same assistant beside a base with another page size cannot read its pages.
    build_engine(tmp_path / "onnx", tmp_path / "engine_32", replace(options, spec_draft=True, cpu_attention="kernel",
                                                                    tokens_per_page=32))
    with pytest.raises(InvalidConfig, match="tokensPerPage 32") as error:
        make_engine(tiny_gemma4_mtp_engines["base"], spec_decode="gemma4_mtp",
                    spec_draft_engine_dir=str(tmp_path / "engine_32"))
    assert error.value.field == "spec_draft_engine_dir"


def test_kvforge_llm_takes_a_gemma4_assistant(tiny_gemma4_mtp_engines: dict[str, Path]) -> None:
    """The Python API drives the same loop: kvforge.LLM(spec_decode="gemma4_mtp") answers as the plain engine."""
    from kvforge import LLM
    from kvforge.runtime.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_generate_length=16, num_logprobs=1)
    plain = LLM(str(tiny_gemma4_mtp_engines["base"]), num_threads=2).generate(PROMPTS[:2], params)
    with LLM(str(tiny_gemma4_mtp_engines["base"]), num_threads=2, enable_context_reuse=True,
             spec_decode="gemma4_mtp") as llm:
        spec = llm.generate(PROMPTS[:2], params)
        assert llm.engine.profile()["mtp_generation"]["total_iterations"] > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_a_speculative_media_request_runs_cold_undrafted_and_counted(tiny_gemma4_mtp_engines: dict[str, Path]) -> None:
    assert_media_runs_cold(spec_engine(tiny_gemma4_mtp_engines, reuse=True), DOCUMENT)
