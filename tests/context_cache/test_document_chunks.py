"""Documents reused wherever they appear in a prompt (issue 37): stored once from a standalone prefill, restored with
K re-rotated, repaired by policy; `full` gives a cold run's tokens, approximate K/V is never found under exact prefix
keys, and the deployments the rotation cannot serve are refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from support.engine_driver import document_prompt, first_layer_rows, run_alone

from kvforge import LLM
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.rope import rope_table
from kvforge.plugins.reference import apply_rope, round_to_storage
from kvforge.runtime.context_cache.keys import KeyExtras, page_keys
from kvforge.runtime.engine.config import resolve_engine_config
from kvforge.runtime.engine.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from kvforge.runtime.execution.kv_store import ROTATION_CHECK_TOLERANCE, DocumentKVStore, KVStore, check_rotation
from kvforge.runtime.types import SamplingParams

T = 16  # the tiny engine's page
GREEDY = SamplingParams(temperature=0, max_generate_length=6)
DOC_A = list(range(40, 60))  # 20 tokens: one full page and a partial one
DOC_B = list(range(70, 88))  # 18 tokens


def prompt(system: list[int], docs: list[list[int]], question: list[int]) -> EngineRequest:
    return document_prompt(system, docs, question, GREEDY)


FIRST = prompt([1, 2, 3, 4, 5], [DOC_A, DOC_B], [9, 10, 11])
# Another system prompt (a timestamp), the documents in the other order, another question.
SECOND = prompt([1, 2, 3, 4, 6, 7, 8], [DOC_B, DOC_A], [12, 13, 14, 15])


def documents(engine: Engine) -> dict[str, int]:
    return engine.profile()["context_cache"]["documents"]


@pytest.fixture(scope="module")
def cold(tiny_engine_dir: Path) -> list[list[int]]:
    engine = Engine(tiny_engine_dir, EngineConfig(num_threads=1))
    return [run_alone(engine, request).token_ids for request in (FIRST, SECOND)]


def engine_with(tiny_engine_dir: Path, repair: str) -> Engine:
    return Engine(tiny_engine_dir, EngineConfig(num_threads=1, document_reuse=True, document_repair=repair))


def test_full_repair_gives_the_cold_tokens(tiny_engine_dir: Path, cold: list[list[int]]) -> None:
    engine = engine_with(tiny_engine_dir, "full")
    assert engine.cache.enabled  # document reuse implies context reuse
    assert [run_alone(engine, request).token_ids for request in (FIRST, SECOND)] == cold
    counts = documents(engine)
    assert counts["documents_produced"] == 2 and counts["document_hits"] == 4  # both requests hit both documents
    assert counts["reused_tokens"] == 0 and counts["repaired_tokens"] == 2 * (len(DOC_A) + len(DOC_B))


def test_none_reuses_every_document_token_and_reports_it(tiny_engine_dir: Path) -> None:
    engine = engine_with(tiny_engine_dir, "none")
    first, second = run_alone(engine, FIRST), run_alone(engine, SECOND)
    # The documents were produced alone before the first request ran, so it restores them too; but they were
    # computed for it, so they are not cached for it (issue 52 item 3). The second finds them stored.
    assert (first.cached_tokens, second.cached_tokens) == (0, len(DOC_A) + len(DOC_B))
    counts = documents(engine)
    assert counts["documents_seen"] == 4 and counts["document_hits"] == 4 and counts["documents_produced"] == 2
    assert counts["reused_tokens"] == 2 * (len(DOC_A) + len(DOC_B)) and counts["repaired_tokens"] == 0
    assert counts["rotated_pages"] == 2 * (2 + 2)  # 20 and 18 tokens: two pages' worth each
    pools = engine.profile()["context_cache"]["resource_pools"]["document_kv_pages"]
    assert pools["capacity"] > 0 and pools["free"] == pools["capacity"] - 4


def test_first_page_repairs_one_page_per_document(tiny_engine_dir: Path) -> None:
    engine = engine_with(tiny_engine_dir, "first-page")
    run_alone(engine, FIRST)  # stores both documents
    before = documents(engine)["repaired_tokens"]
    output = run_alone(engine, SECOND)
    assert output.cached_tokens == len(DOC_A) + len(DOC_B) - 2 * T
    assert documents(engine)["repaired_tokens"] - before == 2 * T


def test_overlap_recomputes_the_document_closest_to_the_question(tiny_engine_dir: Path) -> None:
    engine = engine_with(tiny_engine_dir, "overlap")
    asks_about_b = prompt([1, 2, 3, 4, 6], [DOC_A, DOC_B], [12, DOC_B[5], DOC_B[9], 15])
    run_alone(engine, FIRST)  # stores both documents
    before = documents(engine)["repaired_tokens"]
    output = run_alone(engine, asks_about_b)
    assert output.cached_tokens == len(DOC_A) - T  # DOC_A: all but its first page; DOC_B: recomputed whole
    assert documents(engine)["repaired_tokens"] - before == T + len(DOC_B)


def test_approximate_kv_is_never_found_under_exact_prefix_keys(tiny_engine_dir: Path) -> None:
    engine = engine_with(tiny_engine_dir, "none")
    run_alone(engine, SECOND)
    first_document = SECOND.documents[0].start
    keys = page_keys(SECOND.prompt_ids, T, KeyExtras(), parent=engine.cache.chain_root)
    indexed = [engine.cache.index.contains(key) for key in keys]
    # Pages wholly before the first restored document are exact and published; none from there on is findable.
    assert indexed == [page < first_document // T for page in range(len(keys))]
    # The same prompt again: its exact prefix hit stops before the first document, which it restores again.
    before = engine.profile()["context_cache"]["reused_tokens"]
    again = run_alone(engine, SECOND)
    assert engine.profile()["context_cache"]["reused_tokens"] - before <= first_document // T * T
    assert again.cached_tokens >= len(DOC_A) + len(DOC_B)


def test_exact_prefix_reuse_before_the_first_document_still_works(tiny_engine_dir: Path) -> None:
    engine = engine_with(tiny_engine_dir, "full")
    system = list(range(100, 120))  # a page and more of system prompt before the documents
    run_alone(engine, prompt(system, [DOC_A], [9]))
    output = run_alone(engine, prompt(system, [DOC_B], [9]))
    assert output.cached_tokens >= T  # the system prompt's full page, found by its exact key


def test_restore_moves_keys_to_their_new_positions() -> None:
    """A document stored at position 0 and restored at 21 (inside a page) has the keys computed at 21.. within one
    fp16 rounding, its values as stored, and leaves the positions before it alone."""
    rng = np.random.default_rng(1)
    heads, dim, length, start = 2, 8, 20, 21
    cos_sin = rope_table(256, dim, 10000.0)
    kv = KVStore(1, 8, heads, T, dim, "fp16")
    store = DocumentKVStore(kv, 4, cos_sin, "fp16")
    raw_k = rng.standard_normal((length, heads, dim)).astype(np.float32)
    values = rng.standard_normal((length, heads, dim)).astype(np.float32)
    at_0 = apply_rope(raw_k, cos_sin, np.arange(length))
    pages = [2, 3]
    pos_pages, slots = kv.locate(pages, 0, length)
    kv.scatter(0, np.stack([at_0, values], axis=1), pos_pages, slots)
    store.capture(pages, [0, 1])
    row = [5, 6, 7]
    kv.layers[0][5, :, :, :start % T] = 7  # what the prefix computed in the first page
    store.restore([0, 1], row, start, 0, length)
    restored = kv.read_tokens(row, start + length)[0]
    expected_k = round_to_storage(apply_rope(raw_k, cos_sin, start + np.arange(length)), "fp16")
    np.testing.assert_allclose(restored[start:, 0].astype(np.float32), expected_k, atol=2e-3)
    np.testing.assert_array_equal(restored[start:, 1], values.astype(np.float16))
    assert (restored[T:start] == 0).all() and (kv.layers[0][5, :, :, :start % T] == 7).all()


def test_a_rope_the_rotation_cannot_reproduce_is_detected() -> None:
    table = rope_table(512, 16, 10000.0)
    assert check_rotation(table, 16) <= ROTATION_CHECK_TOLERANCE
    scaled = table * 1.1  # an attention factor folded into cos and sin (YaRN's): rotations no longer compose
    assert check_rotation(scaled, 16) > ROTATION_CHECK_TOLERANCE


def refusal(engine_dir: Path, **options: object) -> InvalidConfig:
    with pytest.raises(InvalidConfig) as info:
        resolve_engine_config(EngineConfig(**options), load_engine_dir(engine_dir))  # type: ignore[arg-type]
    assert "\n" not in info.value.message
    return info.value


def test_an_unknown_repair_policy_is_refused(tiny_engine_dir: Path) -> None:
    error = refusal(tiny_engine_dir, document_repair="most")
    assert error.field == "document_repair" and "none, first-page, overlap, full" in error.message


def test_a_draft_model_is_refused(tiny_eagle3_engine_dir: Path) -> None:
    error = refusal(tiny_eagle3_engine_dir, document_reuse=True, spec_decode="eagle3")
    assert error.field == "document_reuse" and "draft" in error.message
    resolve_engine_config(EngineConfig(document_reuse=True, spec_decode="ngram"),
                          load_engine_dir(tiny_eagle3_engine_dir))


def test_recurrent_and_hybrid_engines_are_refused(tiny_hybrid_engine_dir: Path) -> None:
    error = refusal(tiny_hybrid_engine_dir, document_reuse=True)
    assert error.field == "document_reuse" and "attention-only" in error.message


def test_restored_documents_sit_where_a_cold_run_computes_them(tiny_engine_dir: Path) -> None:
    """The first layer's K/V does not depend on context, so there restored rows equal a cold run's within fp16
    rounding of the rotation: the rows land at the document's positions, with K rotated to them."""
    cold_rows = first_layer_rows(Engine(tiny_engine_dir, EngineConfig(num_threads=1)), SECOND)
    warm = engine_with(tiny_engine_dir, "none")
    warm_rows = first_layer_rows(warm, SECOND)
    assert documents(warm)["reused_tokens"] == len(DOC_A) + len(DOC_B)
    np.testing.assert_allclose(warm_rows, cold_rows, atol=4e-3, rtol=2e-3)


