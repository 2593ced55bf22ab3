"""The runtime loop on a synthetic engine: batching, paging, stopping and parity with the dense reference."""

from __future__ import annotations

import numpy as np
import pytest
from support.engine_driver import make_engine, run_file
from support.numpy_llama import dense_logits

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.sequence import FinishReason
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

pytestmark = pytest.mark.attention_path  # assertions that depend on the attention lowering: run again on the fallback

PROMPTS = ["hi", "The quick brown fox jumps over the lazy dog.", "abc " * 9, "x"]


@pytest.fixture(scope="module")
def model_and_engine(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("runtime")
    loaded = synthetic_model("tiny-llama", kv_cache_dtype="fp32")
    write_onnx_dir(loaded, root / "onnx")
    build_engine(root / "onnx", root / "engine", BuildOptions(max_input_len=64, max_kv_cache_capacity=96,
                                                              max_batch_size=4, tokens_per_page=8))
    return loaded, root / "engine"


FINISH_EOS, FINISH_LENGTH, FINISH_STOP = FinishReason.EOS.value, FinishReason.LENGTH.value, FinishReason.STOP.value


@pytest.fixture(scope="module")
def runtime(model_and_engine) -> Engine:
    return make_engine(model_and_engine[1])


def data_for(prompts: list[str], batch_size: int, **sampling) -> dict:
    return {"batch_size": batch_size, "temperature": 0.0, "top_k": 1, "max_generate_length": 12,
            "apply_chat_template": False, "num_logprobs": 2, **sampling,
            "requests": [{"messages": [{"role": "user", "content": p}]} for p in prompts]}


def run(runtime: Engine, prompts: list[str], batch_size: int, **sampling) -> list[dict]:
    out = run_file(runtime, data_for(prompts, batch_size, **sampling))
    assert runtime.cache.pages.num_free == runtime.cache.pages.capacity  # every page came back
    return out


def test_ragged_batch_equals_each_prompt_alone(runtime: Engine) -> None:
    together = run(runtime, PROMPTS, batch_size=4)
    alone = run(runtime, PROMPTS, batch_size=1)
    for a, b in zip(together, alone, strict=True):
        assert a["output_text"] == b["output_text"]
        assert [[e["token_id"] for e in step] for step in a["logprobs"]] == \
               [[e["token_id"] for e in step] for step in b["logprobs"]]
        np.testing.assert_allclose([s[0]["logprob"] for s in a["logprobs"]], [s[0]["logprob"] for s in b["logprobs"]],
                                   atol=1e-4)
    assert [r["request_idx"] for r in together] == [0, 1, 2, 3]
    assert [r["batch_idx"] for r in alone] == [0, 1, 2, 3]


def test_greedy_tokens_match_dense_reference(runtime: Engine, model_and_engine) -> None:
    """Each generated token is the argmax of a full recompute of the prompt plus the tokens before it."""
    loaded = model_and_engine[0]
    response = run(runtime, [PROMPTS[1]], batch_size=1, max_generate_length=10)[0]
    ids = runtime.tokenizer.encode(PROMPTS[1])
    generated = [step[0]["token_id"] for step in response["logprobs"]]
    logits = dense_logits(loaded.config, loaded.weights, ids + generated)
    expected = [int(np.argmax(logits[len(ids) - 1 + i])) for i in range(len(generated))]
    assert generated == expected
    top_logprob = logits[len(ids) - 1] - np.log(np.exp(logits[len(ids) - 1] - logits[len(ids) - 1].max()).sum()) \
        - logits[len(ids) - 1].max()
    assert response["logprobs"][0][0]["logprob"] == pytest.approx(float(top_logprob.max()), abs=1e-4)


def test_finish_reasons_and_usage(runtime: Engine) -> None:
    response = run(runtime, [PROMPTS[0]], batch_size=1, max_generate_length=5)[0]
    assert response["usage"] == {"prompt_tokens": 2, "completion_tokens": len(response["logprobs"]), "cached_tokens": 0}
    assert response["finish_reason"] in (FINISH_LENGTH, FINISH_EOS)
    if response["finish_reason"] == FINISH_LENGTH:
        assert response["usage"]["completion_tokens"] == 5
    # Pin the stop string to text the model is known to produce: the tail of an unconstrained run.
    full = run(runtime, [PROMPTS[2]], batch_size=1, max_generate_length=12)[0]["output_text"]
    assert len(full) >= 4, full
    stop = full[2:4]
    stopped = run(runtime, [PROMPTS[2]], batch_size=1, max_generate_length=12, stop=[stop])[0]
    assert stopped["finish_reason"] == FINISH_STOP
    assert stopped["output_text"] == full[:full.find(stop)]


def test_logit_bias_forces_eos(runtime: Engine) -> None:
    eos = runtime.engine_dir.model.eos_token_ids[0]
    response = run(runtime, [PROMPTS[1]], batch_size=1, logit_bias={str(eos): 100})[0]
    assert response["finish_reason"] == FINISH_EOS
    assert response["output_text"] == ""
    assert response["usage"]["completion_tokens"] == 1


def test_generation_stops_at_kv_capacity(runtime: Engine) -> None:
    """capacity 96: a 40-token prompt can feed 56 more tokens, so at most 57 are generated."""
    prompt = "abcd" * 10
    response = run(runtime, [prompt], batch_size=1, max_generate_length=200,
                   logit_bias={str(runtime.engine_dir.model.eos_token_ids[0]): -100})[0]
    assert response["finish_reason"] == FINISH_LENGTH
    assert response["usage"]["completion_tokens"] == 96 - 40 + 1


def test_profile_counts_tokens(model_and_engine) -> None:
    runtime = make_engine(model_and_engine[1])
    run_file(runtime, {"temperature": 0.0, "max_generate_length": 4, "apply_chat_template": False,
                       "requests": [{"messages": [{"role": "user", "content": "hello"}]}]})
    profile = runtime.profile()
    assert profile["prefill"]["computed_tokens"] == 5
    assert profile["prefill"]["reused_tokens"] == 0
    stages = {s["stage_id"]: s for s in profile["stages"]}
    assert stages["llm_prefill"]["total_runs"] == 1
    assert stages["llm_generation"]["total_runs"] == profile["generation"]["generated_tokens"]



def test_chunked_prefill_matches_one_call(model_and_engine) -> None:
    """Prefill in 8-token chunks (rows of different lengths drop out as they finish) equals one call."""
    whole = make_engine(model_and_engine[1], prefill_chunk_size=0)
    chunked = make_engine(model_and_engine[1], whole.backend, prefill_chunk_size=8)
    for a, b in zip(run(whole, PROMPTS, batch_size=4), run(chunked, PROMPTS, batch_size=4), strict=True):
        assert (a["output_text"], [s[0]["token_id"] for s in a["logprobs"]]) == \
               (b["output_text"], [s[0]["token_id"] for s in b["logprobs"]])
    fresh = make_engine(model_and_engine[1], whole.backend, prefill_chunk_size=8)
    run_file(fresh, {"temperature": 0.0, "max_generate_length": 1, "apply_chat_template": False,
                     "requests": [{"messages": [{"role": "user", "content": "x" * 20}]}]})
    profile = fresh.profile()
    assert profile["prefill"]["computed_tokens"] == 20 and profile["prefill"]["total_runs"] == 3  # 8 + 8 + 4
    assert {s["stage_id"]: s["total_runs"] for s in profile["stages"]}["llm_prefill"] == 3
    with pytest.raises(KvforgeError) as info:
        make_engine(model_and_engine[1], prefill_chunk_size=-1)
    assert info.value.field == "prefill_chunk_size"


def test_the_key_chain_is_rooted_in_the_engine_fingerprint(tiny_engine_dir, tiny_onnx_dir, tmp_path) -> None:
    """Engines with other weights or another page size never share page keys; one engine always roots the same."""
    from dataclasses import replace

    from conftest import TINY_BUILD

    from kvforge.contract.engine_dir import load_engine_dir
    from kvforge.runtime.context_cache.keys import CHAIN_ROOT, KeyExtras, page_keys
    from kvforge.runtime.engine.config import EngineConfig, resolve_engine_config

    def root(path) -> bytes:
        return resolve_engine_config(EngineConfig(), load_engine_dir(path)).chain_root

    other_weights = tmp_path / "onnx"
    write_onnx_dir(synthetic_model("tiny-llama", seed=1), other_weights)
    build_engine(other_weights, tmp_path / "weights", TINY_BUILD)
    build_engine(tiny_onnx_dir, tmp_path / "pages", replace(TINY_BUILD, tokens_per_page=32))
    roots = [root(tiny_engine_dir), root(tiny_engine_dir), root(tmp_path / "weights"), root(tmp_path / "pages")]
    assert roots[0] == roots[1] and len(set(roots)) == 3 and CHAIN_ROOT not in roots
    engine = make_engine(tiny_engine_dir, reuse=True)
    run_file(engine, {"requests": [{"messages": [{"role": "user", "content": "a" * 40}]}], "temperature": 0,
                      "max_generate_length": 2, "apply_chat_template": False})
    [record, *_] = engine.cache.records.least_recent_first()
    tokens = list(record.token_ids)
    assert list(record.keys) == page_keys(tokens, 16, KeyExtras(), parent=roots[0])
    assert list(record.keys) != page_keys(tokens, 16, KeyExtras())
