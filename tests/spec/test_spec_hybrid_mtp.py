"""MTP on a hybrid base (Qwen3.5's MTP layer): the draft graph against transformers' Qwen3.5 decoder layer, lossless
runs through the base's recurrent rollback (preemption, abort, partly right guesses), reuse bypassed and counted
for speculative requests, and the refusals of the support matrix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine_driver import make_engine
from support.spec_checks import assert_lossless_with_abort, assert_media_runs_cold, run_all, sampling, with_oracle

from kvforge.contract.engine_dir import (
    BASE_HIDDEN_INPUT,
    DRAFT_HIDDEN_INPUT,
    EMBEDDING_FILE,
    EMBEDDING_TENSOR,
    load_engine_dir,
)
from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.safetensors_map import map_tensor
from kvforge.runtime.context_cache.types.draft_paths import draft_computed_tokens, draft_page_ids, draft_tail
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.load import load_backend
from kvforge.runtime.sequence import EngineRequest
from kvforge.tools.export.drafts.common import base_final_norm, base_head
from kvforge.tools.export.drafts.qwen3_5_mtp import export_mtp, load_weights, write_random_mtp

PROMPTS = ["abc abc abc abc abc abc abc", "the cat sat on the mat, the cat sat on the", "x" * 30, "0123456789" * 3]


def mtp_engine(engines: dict[str, Path], **config):
    if config.get("reuse"):  # a hybrid engine reuses exact checkpoints: both snapshot pools
        config.setdefault("context_cache_recurrent_snapshot_pool_bytes", 10**7)
        config.setdefault("context_cache_partial_kv_snapshot_pool_bytes", 10**7)
    return make_engine(engines["base"], spec_decode="mtp", **config)


def test_the_mtp_graph_matches_transformers_qwen3_5_layers(tiny_hybrid_mtp_engines: dict[str, Path]) -> None:
    """21 positions in one call (crossing a page): logits and normed outputs equal a torch MTP module made of
    transformers' Qwen3_5RMSNorm (zero-centred), a Linear fc and a full-attention Qwen3_5DecoderLayer loaded with the
    checkpoint's mtp.* tensors, and the base-hidden input equals the draft-hidden input after the base's final norm."""
    torch = pytest.importorskip("torch", reason="torch (a test dependency) runs the transformers reference")
    transformers = pytest.importorskip("transformers", reason="transformers runs the reference layer")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    engines = tiny_hybrid_mtp_engines
    draft = load_engine_dir(engines["base"] / "draft")
    base = load_engine_dir(engines["base"]).model
    c = draft.model
    weights = load_weights(engines["hf"], c)
    head = base_head(engines["base_onnx"], base)
    table = np.asarray(map_tensor(engines["base"] / EMBEDDING_FILE, EMBEDDING_TENSOR), np.float32)
    rng = np.random.default_rng(0)
    n = 21
    tokens = rng.integers(0, c.vocab_size, n)
    hidden = rng.standard_normal((n, c.hidden_size)).astype(np.float32)
    backend = load_backend(draft, 2)

    def call(base_hidden: np.ndarray, own_hidden: np.ndarray):
        return backend.forward(StepInputs(table[tokens][None], np.array([n], np.int32), np.array([0], np.int32),
                                          [[0, 1]], logits_indices=np.arange(n),
                                          extra_inputs={BASE_HIDDEN_INPUT: base_hidden[None],
                                                        DRAFT_HIDDEN_INPUT: own_hidden[None]}))

    got = call(np.zeros_like(hidden), hidden)
    text = transformers.Qwen3_5TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=1, layer_types=["full_attention"], num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                         "partial_rotary_factor": c.partial_rotary_factor})
    layer = q35.Qwen3_5DecoderLayer(text, 0).eval()
    layer.load_state_dict({k.removeprefix("model.layers.0."): torch.tensor(v) for k, v in weights.items()
                           if k.startswith("model.layers.0.")})
    norms = {}
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        norms[name] = q35.Qwen3_5RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        norms[name].weight.data = torch.tensor(weights[name])
    rotary = q35.Qwen3_5TextRotaryEmbedding(text)
    with torch.no_grad():
        e, h = torch.tensor(table[tokens])[None], torch.tensor(hidden)[None]
        x = torch.cat([norms["mtp.pre_fc_norm_embedding.weight"](e), norms["mtp.pre_fc_norm_hidden.weight"](h)], -1)
        x = x @ torch.tensor(weights["mtp.fc.weight"]).T
        positions = torch.arange(n)[None]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=rotary(x, positions), attention_mask=causal, position_ids=positions)
        out = norms["mtp.norm.weight"](x)[0].numpy()
    np.testing.assert_allclose(got.hidden_states, out, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(got.logits, out @ head.T, rtol=1e-3, atol=1e-3)
    weight, eps = base_final_norm(engines["base_onnx"], base)
    normed = hidden / np.sqrt(np.mean(hidden * hidden, -1, keepdims=True) + eps) * weight
    np.testing.assert_allclose(call(hidden, np.zeros_like(hidden)).logits, call(np.zeros_like(hidden), normed).logits,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("reuse", [False, True])
def test_hybrid_mtp_changes_no_token_with_plain_rows_and_under_preemption(tiny_hybrid_mtp_engines: dict[str, Path],
                                                                         reuse: bool) -> None:
    plain = run_all(make_engine(tiny_hybrid_mtp_engines["base"]), PROMPTS)
    engine = mtp_engine(tiny_hybrid_mtp_engines, reuse=reuse, num_pages=6)
    assert run_all(engine, PROMPTS, opt_out=frozenset({1})) == plain
    assert run_all(engine, PROMPTS) == plain
    profile = engine.profile()
    spec = profile["spec_decode_generation"]
    assert spec["total_draft_tokens"] > 0 and spec["total_iterations"] > 0
    assert profile["mtp_generation"] == spec
    assert engine.scheduler.stats.preemptions > 0
    # Reuse with hybrid MTP is not built: its speculative requests compute cold, counted; the opted-out one reuses.
    assert spec["reuse_bypassed_requests"] == (7 if reuse else 0)


def test_partly_accepted_rows_roll_the_recurrent_state_back_and_stay_lossless(
        tiny_hybrid_mtp_engines: dict[str, Path]) -> None:
    plain = run_all(make_engine(tiny_hybrid_mtp_engines["base"]), PROMPTS, length=24)
    engine = mtp_engine(tiny_hybrid_mtp_engines, num_pages=8)
    assert engine.proposer.rolls_back  # type: ignore[union-attr]
    with_oracle(engine, PROMPTS, plain)
    assert run_all(engine, PROMPTS, length=24) == plain  # observe asserts the draft K/V never lags the base
    spec = engine.profile()["spec_decode_generation"]
    assert spec["total_accepted_tokens"] > 0 and spec["acceptance_length"] > 1.5


DOCUMENT = "a shared document: three full pages of sixteen bytes."  # 53 tokens (byte-level tokenizer)


@pytest.mark.parametrize("length", [53, 48])  # a checkpoint inside a page, and one ending on a page boundary
def test_a_checkpoint_hit_rebuilds_the_successor_boundary_and_drafts_as_a_cold_run(
        tiny_hybrid_mtp_engines: dict[str, Path], length: int) -> None:
    """The publisher's draft K/V at the checkpoint's last position read its own first output token; the hit's
    successor is a prompt token. The restore takes the record's draft pages below the last position's page and
    replays the rest from the stored hidden states: the hit drafts exactly as a cold run (keeping the publisher's
    K/V there would propose other tokens), and answers as one."""
    from support.engine_driver import step_audited
    from support.spec_checks import recording

    engines = tiny_hybrid_mtp_engines
    cold_engine = mtp_engine(engines)
    document = cold_engine.tokenizer.encode(DOCUMENT)[:length]
    question = document + cold_engine.tokenizer.encode(" why?")
    cold_drafts = recording(cold_engine)
    cold_engine.add_request(EngineRequest(question, sampling(cold_engine)), "q")
    cold = step_audited(cold_engine)["q"]

    engine = mtp_engine(engines, reuse=True, max_batch_size=1)
    drafts = recording(engine)
    engine.add_request(EngineRequest(document, sampling(engine)), "doc")
    first = step_audited(engine)["doc"]
    assert first.token_ids[0] != question[length]  # the successors differ, so a stale boundary would show
    engine.add_request(EngineRequest(question, sampling(engine)), "q")
    engine.step()  # admission: base restored at the checkpoint, draft behind it by its last page's positions
    T = engine.cache.tokens_per_page
    seq = engine.core.sequences["q"]
    assert seq.lease is not None and draft_computed_tokens(seq.lease) == len(question)  # replayed, then caught up
    warm = step_audited(engine)["q"]
    assert (warm.token_ids, [s[0].token_id for s in warm.logprobs]) == \
        (cold.token_ids, [s[0].token_id for s in cold.logprobs])
    assert drafts.proposals["q"] == cold_drafts.proposals["q"]
    profile = engine.profile()
    cache = profile["context_cache"]
    assert cache["reused_tokens"] == length  # the exact checkpoint
    record = next(r for r in engine.cache.records.least_recent_first() if len(r.token_ids) == length)
    assert draft_tail(record) is not None and draft_tail(record).start == (length - 1) // T * T
    assert len(draft_page_ids(record)) == length // T
    spec = profile["spec_decode_generation"]
    assert spec["prefill_state_only_requests"] == 2 and spec["reuse_bypassed_requests"] == 0
    # prefill_state_only: no decode-end checkpoint was published.
    assert all(len(r.token_ids) in (length, len(question)) for r in engine.cache.records.least_recent_first())


def test_a_checkpoint_a_plain_request_published_serves_speculative_requests_once_upgraded(
        tiny_hybrid_mtp_engines: dict[str, Path]) -> None:
    from support.engine_driver import step_audited

    engine = mtp_engine(tiny_hybrid_mtp_engines, reuse=True, max_batch_size=1)
    document = engine.tokenizer.encode(DOCUMENT)
    engine.add_request(EngineRequest(document, sampling(engine, 4, speculative=False)), "plain")
    step_audited(engine)
    record = next(iter(engine.cache.records.least_recent_first()))
    assert draft_tail(record) is None and not draft_page_ids(record)
    cold = engine.profile()["context_cache"]["reused_tokens"]
    engine.add_request(EngineRequest(document + engine.tokenizer.encode(" a"), sampling(engine, 4)), "a")
    step_audited(engine)  # the checkpoint has no draft tail: a speculative request computes cold
    assert engine.profile()["context_cache"]["reused_tokens"] == cold
    engine.add_request(EngineRequest(document, sampling(engine, 4)), "again")
    step_audited(engine)  # a speculative publication of the same endpoint gives the record its draft path and tail
    upgraded = engine.cache.records.get(record.record_id)
    assert upgraded is not None and draft_tail(upgraded) is not None
    engine.add_request(EngineRequest(document + engine.tokenizer.encode(" b"), sampling(engine, 4)), "b")
    step_audited(engine)
    assert engine.profile()["context_cache"]["reused_tokens"] == cold + len(document)


def test_hybrid_mtp_refuses_mid_prompt_checkpoints(tiny_hybrid_mtp_engines: dict[str, Path]) -> None:
    with pytest.raises(InvalidConfig, match="endpoint-only capture") as error:
        mtp_engine(tiny_hybrid_mtp_engines, reuse=True, snapshot_interval_tokens=16)
    assert error.value.field == "snapshot_interval_tokens"


_word = st.sampled_from(["ab", "cab ", "the ", "x", "01", " "])


@given(prompts=st.lists(st.lists(_word, min_size=1, max_size=8).map("".join), min_size=1, max_size=4),
       reuse=st.booleans(), pages=st.sampled_from([6, 8, 64]), opt_out=st.sets(st.integers(0, 3)),
       abort_at=st.integers(0, 12), length=st.integers(2, 24), step=st.sampled_from([1, 3, 6]),
       batch_of_one=st.booleans())
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_property_hybrid_mtp_is_lossless_under_preemption_and_abort(
        tiny_hybrid_mtp_engines: dict[str, Path], prompts: list[str], reuse: bool, pages: int, opt_out: set[int],
        abort_at: int, length: int, step: int, batch_of_one: bool) -> None:
    """With reuse and a batch of one, speculative requests hit each other's checkpoints (prompts share words)."""
    engine = mtp_engine(tiny_hybrid_mtp_engines, reuse=reuse, num_pages=pages, spec_draft_step=step,
                        max_batch_size=1 if batch_of_one else 0)
    assert_lossless_with_abort(engine, make_engine(tiny_hybrid_mtp_engines["base"]), prompts, length, opt_out,
                               abort_at)