def test_the_api_takes_the_options(tiny_engine_dir: Path) -> None:
    """kvforge.LLM(document_reuse=..., document_repair=...): a chat's document part, asked about twice behind another
    system prompt, is restored the second time and counted in cached_tokens."""
    llm = LLM(str(tiny_engine_dir), num_threads=1, document_reuse=True, document_repair="none")
    report = {"type": "document", "text": "Pump 3 stopped at noon."}

    def ask(system: str) -> RequestOutput:
        [output] = llm.chat([{"role": "system", "content": system},
                             {"role": "user", "content": [report, {"type": "text", "text": "Why?"}]}], GREEDY)
        return output

    ask("t=1")
    assert ask("t=22").cached_tokens >= len("Pump 3 stopped at noon.")
    assert llm.context_cache_metrics()["documents"]["document_hits"] == 2


@pytest.mark.parametrize("repair", ["full", "none"])
def test_a_tight_pool_preempts_and_full_still_answers_as_cold(tiny_engine_dir: Path, repair: str) -> None:
    """Both requests at once, with their standalone prefills, in 8 pages: a request that grows preempts the other,
    which is recomputed (restoring its documents again); the cache stays consistent after every step, and `full`
    still gives the cold tokens."""
    long = SamplingParams(temperature=0, max_generate_length=30)
    requests = [EngineRequest(r.prompt_ids, long, documents=r.documents) for r in (FIRST, SECOND)]
    reference = Engine(tiny_engine_dir, EngineConfig(num_threads=1))
    cold_tokens = [run_alone(reference, request).token_ids for request in requests]
    engine = Engine(tiny_engine_dir, EngineConfig(num_threads=1, document_reuse=True, document_repair=repair),
                    num_pages=8)
    ids = [engine.add_request(request) for request in requests]
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id in ids
            if output.finished:
                finals[output.request_id] = output.token_ids
        engine.cache.check_invariants()
    assert engine.scheduler.stats.preemptions > 0
    assert len(finals) == 2
    if repair == "full":
        assert [finals[i] for i in ids] == cold_tokens


