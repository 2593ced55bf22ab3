"""The shared tier inside the engine, on an in-process store: a second engine answers from the first's pages
exactly as cold, isolation carries over, and no store fault fails, changes or stalls a request."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.engine_driver import assert_idle, make_engine, run_file, top1_ids
from support.memory_store import MemoryStore

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.engine import engine as engine_module
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.shared_tier.layout import PAGE_PREFIX
from kvforge.runtime.shared_tier.values import ValueKind, decode, encode

URL = "redis://in-process"  # a real scheme (checked before loading); open_store is patched to the memory store
DOC = "Foxes and dogs share one long document that both engines read. "
SNAPSHOTS = {"context_cache_recurrent_snapshot_pool_bytes": 1 << 22}
PARTIAL = {"context_cache_partial_kv_snapshot_pool_bytes": 1 << 22}
HYBRID = {**SNAPSHOTS, **PARTIAL}
# Recurrent engines capture every 16 tokens, so the second engine finds a checkpoint short of the whole prompt.
CONFIGS = {"tiny-llama": {}, "tiny-qwen3_5": {**HYBRID, "snapshot_interval_tokens": 16},
           "tiny-mamba2": {**SNAPSHOTS, "snapshot_interval_tokens": 16}}


@pytest.fixture(scope="module")
def engines(tier_engine: Callable[..., Path]) -> dict[str, Path]:
    # The same family with other weights: another fingerprint.
    return {family: tier_engine(family) for family in CONFIGS} | {"other-weights": tier_engine("tiny-llama", seed=7)}


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    shared = MemoryStore()
    monkeypatch.setattr(engine_module, "open_store", lambda url, timeout_s: shared)
    return shared


def _requests(salt: str | None = None, question: str = "What jumps?") -> dict[str, Any]:
    request: dict[str, Any] = {"messages": [{"role": "system", "content": DOC * 2},
                                            {"role": "user", "content": question}]}
    if salt is not None:
        request["cache_salt"] = salt
    return {"temperature": 0, "max_generate_length": 6, "num_logprobs": 1, "requests": [request]}


def _tier_engine(path: Path, family: str, **config: Any) -> Engine:
    return make_engine(path, reuse=True, shared_cache=URL, **{**CONFIGS[family], **config})


def _answer(engine: Engine, data: dict[str, Any]) -> tuple[str, list[int]]:
    [response] = run_file(engine, data)
    return response["output_text"], top1_ids(response)


def _cold(path: Path, data: dict[str, Any]) -> tuple[str, list[int]]:
    return _answer(make_engine(path), data)


def _tier(engine: Engine) -> dict[str, Any]:
    return engine.profile()["context_cache"]["shared_tier"]


def _fill(path: Path, family: str, data: dict[str, Any]) -> None:
    """A first engine computes the requests and saves them to the tier (close flushes the writes)."""
    first = _tier_engine(path, family)
    run_file(first, data)
    first.close()
    assert _tier(first)["writes"] > 0 and _tier(first)["errors"] == 0


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_second_engine_answers_from_the_tier_as_cold(family: str, engines: dict[str, Path],
                                                       store: MemoryStore) -> None:
    path, data = engines[family], _requests()
    _fill(path, family, data)
    second = _tier_engine(path, family)
    assert _answer(second, data) == _cold(path, data)
    tier, prefill = _tier(second), second.profile()["prefill"]
    assert tier["hits"] == 1 and tier["loaded_tokens"] > 0 and tier["corrupt"] == 0
    assert prefill["reused_tokens"] == tier["loaded_tokens"]  # nothing was local: every reused token came over
    second.close()


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3_5"])
def test_a_continuation_loads_the_earlier_prompt_to_its_exact_end(family: str, engines: dict[str, Path],
                                                                  store: MemoryStore) -> None:
    """The directory lists the endpoint lengths hanging off each page: a longer prompt in another engine finds the
    end of the first prompt (no interval checkpoints here) and restores its full pages and its tail page (and, on
    the hybrid, its state), not only the whole pages."""
    path, tails = engines[family], HYBRID if family == "tiny-qwen3_5" else PARTIAL
    first_data = _requests()
    first = make_engine(path, reuse=True, shared_cache=URL, **tails)
    _answer(first, first_data)
    first.close()
    longer = _requests(question="What jumps? And what sleeps under the tree?")
    longer["requests"][0]["messages"][1]["content"] = "What jumps?"
    longer["requests"][0]["messages"].append({"role": "assistant", "content": "A fox."})
    longer["requests"][0]["messages"].append({"role": "user", "content": "And the dog?"})
    second = make_engine(path, reuse=True, shared_cache=URL, **tails)
    assert _answer(second, longer) == _cold(path, longer)
    # The longest checkpoint the first engine kept that this prompt extends: its generated answer's end is not
    # this prompt's, so it is its prompt's end, which no message boundary of the second prompt marks.
    [first_prompt] = [r.token_ids for r in first.cache.records.least_recent_first()
                      if len(r.token_ids) == max(len(q.token_ids) for q in first.cache.records.least_recent_first()
                                                 if _is_prefix(q.token_ids, second_prompt(second, longer)))]
    assert _tier(second)["loaded_tokens"] == len(first_prompt) > 0
    assert len(first_prompt) % 16, "the endpoint must end inside a page, or no tail page is tested"


def _is_prefix(tokens: tuple[int, ...], prompt: list[int]) -> bool:
    return len(tokens) < len(prompt) and list(tokens) == prompt[:len(tokens)]


def second_prompt(engine: Engine, data: dict[str, Any]) -> list[int]:
    from kvforge.runtime.file_loop import prepare_requests
    from kvforge.runtime.inputs.request_file import parse_request_file

    [request] = prepare_requests(engine, parse_request_file(data), None)
    return list(request.prompt_ids)


def test_isolation_carries_over(engines: dict[str, Path], store: MemoryStore) -> None:
    path = engines["tiny-llama"]
    _fill(path, "tiny-llama", _requests(salt="tenant-a"))
    for engine_dir, data in ((path, _requests(salt="tenant-b")), (path, _requests()),
                             (engines["other-weights"], _requests(salt="tenant-a"))):
        second = _tier_engine(engine_dir, "tiny-llama")
        assert _answer(second, data) == _cold(engine_dir, data)
        assert _tier(second)["hits"] == 0 and _tier(second)["corrupt"] == 0  # other keys: never even found
    same = _tier_engine(path, "tiny-llama")
    _answer(same, _requests(salt="tenant-a"))
    assert _tier(same)["hits"] == 1


def test_a_dead_store_makes_requests_cold_never_failed(engines: dict[str, Path], store: MemoryStore) -> None:
    path, data = engines["tiny-llama"], _requests()
    store.down = True
    engine = _tier_engine(path, "tiny-llama")
    assert _answer(engine, data) == _cold(path, data)
    engine.close()
    tier = _tier(engine)
    assert tier["errors"] >= 1 and tier["hits"] == 0
    # In the back-off that error started, the next request does not ask, and its record is not written.
    def data_calls() -> dict[str, int]:  # the connect thread keeps retrying on its own back-off: not counted here
        return {name: count for name, count in store.calls.items() if name != "connect"}

    calls = data_calls()
    assert _answer(engine, _requests(question="Who sleeps?")) == _cold(path, _requests(question="Who sleeps?"))
    assert data_calls() == calls and _tier(engine)["skipped_lookups"] >= 1 and _tier(engine)["dropped_writes"] >= 1


@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_a_slow_store_times_out_and_the_request_computes(engines: dict[str, Path], store: MemoryStore) -> None:
    path, data = engines["tiny-llama"], _requests()
    _fill(path, "tiny-llama", data)
    store.delay_s = 1.0
    engine = _tier_engine(path, "tiny-llama", shared_cache_timeout_ms=50)
    started = time.perf_counter()
    assert _answer(engine, data) == _cold(path, data)
    assert time.perf_counter() - started < 0.9  # it did not wait for the store's answer
    tier = _tier(engine)
    assert tier["timeouts"] == 1 and tier["hits"] == 0
    store.delay_s = 0.0
    engine.close()


def test_corrupt_and_foreign_values_are_misses(engines: dict[str, Path], store: MemoryStore) -> None:
    path, data = engines["tiny-llama"], _requests()
    _fill(path, "tiny-llama", data)
    pages = sorted(key for key in store.data if key.startswith(PAGE_PREFIX))
    for key in pages:
        value = bytearray(store.data[key])
        value[len(value) // 2] ^= 0x01  # one bit of K/V
        store.data[key] = bytes(value)
    engine = _tier_engine(path, "tiny-llama")
    assert _answer(engine, data) == _cold(path, data)
    assert _tier(engine)["corrupt"] >= 1 and _tier(engine)["loaded_tokens"] == 0


def test_a_value_written_by_another_engine_under_our_key_is_refused(engines: dict[str, Path],
                                                                    store: MemoryStore) -> None:
    path, data = engines["tiny-llama"], _requests()
    _fill(path, "tiny-llama", data)
    engine = _tier_engine(path, "tiny-llama")
    first = min(key for key in store.data if key.startswith(PAGE_PREFIX) and
                decode(store.data[key], root=engine.tier.root, key=key[1:], kind=ValueKind.PAGE).tokens[0] != -1)
    honest = decode(store.data[first], root=engine.tier.root, key=first[1:], kind=ValueKind.PAGE)
    # Well formed, right key and tokens, valid checksum: only the root names another engine.
    store.data[first] = encode(ValueKind.PAGE, b"\x01" * 16, first[1:], honest.tokens,
                               [np.array(a) for a in honest.arrays])
    for key in store.data:
        if key.startswith(PAGE_PREFIX) and key != first:
            store.data[key] = store.data[first]  # and every other page: the first page's bytes under its key
    assert _answer(engine, data) == _cold(path, data)
    assert _tier(engine)["corrupt"] >= 1 and _tier(engine)["loaded_tokens"] == 0


def test_a_full_store_drops_writes_and_answers_stay_right(engines: dict[str, Path], store: MemoryStore) -> None:
    path, data = engines["tiny-llama"], _requests()
    store.full = True
    engine = _tier_engine(path, "tiny-llama")
    assert _answer(engine, data) == _cold(path, data)
    engine.close()
    assert _tier(engine)["errors"] >= 1 and not store.data


def test_an_abort_while_loading_leaves_nothing_behind(engines: dict[str, Path], store: MemoryStore) -> None:
    path, data = engines["tiny-llama"], _requests()
    _fill(path, "tiny-llama", data)
    store.delay_s = 0.3
    engine = _tier_engine(path, "tiny-llama", shared_cache_timeout_ms=5000)
    from kvforge.runtime.file_loop import prepare_requests
    from kvforge.runtime.inputs.request_file import parse_request_file

    [request] = prepare_requests(engine, parse_request_file(data), None)
    request_id = engine.add_request(request)
    engine.step()
    assert engine.scheduler.loading
    assert engine.abort(request_id)
    assert not engine.scheduler.loading and not engine.tier._loads
    store.delay_s = 0.0
    assert_idle(engine)
    engine.close()


def test_the_tier_needs_reuse_and_a_known_scheme(engines: dict[str, Path]) -> None:
    with pytest.raises(InvalidConfig) as info:
        make_engine(engines["tiny-llama"], shared_cache=URL)
    assert info.value.field == "shared_cache"
    with pytest.raises(InvalidConfig) as info:
        make_engine(engines["tiny-llama"], reuse=True, shared_cache="memcached://127.0.0.1:11211")
    assert info.value.field == "shared_cache" and "unknown scheme" in info.value.message
    with pytest.raises(InvalidConfig) as info:
        make_engine(engines["tiny-llama"], reuse=True, shared_cache=URL, shared_cache_timeout_ms=0)
    assert info.value.field == "shared_cache_timeout_ms"


def test_eagle3_requests_bypass_the_tier(tiny_eagle3_engine_dir: Path, store: MemoryStore) -> None:
    """The support matrix gives an EAGLE3 row a draft pool beside its base pages; the tier holds base pages only,
    so a speculative admission never loads (counted), while its base pages are still saved for others."""
    data = _requests()
    data["requests"][0]["messages"][0]["content"] = "A short shared note."
    spec = {"spec_decode": "eagle3"}
    first = make_engine(tiny_eagle3_engine_dir, reuse=True, shared_cache=URL, **spec)
    _answer(first, data)
    first.close()
    second = make_engine(tiny_eagle3_engine_dir, reuse=True, shared_cache=URL, **spec)
    assert _answer(second, data) == _cold(tiny_eagle3_engine_dir, data)
    assert _tier(second)["skipped_lookups"] == 1 and _tier(second)["lookups"] == 0
    plain = make_engine(tiny_eagle3_engine_dir, reuse=True, shared_cache=URL)  # no drafts: it loads them
    assert _answer(plain, data) == _cold(tiny_eagle3_engine_dir, data)
    assert _tier(plain)["hits"] == 1


def test_a_batch_mixing_tier_loads_local_hits_and_misses_matches_cold(engines: dict[str, Path],
                                                                       store: MemoryStore) -> None:
    """Four rows at once: two documents the first engine saved (each asked twice, so the second asker may wait for
    the first's load as for any in-flight prefix) and one it never saw; continuous scheduling."""
    from kvforge.runtime.file_loop import Scheduling

    path = engines["tiny-llama"]
    saved = {"temperature": 0, "max_generate_length": 6, "num_logprobs": 1, "batch_size": 2,
             "requests": [_requests(question=f"Doc {d}?")["requests"][0] for d in range(2)]}
    for d, request in enumerate(saved["requests"]):
        request["messages"][0]["content"] = f"Document {d}. " + DOC * 2
    _fill(path, "tiny-llama", saved)
    mixed = {**saved, "batch_size": 4,
             "requests": [saved["requests"][0], saved["requests"][1], saved["requests"][0],
                          {"messages": [{"role": "user", "content": "Something never seen before. " * 4}]}]}
    engine = _tier_engine(path, "tiny-llama")
    warm = run_file(engine, mixed, Scheduling.CONTINUOUS)
    cold = run_file(make_engine(path), mixed, Scheduling.CONTINUOUS)
    assert [(r["output_text"], top1_ids(r)) for r in warm] == [(r["output_text"], top1_ids(r)) for r in cold]
    assert _tier(engine)["hits"] >= 2 and engine.profile()["prefill"]["reused_tokens"] > 0