def test_what_the_hybrid_row_refuses(tiny_hybrid_mtp_engines: dict[str, Path], tiny_engine_dir: Path,
                                     tmp_path: Path) -> None:
    for method in ("eagle3", "dflash", "gemma4_mtp"):  # the matrix rejects every other drafter on a hybrid base
        with pytest.raises(InvalidConfig, match="only hybrid MTP runs on a recurrent base") as error:
            make_engine(tiny_hybrid_mtp_engines["base"], spec_decode=method)
        assert error.value.field == "spec_decode"
    with pytest.raises(KvforgeError, match="attention-only base") as error:
        write_random_mtp(tiny_engine_dir, tmp_path / "x")  # an attention-only ONNX dir's config
    hf = write_random_mtp(tiny_hybrid_mtp_engines["base_onnx"], tmp_path / "hf", seed=1)
    (hf / "model.safetensors").unlink()
    from safetensors.numpy import save_file
    save_file({"mtp.fc.weight": np.zeros((2, 2), np.float32)}, str(hf / "model.safetensors"))
    with pytest.raises(KvforgeError, match="lacks tensor") as error:
        export_mtp(hf, tiny_hybrid_mtp_engines["base_onnx"], tmp_path / "onnx")
    assert error.value.field == "--draftDir"


def test_a_speculative_media_request_runs_cold_undrafted_and_counted(tiny_hybrid_mtp_engines: dict[str, Path]) -> None:
    assert_media_runs_cold(mtp_engine(tiny_hybrid_mtp_engines, reuse=True, max_batch_size=1), DOCUMENT)