def test_the_profile_counts_restored_documents_as_reused_prefill(tiny_engine_dir: Path) -> None:
    engine = engine_with(tiny_engine_dir, "none")
    run_alone(engine, SECOND)
    prefill = engine.profile()["prefill"]
    assert prefill["reused_tokens"] == 0  # its documents were computed for it (issue 52 item 3)
    # Computed: the documents alone (their standalone prefills), then the request's other tokens.
    assert prefill["computed_tokens"] == len(SECOND.prompt_ids)
    run_alone(engine, FIRST)
    assert engine.profile()["prefill"]["reused_tokens"] == len(DOC_A) + len(DOC_B)  # stored before it arrived


def test_a_partial_snapshot_hit_and_a_document_in_its_page_do_not_overlap(tiny_engine_dir: Path) -> None:
    """A prompt extending a published one to inside a page restores that page from a partial-KV snapshot; a document
    starting in the same page is computed there, not restored (the snapshot's copy would overwrite it)."""
    budget = Engine(tiny_engine_dir, EngineConfig(num_threads=1)).engine_dir.build.partial_kv_snapshot_bytes_per_slot
    engine = Engine(tiny_engine_dir, EngineConfig(num_threads=1, document_reuse=True, document_repair="full",
                                                  context_cache_partial_kv_snapshot_pool_bytes=16 * budget))
    system = list(range(100, 120))  # 20 tokens: a page and 4 of the next
    run_alone(engine, EngineRequest(system, GREEDY))
    reference = Engine(tiny_engine_dir, EngineConfig(num_threads=1))
    request = prompt(system, [DOC_A], [9, 10])
    run_alone(engine, prompt([1, 2, 3], [DOC_A], [9]))  # stores DOC_A
    output = run_alone(engine, request)
    assert output.token_ids == run_alone(reference, request).token_ids
    assert documents(engine)["document_hits"] == 1  # only the second prompt's DOC_A (the third's starts at 20)
    assert output.cached_tokens == len(system)  # the page and the snapshot's 4 tokens


def test_layers_with_their_own_rope_are_served(tier_engine: Callable[..., Path]) -> None:
    """Gemma's local layers turn keys by another base than the runtime's table: each layer's own rotation moves
    them (issue 53; tests/context_cache/test_document_gemma.py), so the engine config accepts document reuse."""
    resolve_engine_config(EngineConfig(document_reuse=True), load_engine_dir(tier_engine("tiny-gemma3")))
