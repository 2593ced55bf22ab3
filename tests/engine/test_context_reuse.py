"""Context reuse end to end on a synthetic engine: reuse never changes an answer, isolation, policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine_driver import make_engine, run_file, top1_ids

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.runtime.inputs.request_file import parse_request_file
from kvforge.runtime.types import CommitPolicy, LookupPolicy
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

pytestmark = pytest.mark.attention_path  # assertions that depend on the attention lowering: run again on the fallback

ROOT = Path(__file__).resolve().parents[2]
T = 16


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reuse")
    write_onnx_dir(synthetic_model("tiny-llama", kv_cache_dtype="fp16"), root / "onnx")
    build_engine(root / "onnx", root / "engine", BuildOptions(max_input_len=3072, max_kv_cache_capacity=3200,
                                                              max_batch_size=2, tokens_per_page=T))
    return root / "engine"


@pytest.fixture(scope="module")
def runner(engine_dir: Path) -> OrtBackend:
    return OrtBackend(load_engine_dir(engine_dir), num_threads=2)


@pytest.fixture(scope="module")
def cold_runner(engine_dir: Path) -> OrtBackend:
    """Cold references run on their own pool: sharing one would overwrite pages the warm cache holds."""
    return OrtBackend(load_engine_dir(engine_dir), num_threads=2)


BYPASS, USE_CACHE = LookupPolicy.BYPASS.value, LookupPolicy.USE_CACHE.value
INCLUDING_GENERATED_TOKENS = CommitPolicy.INCLUDING_GENERATED_TOKENS.value
PREFILL_STATE_ONLY = CommitPolicy.PREFILL_STATE_ONLY.value


def make_runtime(engine_dir: Path, runner: OrtBackend, reuse: bool = True, max_records: int = 1024,
                 num_pages: int | None = None) -> Engine:
    return make_engine(engine_dir, runner, reuse=reuse, context_cache_max_records=max_records, num_pages=num_pages)


def test_context_reuse_case_matches_cold(engine_dir: Path, runner: OrtBackend,
                                        cold_runner: OrtBackend) -> None:
    data = json.loads((ROOT / "test_cases" / "llm_context_reuse.json").read_text())
    data["max_generate_length"] = 6
    warm_runtime = make_runtime(engine_dir, runner)
    warm = run_file(warm_runtime, data)
    cold = run_file(make_runtime(engine_dir, cold_runner, reuse=False), data)
    for key in ("output_text", "finish_reason"):
        assert warm[0][key] == warm[2][key]
    assert top1_ids(warm[0]) == top1_ids(warm[2])
    for w, c in zip(warm, cold, strict=True):
        assert (w["output_text"], top1_ids(w)) == (c["output_text"], top1_ids(c))
    profile = warm_runtime.profile()
    assert profile["prefill"]["reused_tokens"] > 0
    assert warm[0]["usage"]["cached_tokens"] == 0
    prefix_pages = warm[1]["usage"]["prompt_tokens"] // T
    assert warm[1]["usage"]["cached_tokens"] == (prefix_pages - 1) * T or warm[1]["usage"]["cached_tokens"] > 0
    assert warm[2]["usage"]["cached_tokens"] == warm[2]["usage"]["prompt_tokens"] // T * T
    assert profile["context_cache"]["hit_sequences"] == 2


def chat(history: list[tuple[str, str]], logit_bias: dict[str, float]) -> dict:
    return {"temperature": 0.0, "max_generate_length": 40, "num_logprobs": 1, "logit_bias": logit_bias,
            "requests": [{"messages": [{"role": r, "content": c} for r, c in history]}]}


def test_multiturn_reuses_generated_tokens(engine_dir: Path, runner: OrtBackend,
                                          cold_runner: OrtBackend) -> None:
    warm_runtime = make_runtime(engine_dir, runner)
    cold_runtime = make_runtime(engine_dir, cold_runner, reuse=False)
    history = [("system", "You answer briefly."), ("user", "Tell me a story about a lighthouse keeper.")]
    previous_prompt_tokens = 0
    # Random weights emit arbitrary bytes; steer them to ASCII letters so the answer text re-tokenizes
    # to the same ids when it comes back as the assistant turn (as real chat output does).
    letters = {str(runtime_id): 40.0 for runtime_id in warm_runtime.tokenizer.encode("abcdefghijklmnop qrstuvwxyz")}
    for turn in range(3):
        warm = run_file(warm_runtime, chat(history, letters))[0]
        cold = run_file(cold_runtime, chat(history, letters))[0]
        assert (warm["output_text"], top1_ids(warm)) == (cold["output_text"], top1_ids(cold))
        if turn:
            # The previous turn's prompt and generated pages are reused, not just its prompt.
            assert warm["usage"]["cached_tokens"] > previous_prompt_tokens
        previous_prompt_tokens = warm["usage"]["prompt_tokens"]
        history += [("assistant", warm["output_text"]), ("user", f"And then what happened on day {turn + 2}?")]


def test_salt_isolation(engine_dir: Path, runner: OrtBackend) -> None:
    runtime = make_runtime(engine_dir, runner)
    prompt = [{"role": "user", "content": "shared context " * 8}]

    def cached(salt: str | None) -> int:
        request = {"messages": prompt, **({"cache_salt": salt} if salt is not None else {})}
        return run_file(runtime, {"temperature": 0.0, "max_generate_length": 2, "requests": [request]})[0][
            "usage"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("") == 0  # the empty salt is a salt, not "no salt"
    assert cached(None) > 0


def test_bypass_and_prefill_state_only(engine_dir: Path, runner: OrtBackend) -> None:
    runtime = make_runtime(engine_dir, runner)
    request = {"messages": [{"role": "user", "content": "x" * 40}]}
    base = {"temperature": 0.0, "max_generate_length": 30, "requests": [request]}
    run_file(runtime, {**base, "context_cache_lookup_policy": BYPASS})
    assert len(runtime.cache.records) == 0 and runtime.cache.profile()["lookup_bypass_sequences"] == 1
    run_file(runtime, {**base, "context_cache_commit_policy": PREFILL_STATE_ONLY})
    [record] = runtime.cache.records.least_recent_first()
    prompt_tokens = len(runtime.inputs.process(parse_request_file(base).requests[0]).prompt_ids)
    assert len(record.token_ids) == prompt_tokens // T * T  # the prompt only: no generated page
    run_file(runtime, {**base, "requests": [{"messages": [{"role": "user", "content": "y" * 40}]}]})
    assert max(len(r.token_ids) for r in runtime.cache.records.least_recent_first()) > prompt_tokens // T * T


def test_legacy_system_prompt_cache(engine_dir: Path, runner: OrtBackend,
                                    cold_runner: OrtBackend) -> None:
    system = {"role": "system", "content": "You are a careful assistant who checks every fact twice. " * 2}

    def data(question: str) -> dict:
        return {"temperature": 0.0, "max_generate_length": 6, "num_logprobs": 1, "requests": [
            {"messages": [system, {"role": "user", "content": question}], "save_system_prompt_kv_cache": True}]}

    runtime = make_runtime(engine_dir, runner, reuse=False)
    first = run_file(runtime, data("What is 2+2?"))[0]
    second = run_file(runtime, data("Name a color."))[0]
    cold = run_file(make_runtime(engine_dir, cold_runner, reuse=False), {**data("Name a color."), "requests": [
        {"messages": [system, {"role": "user", "content": "Name a color."}]}]})[0]
    assert first["usage"]["cached_tokens"] == 0 and second["usage"]["cached_tokens"] > 0
    assert (second["output_text"], top1_ids(second)) == (cold["output_text"], top1_ids(cold))
    with pytest.raises(KvforgeError) as info:
        run_file(make_runtime(engine_dir, runner), data("Name a color."))
    assert info.value.field == "requests[0].save_system_prompt_kv_cache"


# --- property: random request streams ---------------------------------------------------------------

DOCUMENTS = ["", "alpha beta gamma delta epsilon zeta eta theta ", "The quick brown fox jumps over the lazy dog. " * 2,
             "0123456789abcdef" * 3]
request_strategy = st.fixed_dictionaries({
    "document": st.sampled_from(DOCUMENTS),
    "question": st.text(alphabet="abcdefgh ?", min_size=1, max_size=12),
    "salt": st.sampled_from([None, "a", "b"]),
    "max_generate_length": st.integers(1, 20),
})
COLD_OUTPUTS: dict[tuple, tuple] = {}


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests=st.lists(request_strategy, min_size=1, max_size=6), batch_size=st.sampled_from([1, 2]),
       lookup=st.sampled_from([USE_CACHE, USE_CACHE, BYPASS]),
       commit=st.sampled_from([INCLUDING_GENERATED_TOKENS, PREFILL_STATE_ONLY]),
       max_records=st.sampled_from([0, 1, 3, 1024]), pool_pages=st.sampled_from([16, 24, 64]))
def test_random_streams_match_cold_and_keep_accounting(engine_dir: Path, runner: OrtBackend,
                                                       cold_runner: OrtBackend, requests: list[dict],
                                                       batch_size: int, lookup: str,
                                                       commit: str, max_records: int, pool_pages: int) -> None:
    runtime = make_runtime(engine_dir, runner, max_records=max_records, num_pages=pool_pages)  # forces eviction
    data = {"batch_size": batch_size, "temperature": 0.0, "num_logprobs": 1, "apply_chat_template": False,
            "context_cache_lookup_policy": lookup, "context_cache_commit_policy": commit,
            "requests": [{"messages": [{"role": "user", "content": r["document"] + r["question"]}],
                          "max_generate_length": r["max_generate_length"],
                          **({"cache_salt": r["salt"]} if r["salt"] is not None else {})} for r in requests]}
    warm = run_file(runtime, data)
    for request, response in zip(data["requests"], warm, strict=True):
        key = (request["messages"][0]["content"], request["max_generate_length"])
        if key not in COLD_OUTPUTS:
            cold_runtime = make_runtime(engine_dir, cold_runner, reuse=False)
            cold = run_file(cold_runtime, {**data, "batch_size": 1, "requests": [request]})[0]
            COLD_OUTPUTS[key] = (cold["output_text"], top1_ids(cold))
        assert (response["output_text"], top1_ids(response)) == COLD_OUTPUTS[key]
        if lookup == BYPASS:
            assert response["usage"]["cached_tokens"] == 0
    cache = runtime.cache
    assert len(cache.records) <= max_records
    if lookup == BYPASS:
        assert len(cache.records) == 0
