"""Documents on engines built with --slidingWindowPool (issue 53): a restored document's sliding-layer rows go into
the window group's pages as the row allocates them, so `full` answers as cold, `none` reuses the documents, layer 0's
restored window rows equal a cold run's, and the pools' audit holds through releases and evictions. Tiny random
Gemma 3 and Gemma 4 (window 32, 16-token pages), documents longer and shorter than the window."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from support.engine_driver import document_prompt, run_alone

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.profile_schema import (
    DOCUMENT_KV_PAGES,
    RECLAIMED_RESOURCES,
    RECORDS,
    RECORDS_EVICTED,
    SLIDING_WINDOW_PAGES,
)
from kvforge.contract.window_pool import WINDOW_GROUP
from kvforge.runtime.context_cache.types.sliding_window import window_table
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

T, WINDOW = 16, 32
BUILD = BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=2, tokens_per_page=T,
                     sliding_window_pool=True)
GREEDY = SamplingParams(temperature=0, max_generate_length=6)
# Three windows long: its producer gave its first pages back before the end, so they are not in the stored form.
DOC_LONG = [int(t) for t in np.random.default_rng(11).integers(40, 250, 100)]
DOC_MID = [int(t) for t in np.random.default_rng(12).integers(40, 250, 36)]  # just longer than the window
DOC_SHORT = [int(t) for t in np.random.default_rng(13).integers(40, 250, 20)]  # shorter than the window
FIRST = document_prompt([1, 2, 3, 4, 5], [DOC_LONG, DOC_MID, DOC_SHORT], [9, 10, 11], GREEDY)
# Another system prompt, the documents in another order (the short one last: the question's window reaches the
# long one before it), another question.
SECOND = document_prompt([1, 2, 3, 4, 6, 7, 8], [DOC_MID, DOC_LONG, DOC_SHORT], [12, 13, 14, 15], GREEDY)
# Documents right after a two-page system prompt that PRIME leaves cached with its window: restored from the reuse
# point on, so the first call already moves past them (into window pages the admission did not allocate).
SYSTEM = [int(t) for t in np.random.default_rng(14).integers(40, 250, 2 * T)]
PRIME = EngineRequest(SYSTEM + [9, 10, 11], GREEDY)
AT_REUSE = document_prompt(SYSTEM, [DOC_LONG, DOC_SHORT], [12, 13, 14, 15], GREEDY)
DOCUMENT_TOKENS = len(DOC_LONG) + len(DOC_MID) + len(DOC_SHORT)


@pytest.fixture(scope="module", params=["tiny-gemma3", "tiny-gemma4"])
def window_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    loaded = synthetic_model(request.param, kv_cache_dtype="fp32")
    assert loaded.config.sliding_window == WINDOW and 0 in loaded.config.sliding_window_layers
    write_onnx_dir(loaded, root / "onnx")
    build_engine(root / "onnx", root / "engine", BUILD)
    return root / "engine"


def documents_engine(engine_dir: Path, repair: str, **options: object) -> Engine:
    engine = Engine(engine_dir, EngineConfig(num_threads=1, document_reuse=True, document_repair=repair,
                                             **options))  # type: ignore[arg-type]
    assert engine.cache.pools[SLIDING_WINDOW_PAGES].capacity > 0  # the engine has a window group
    return engine


def test_full_equals_cold_and_none_reuses_the_documents(window_engine: Path) -> None:
    cold = Engine(window_engine, EngineConfig(num_threads=1))
    requests = (FIRST, SECOND, PRIME, AT_REUSE)
    expected = [run_alone(cold, request).token_ids for request in requests]
    full = documents_engine(window_engine, "full")
    assert [run_alone(full, request).token_ids for request in requests] == expected
    assert full.profile()["context_cache"]["documents"]["document_hits"] == 3 + 3 + 0 + 2
    none = documents_engine(window_engine, "none")
    run_alone(none, FIRST)  # stores the three documents
    # The long document's producer held only its last window when it was captured: its first 4 window pages
    # (positions 0-63, more than a window before its end) are not in the stored form, and never restored.
    documents = next(kind for kind in none.cache.types if kind.name == DOCUMENT_KV_PAGES)
    captured = {record.parts[DOCUMENT_KV_PAGES].tokens: documents.copier.captured[WINDOW_GROUP][list(
        record.parts[DOCUMENT_KV_PAGES].slots)].tolist() for record in none.cache.records.least_recent_first()
        if DOCUMENT_KV_PAGES in record.parts}
    assert captured[tuple(DOC_LONG)] == [False] * 4 + [True] * 3
    assert all(captured[tuple(DOC_MID)]) and all(captured[tuple(DOC_SHORT)])
    assert run_alone(none, SECOND).cached_tokens == DOCUMENT_TOKENS
    run_alone(none, PRIME)
    assert run_alone(none, AT_REUSE).cached_tokens == len(SYSTEM) + len(DOC_LONG) + len(DOC_SHORT)


@pytest.fixture(scope="module")
def one_row_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Gemma 3 with a window group sized for one row and no record (`--slidingWindowRecords 0`, the default)."""
    root = tmp_path_factory.mktemp("tiny-gemma3-one-row")
    write_onnx_dir(synthetic_model("tiny-gemma3", kv_cache_dtype="fp32"), root / "onnx")
    build_engine(root / "onnx", root / "engine", replace(BUILD, max_batch_size=1))
    return root / "engine"


