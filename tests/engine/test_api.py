"""The Python API (kvforge.LLM, SamplingParams, RequestOutput) on the tiny synthetic engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
from support.engine_driver import assert_idle, build_once

import kvforge
from kvforge import LLM, SamplingParams
from kvforge.builder.build import BuildOptions
from kvforge.contract.errors import KvforgeError

pytestmark = pytest.mark.attention_path  # assertions that depend on the attention lowering: run again on the fallback

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_generate_length=6, num_logprobs=2)
DOC = "A shared document of several pages about harbours and tides. " * 2


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("api_engine")
    return build_once(tiny_onnx_dir, path, BuildOptions(max_input_len=256, max_kv_cache_capacity=512,
                                                        max_batch_size=4, tokens_per_page=16))


@pytest.fixture(scope="module")
def llm(engine_dir: Path) -> LLM:
    return LLM(str(engine_dir), num_threads=2, enable_context_reuse=True)


def test_version_and_lazy_exports() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert kvforge.__version__ == pyproject["project"]["version"]
    assert kvforge.RequestOutput.__name__ == "RequestOutput"
    with pytest.raises(AttributeError):
        _ = kvforge.NoSuchThing  # type: ignore[attr-defined]


def test_generate_text_and_token_ids_agree(llm: LLM) -> None:
    ids = llm.engine.tokenizer.encode("hello world")
    by_text, by_ids = llm.generate(["hello world", ids], GREEDY)
    assert by_text.token_ids == by_ids.token_ids and by_text.text == by_ids.text
    assert by_text.finished and by_text.finish_reason in ("max-length", "end-of-sequence")
    assert by_text.prompt_token_ids == ids
    assert [len(step) for step in by_text.logprobs] == [2] * len(by_text.token_ids)
    assert 0 < by_text.timing.prefill_ms <= by_text.timing.ttft_ms  # prefill includes its first engine call
    [single] = llm.generate(ids, GREEDY)  # one prompt as token ids
    assert single.token_ids == by_ids.token_ids
    assert_idle(llm.engine)


def test_stream_yields_the_same_tokens_and_text(llm: LLM) -> None:
    [full] = llm.generate("stream me", GREEDY)
    deltas = list(llm.stream("stream me", GREEDY))
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    first = next(iter(llm.stream("stop early", SamplingParams(temperature=0.0, max_generate_length=50))))
    assert not first.finished  # the generator was dropped: its request is aborted, nothing stays in flight
    assert_idle(llm.engine)


def test_chat_reuses_the_context_and_policies_switch_it_off(llm: LLM) -> None:
    conversation = [{"role": "system", "content": DOC}, {"role": "user", "content": "Question one?"}]
    llm.chat(conversation, GREEDY, cache_salt="api")
    again = llm.chat([conversation[0], {"role": "user", "content": "Question two?"}], GREEDY, cache_salt="api")[0]
    assert again.cached_tokens > 0
    cold = llm.chat([conversation[0], {"role": "user", "content": "Question two?"}],
                    SamplingParams(temperature=0.0, max_generate_length=6, num_logprobs=2, reuse_context=False),
                    cache_salt="api")[0]
    assert cold.cached_tokens == 0 and (cold.token_ids, cold.text) == (again.token_ids, again.text)
    both = llm.chat([conversation, [{"role": "user", "content": "hi"}]], GREEDY)
    assert len(both) == 2
    metrics = llm.context_cache_metrics()
    assert metrics["hit_sequences"] >= 1 and metrics["reused_tokens"] >= again.cached_tokens
    assert_idle(llm.engine)


def test_reuse_is_on_by_default_and_token_exact(engine_dir: Path) -> None:
    """A short chat (well under a page per turn) reuses its earlier turns from the second turn on, to the token."""
    llm = LLM(engine_dir, num_threads=2)
    assert llm.engine.cache.enabled and llm.engine.cache.partial_snapshots.capacity == 64  # llm_build's budget
    chat: list[dict[str, str]] = []
    cached = []
    for question in ("Hi!", "And then?", "Why?"):
        chat.append({"role": "user", "content": question})
        [out] = llm.chat(chat, GREEDY)
        chat.append({"role": "assistant", "content": out.text})
        cached.append(out.cached_tokens)
    assert cached[0] == 0 and 0 < cached[1] < cached[2]
    assert cached[1] % llm.engine.engine_dir.build.tokens_per_page  # not whole pages: the exact token
    off = LLM(engine_dir, num_threads=2, enable_context_reuse=False)
    [cold] = off.chat(chat[:3], GREEDY)
    assert not off.engine.cache.enabled and cold.cached_tokens == 0
    [warm] = llm.chat(chat[:3], GREEDY)
    assert (warm.token_ids, warm.text) == (cold.token_ids, cold.text)  # reuse never changes an answer
    assert_idle(llm.engine)


def test_sampling_params_refuse_bad_values_before_anything_runs(llm: LLM) -> None:
    with pytest.raises(KvforgeError) as info:
        llm.generate("hi", SamplingParams(temperature=-1))
    assert info.value.field == "temperature"
    [out] = llm.generate("The capital", SamplingParams(temperature=0, max_tokens=30, stop="a"))
    assert "a" not in out.text and (out.finish_reason == "stop-words" or len(out.token_ids) == 30)
    assert_idle(llm.engine)


def test_prefill_state_only_keeps_generated_tokens_out(engine_dir: Path) -> None:
    # Whole pages only (no partial-KV snapshot pool), so records end at a page boundary.
    llm = LLM(engine_dir, num_threads=2, context_cache_partial_kv_snapshot_pool_bytes=0)
    params = SamplingParams(temperature=0.0, max_generate_length=40, cache_generated_tokens=False)
    [out] = llm.generate(DOC, params)
    tokens_per_page = llm.engine.engine_dir.build.tokens_per_page
    assert {len(r.token_ids) for r in llm.engine.cache.records.least_recent_first()} == \
        {len(out.prompt_token_ids) // tokens_per_page * tokens_per_page}


@pytest.mark.parametrize("prompt, field", [([10**9], "prompt"), ([], "prompt"), ("", "prompt"),
                                           ("x" * 300, "prompt")])
def test_bad_prompts_fail_before_running(llm: LLM, prompt: object, field: str) -> None:
    with pytest.raises(KvforgeError) as info:
        llm.generate([prompt], GREEDY)  # type: ignore[list-item]
    assert info.value.field == field
    assert_idle(llm.engine)


def test_unknown_adapter_is_a_clear_error(llm: LLM) -> None:
    with pytest.raises(KvforgeError, match="not loaded"):
        llm.generate("hi", GREEDY, lora_name="nope")
