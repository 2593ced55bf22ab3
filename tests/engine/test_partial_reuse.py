"""Token-exact reuse on an attention-only engine: partial-KV snapshots never change an answer, reuse reaches the
exact last token of a cached prompt (shorter than two pages too), restores are byte-exact, and slots come back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.engine_driver import assert_idle, make_engine, run_file, top1_ids

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.geometry import partial_kv_bytes_per_slot
from kvforge.runtime.context_cache.types.partial_tails import partial_slot
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.execution.kv_store import KVStore
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.runtime.execution.snapshots import PartialKVSnapshotStore
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

pytestmark = pytest.mark.attention_path  # assertions that depend on the attention lowering: run again on the fallback

ROOT = Path(__file__).resolve().parents[2]
T = 16
SLOTS = 8


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("partial")
    write_onnx_dir(synthetic_model("tiny-llama", kv_cache_dtype="fp16"), root / "onnx")
    build_engine(root / "onnx", root / "engine", BuildOptions(max_input_len=2048, max_kv_cache_capacity=2048,
                                                              max_batch_size=2, tokens_per_page=T))
    return root / "engine"


@pytest.fixture(scope="module")
def runner(engine_dir: Path) -> OrtBackend:
    return OrtBackend(load_engine_dir(engine_dir), num_threads=2)


@pytest.fixture(scope="module")
def cold_runner(engine_dir: Path) -> OrtBackend:
    return OrtBackend(load_engine_dir(engine_dir), num_threads=2)


def slot_bytes(engine_dir: Path) -> int:
    engine = load_engine_dir(engine_dir)
    model = engine.model
    return partial_kv_bytes_per_slot(model.num_hidden_layers, model.num_key_value_heads, model.head_dim,
                                     engine.build.tokens_per_page, model.kv_cache_dtype)


def warm_engine(engine_dir: Path, runner: OrtBackend, slots: int = SLOTS, **config: object) -> Engine:
    budget = slots * slot_bytes(engine_dir) + slot_bytes(engine_dir) // 2  # a budget's remainder stays unused
    return make_engine(engine_dir, runner, reuse=True, context_cache_partial_kv_snapshot_pool_bytes=budget,
                       **config)  # type: ignore[arg-type]


def answers(responses: list[dict]) -> list[tuple[str, str, list[int]]]:
    return [(r["output_text"], r["finish_reason"], top1_ids(r)) for r in responses]


def fixture_data() -> dict:
    data = json.loads((ROOT / "test_cases" / "hybrid_context_reuse.json").read_text())
    data["max_generate_length"] = 6
    return data


def prompt_ids(engine: Engine, data: dict) -> list[list[int]]:
    from kvforge.runtime.inputs.request_file import parse_request_file

    return [engine.inputs.process(r).prompt_ids for r in parse_request_file(data).requests]


# --- reuse is invisible and token-exact ----------------------------------------------------------------

def test_fixture_matches_cold_and_reuses_to_the_exact_token(engine_dir: Path, runner: OrtBackend,
                                                            cold_runner: OrtBackend) -> None:
    data = fixture_data()
    warm = warm_engine(engine_dir, runner)
    responses = run_file(warm, data)
    cold = run_file(make_engine(engine_dir, cold_runner), data)
    assert answers(responses) == answers(cold)
    pages_only = make_engine(engine_dir, cold_runner, reuse=True)
    page_responses = run_file(pages_only, data)
    assert answers(page_responses) == answers(cold)
    prompts = prompt_ids(warm, data)
    exact_hits = 0
    for i, response in enumerate(responses):
        # The longest earlier prompt this one extends is cached to its last token (a snapshot of its tail page).
        extended = [len(p) for p in prompts[:i] if len(p) < len(prompts[i]) and prompts[i][:len(p)] == p]
        cached, by_pages = response["usage"]["cached_tokens"], page_responses[i]["usage"]["cached_tokens"]
        assert cached >= by_pages
        if extended:
            assert cached >= max(extended), (i, cached, extended)
            exact_hits += max(extended) % T != 0 and cached > by_pages
    assert exact_hits >= 3  # turns that gained the partial tail page the pages-only run recomputed
    hybrid = warm.profile()["context_cache"]["hybrid"]
    assert hybrid["restores"] >= exact_hits and hybrid["capture_synchronizations"] > 0
    pools = warm.profile()["context_cache"]["resource_pools"]
    assert pools["partial_kv_snapshots"]["capacity"] == SLOTS
    assert pools["partial_kv_snapshots"]["free"] < SLOTS
    assert warm.profile()["prefill"]["computed_tokens"] < pages_only.profile()["prefill"]["computed_tokens"]


def test_prompts_shorter_than_two_pages_reuse_their_cached_prefix(engine_dir: Path, runner: OrtBackend,
                                                                  cold_runner: OrtBackend) -> None:
    first, second = "Hi, Ada!", "Hi, Ada! How are you?"  # 8 and 21 tokens: no full page to share at all
    data = {"temperature": 0.0, "num_logprobs": 1, "max_generate_length": 5, "apply_chat_template": False,
            "context_cache_commit_policy": "prefill_state_only",
            "requests": [{"messages": [{"role": "user", "content": text}]} for text in (first, second)]}
    warm = warm_engine(engine_dir, runner)
    responses = run_file(warm, data)
    assert answers(responses) == answers(run_file(make_engine(engine_dir, cold_runner), data))
    assert [r["usage"]["cached_tokens"] for r in responses] == [0, len(first)]
    assert warm.profile()["prefill"]["reused_tokens"] == len(first) > 0
    pages_only = make_engine(engine_dir, cold_runner, reuse=True)
    run_file(pages_only, data)
    assert pages_only.profile()["prefill"]["reused_tokens"] == 0  # what page-granular reuse gives here


def test_a_shared_system_prompt_and_an_identical_prompt_reuse_to_the_token(engine_dir: Path, runner: OrtBackend,
                                                                           cold_runner: OrtBackend) -> None:
    """Issue 51: a snapshot serves the prefix of its tail a later prompt shares, not only a prompt that extends all of
    it: a shared system prompt whose end lies in the first request's tail page (then different questions) reuses
    exactly its shared tokens, and the same prompt again reuses all but its last token. A prefix that ends inside an
    earlier request's full page reuses the whole pages before it. Every answer equals the cold engine's."""
    system = {"role": "system", "content": "Harbor Point: fourteen turbines."}
    chats = [[system, {"role": "user", "content": q}] for q in ("How many?", "How long?", "How long?")]
    chats.append([{"role": "system", "content": "Harbor Point: 14"}, {"role": "user", "content": "How many?"}])
    data = {"temperature": 0.0, "num_logprobs": 1, "max_generate_length": 4, "apply_chat_template": False,
            "context_cache_commit_policy": "prefill_state_only", "requests": [{"messages": c} for c in chats]}
    warm = warm_engine(engine_dir, runner)
    responses = run_file(warm, data)
    assert answers(responses) == answers(run_file(make_engine(engine_dir, cold_runner), data))
    first, second, third, fourth = prompt_ids(warm, data)

    def shared(a: list[int], b: list[int]) -> int:
        return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)

    # The divergence lies in the first prompt's tail page; the fourth's inside its (and the others') full pages.
    assert len(first) // T * T < shared(first, second) and shared(first, second) % T and second == third
    assert shared(first, fourth) < len(first) // T * T and shared(first, fourth) % T
    assert [r["usage"]["cached_tokens"] for r in responses] == \
        [0, shared(first, second), len(third) - 1, shared(first, fourth) // T * T]


def test_decode_end_snapshot_serves_the_next_turn(engine_dir: Path, runner: OrtBackend,
                                                  cold_runner: OrtBackend) -> None:
    """The decode-end record (prompt + answer) keeps its tail too: feeding the answer back hits past it."""
    warm = warm_engine(engine_dir, runner)
    base = {"temperature": 0.0, "num_logprobs": 1, "max_generate_length": 7, "apply_chat_template": False,
            "logit_bias": {str(t): 40.0 for t in warm.tokenizer.encode("abcdefghij")}}  # ASCII: re-tokenizes alike
    prompt = "Once upon a time, "  # 18 tokens
    first = run_file(warm, {**base, "requests": [{"messages": [{"role": "user", "content": prompt}]}]})[0]
    follow_up = prompt + first["output_text"] + " then"
    data = {**base, "requests": [{"messages": [{"role": "user", "content": follow_up}]}]}
    second = run_file(warm, data)[0]
    # K/V of the prompt and of every generated token but the last one sampled
    assert second["usage"]["cached_tokens"] == len(prompt) + 6
    assert answers([second]) == answers(run_file(make_engine(engine_dir, cold_runner), data))


# --- snapshots themselves ------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "fp8", "fp32"])
def test_snapshot_is_byte_exact_after_restore(kv_cache_dtype: str) -> None:
    pool = KVStore(num_layers=3, num_pages=4, num_kv_heads=2, tokens_per_page=T, head_dim=8,
                  kv_cache_dtype=kv_cache_dtype)
    rng = np.random.default_rng(0)
    for layer in pool.layers:
        layer.view(np.uint8)[...] = rng.integers(0, 256, size=layer.nbytes, dtype=np.uint8).reshape(
            layer.view(np.uint8).shape)
    store = PartialKVSnapshotStore(pool, num_slots=2)
    assert store.nbytes == 2 * partial_kv_bytes_per_slot(3, 2, 8, T, kv_cache_dtype)
    original = [page.copy() for page in pool.read_page(1)]
    store.capture(1, 1)
    for layer in pool.layers:
        layer[1] = 0  # the pool page is reused for something else: the snapshot must not change
    store.restore(1, 3)
    for layer, page in zip(pool.layers, original, strict=True):
        assert layer[3].tobytes() == page.tobytes()


def test_restored_page_holds_the_snapshot_tokens(engine_dir: Path, runner: OrtBackend) -> None:
    warm = warm_engine(engine_dir, runner)
    prompt = "The lighthouse keeper counted ships: "  # 37 tokens: 2 pages + a 5-token tail
    data = {"temperature": 0.0, "max_generate_length": 2, "apply_chat_template": False,
            "requests": [{"messages": [{"role": "user", "content": prompt}]}]}
    run_file(warm, data)
    [record] = [r for r in warm.cache.records.least_recent_first() if len(r.token_ids) == len(prompt)]
    assert partial_slot(record) is not None
    tail = len(prompt) % T
    extended = warm.tokenizer.encode(prompt + "seven, eight, nine.")
    sampling = SamplingParams(temperature=0.0, max_generate_length=3)
    request_id = warm.add_request(warm.inputs.process_prompt(extended, sampling))
    warm.step()
    seq = warm.core.sequences[request_id]
    assert seq.reused_tokens == len(prompt)
    page = seq.lease.page_ids[len(prompt) // T]  # its own page: the record's pages hold none of its tokens
    assert page not in record.page_ids
    for pool_page, slot in zip(warm.backend.kv_store.read_page(page), warm.partial_store.layers, strict=True):
        assert pool_page[:, :, :tail].tobytes() == slot[partial_slot(record)][:, :, :tail].tobytes()
    while warm.has_unfinished():
        warm.step()
    assert_idle(warm)


def test_eviction_frees_snapshot_slots_with_their_records(engine_dir: Path, runner: OrtBackend) -> None:
    warm = warm_engine(engine_dir, runner, slots=2, context_cache_max_records=3)
    data = {"temperature": 0.0, "max_generate_length": 3, "apply_chat_template": False,
            "requests": [{"messages": [{"role": "user", "content": f"{i}: " + "tide " * (3 + i)}]}
                         for i in range(6)]}
    run_file(warm, data)
    cache = warm.cache
    held = [partial_slot(r) for r in cache.records.least_recent_first() if partial_slot(r) is not None]
    assert len(cache.records) <= 3 and cache.partial_snapshots.num_free == 2 - len(held)
    profile = warm.profile()["context_cache"]
    assert profile["reclaimed_resources"]["partial_kv_snapshots"] > 0
    assert profile["hybrid"]["capture_synchronizations"] > 2  # more captures than slots: slots came back


def test_tight_snapshot_budget_skips_captures_and_stays_invisible(engine_dir: Path, runner: OrtBackend,
                                                                  cold_runner: OrtBackend) -> None:
    data = fixture_data()
    warm = warm_engine(engine_dir, runner, slots=1, num_pages=80)  # the longest request needs 71 pages
    responses = run_file(warm, data)
    assert answers(responses) == answers(run_file(make_engine(engine_dir, cold_runner), data))
    pools = warm.profile()["context_cache"]["resource_pools"]["partial_kv_snapshots"]
    assert pools["capacity"] == 1


# --- bad input -----------------------------------------------------------------------------------------

def test_snapshot_budget_errors_name_the_setting(engine_dir: Path, runner: OrtBackend) -> None:
    field = "context_cache_partial_kv_snapshot_pool_bytes"
    with pytest.raises(InvalidConfig) as info:
        make_engine(engine_dir, runner, reuse=False, context_cache_partial_kv_snapshot_pool_bytes=10**9)
    assert info.value.field == field and "requires context reuse" in info.value.message
    with pytest.raises(InvalidConfig) as info:
        make_engine(engine_dir, runner, reuse=True,
                    context_cache_partial_kv_snapshot_pool_bytes=slot_bytes(engine_dir) - 1)
    assert info.value.field == field and f"takes {slot_bytes(engine_dir)} bytes" in info.value.message
    with pytest.raises(InvalidConfig) as info:
        make_engine(engine_dir, runner, reuse=True, context_cache_partial_kv_snapshot_pool_bytes=-1)
    assert info.value.field == field


def test_python_api_takes_the_snapshot_budget(engine_dir: Path) -> None:
    from kvforge import LLM

    llm = LLM(engine_dir, num_threads=2, enable_context_reuse=True,
              context_cache_partial_kv_snapshot_pool_bytes=2 * slot_bytes(engine_dir))
    params = SamplingParams(temperature=0.0, max_generate_length=2)
    first = [{"role": "user", "content": "Name a bird."}]
    [out] = llm.chat(first, params)
    [again] = llm.chat([*first, {"role": "assistant", "content": "Owl."}, {"role": "user", "content": "Another?"}],
                       params)
    assert again.cached_tokens == len(out.prompt_token_ids) > 0  # the whole first prompt, not whole pages only
    assert len(out.prompt_token_ids) % T != 0
    pools = llm.context_cache_metrics()["resource_pools"]["partial_kv_snapshots"]
    assert pools["capacity"] == 2