def test_default_records_keep_the_documents(one_row_engine: Path) -> None:
    """Issue 53: a group with no room for records takes each record's window checkpoint for the next row, but only
    that: the documents' records stay, so the second request restores the three documents the first produced (the
    old eviction took whole records and every document was produced again: 0 cached). The audit holds every step."""
    engine = documents_engine(one_row_engine, "none")
    run_alone(engine, FIRST)
    assert engine.profile()["context_cache"]["documents"]["documents_produced"] == 3
    second = run_alone(engine, SECOND)
    assert second.cached_tokens == DOCUMENT_TOKENS
    documents = engine.profile()["context_cache"]["documents"]
    assert documents["documents_produced"] == 3 and documents["document_hits"] == 3 + 3  # (the first restores too)
    # Window pages went back to the group under pressure, and no record was evicted whole to free them.
    cache = engine.profile()["context_cache"]
    assert cache[RECLAIMED_RESOURCES][SLIDING_WINDOW_PAGES] > 0 and cache[RECORDS][RECORDS_EVICTED] == 0
    assert sum(DOCUMENT_KV_PAGES in record.parts for record in engine.cache.records.least_recent_first()) == 3


def window_rows(engine: Engine, request: EngineRequest) -> dict[int, np.ndarray]:
    """Layer 0's (a sliding layer's) K/V rows that the next position's sliding attention reads after each step of
    the prompt (the WINDOW - 1 positions before it), read through the row's window table."""
    request_id = engine.add_request(request)
    seq = engine.core.sequences[request_id]
    pool, rows = engine.backend.kv_store.layers[0], {}
    while not seq.output_ids:
        engine.step()
        table = window_table(seq.lease) or []
        computed = min(seq.num_computed_tokens, len(request.prompt_ids))
        for position in range(max(computed - WINDOW + 1, 0), computed):
            page = table[position // T]
            assert page >= 0, f"position {position} is read but has no window page"
            rows[position] = pool[page, :, :, position % T].astype(np.float32)
    while engine.has_unfinished():
        engine.step()
    return rows


@pytest.mark.parametrize("request_", [SECOND, AT_REUSE], ids=["after-system", "at-reuse-point"])
def test_restored_window_rows_equal_a_cold_runs(window_engine: Path, request_: EngineRequest) -> None:
    """Layer 0 is a sliding layer whose K/V depends on each token alone: every window row a call reads after a step
    (restored documents' rows included, the prompt's last token's in particular) equals a cold run's within float32
    rounding of the rotations. A restore into the global pages alone writes none of them."""
    cold = window_rows(Engine(window_engine, EngineConfig(num_threads=1)), request_)
    warm_engine = documents_engine(window_engine, "none")
    run_alone(warm_engine, FIRST)
    run_alone(warm_engine, PRIME)
    warm = window_rows(warm_engine, request_)
    assert warm_engine.profile()["context_cache"]["documents"]["document_hits"] >= 2
    # The documents' rows the prompt's last token reads (every request here ends with a 4-token question after a
    # 20-token document that follows a longer one: two documents' rows).
    end = len(request_.prompt_ids)
    read = range(end - WINDOW + 1, end - 4)
    assert set(read) <= warm.keys() and set(read) <= cold.keys()
    np.testing.assert_allclose(np.stack([warm[p] for p in read]), np.stack([cold[p] for p in read]),
                               atol=2e-4, rtol=1e-4)
    both = sorted(warm.keys() & cold.keys())  # and every other row both runs read
    np.testing.assert_allclose(np.stack([warm[p] for p in both]), np.stack([cold[p] for p in both]),
                               atol=2e-4, rtol=1e-4)


def test_the_audit_holds_through_releases_and_evictions(window_engine: Path) -> None:
    """With room for two records only, documents are stored, restored and evicted while requests run: the cache's
    invariants hold every step (run_alone), and once everything is evicted every pool is free again."""
    engine = documents_engine(window_engine, "none", context_cache_max_records=2)
    for request in (FIRST, SECOND, PRIME, AT_REUSE, SECOND, FIRST):
        run_alone(engine, request)
    assert engine.profile()["context_cache"]["documents"]["document_hits"] > 0
    cache = engine.cache
    assert not cache.leases
    cache._evict([record.record_id for record in cache.records.least_recent_first()])
    cache.check_invariants()
    for name in (DOCUMENT_KV_PAGES, SLIDING_WINDOW_PAGES):
        assert cache.pools[name].num_free == cache.pools[name].capacity, name


def run_together(engine: Engine, requests: tuple[EngineRequest, ...]) -> list[list[int]]:
    """The requests added at once (two rows at a time, their documents' producers queued among them), auditing the
    cache every step: each one's tokens."""
    ids = [engine.add_request(request) for request in requests]
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                assert output.error is None, output.error
                answers[output.request_id] = output.token_ids
        engine.cache.check_invariants()
    return [answers[request_id] for request_id in ids]


def test_rows_running_together_answer_as_cold(window_engine: Path) -> None:
    """Documents restored into rows that grow side by side (and producers running beside them): `full` answers as
    cold, `none` reuses the stored documents, and every row's window pages go back."""
    requests = (FIRST, SECOND, PRIME, AT_REUSE)
    expected = run_together(Engine(window_engine, EngineConfig(num_threads=1)), requests)
    assert run_together(documents_engine(window_engine, "full"), requests) == expected
    none = documents_engine(window_engine, "none")
    run_together(none, requests)
    # One per document, built without --slidingWindowRecords: new rows take only the records' window checkpoints,
    # never a stored document (issue 53; whole-record eviction left fewer).
    assert none.profile()["context_cache"]["documents"]["document_hits"] == 3 + 3 + 0 + 2
    pool = none.cache.pools[SLIDING_WINDOW_PAGES]
    kept = {slot for record in none.cache.records.least_recent_first()
            for slot in (record.parts[SLIDING_WINDOW_PAGES].slots if SLIDING_WINDOW_PAGES in record.parts else ())}
    assert pool.num_free == pool.capacity - len(kept)
