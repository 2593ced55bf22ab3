"""Dropping a kvforge.LLM frees its engine, shared tier or not: no worker thread, pool or store outlives it."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
from support.memory_store import MemoryStore

from kvforge import LLM, SamplingParams
from kvforge.runtime.engine import engine as engine_module

URL = "redis://in-process"  # a real scheme (checked before loading); open_store is patched to the memory store
GREEDY = SamplingParams(temperature=0.0, max_generate_length=3)
PROMPT = "Tides rise and fall twice a day by the harbour wall."  # 51 byte tokens: three full pages of 16
ROUNDS = 4
SETTLE_S = 10.0  # threads that end after close() get this long to be gone


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    shared = MemoryStore()
    monkeypatch.setattr(engine_module, "open_store", lambda url, timeout_s: shared)
    return shared


@pytest.fixture(autouse=True)
def earlier_threads() -> None:
    """Tier threads another test left running are not this test's to judge."""
    EARLIER.clear()
    EARLIER.update(t.ident for t in threading.enumerate())


EARLIER: set[int | None] = set()


def _tier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvforge-tier") and t.ident not in EARLIER]


def _settled(refs: list[weakref.ref]) -> tuple[list[threading.Thread], list[object]]:
    """After gc, wait (bounded) for this test's tier threads to end; what is still alive then."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        gc.collect()
        threads, alive = _tier_threads(), [r() for r in refs if r() is not None]
        if (not threads and not alive) or time.monotonic() > deadline:
            return threads, alive
        del alive
        time.sleep(0.05)


def _make(engine_dir: Path, **options: object) -> LLM:
    return LLM(str(engine_dir), num_threads=1, enable_context_reuse=True, **options)


def _refs(llm: LLM) -> list[weakref.ref]:
    refs: list[weakref.ref] = [weakref.ref(llm.engine), weakref.ref(llm.engine.backend)]
    if llm.engine.tier is not None:
        refs.append(weakref.ref(llm.engine.tier))
    return refs


def test_dropped_llms_with_a_shared_tier_free_everything(tiny_engine_dir: Path, store: MemoryStore) -> None:
    refs: list[weakref.ref] = []
    answers = []
    for _ in range(ROUNDS):
        llm = _make(tiny_engine_dir, shared_cache=URL)
        assert _tier_threads(), "the tier should run its workers while the LLM lives"
        [out] = llm.generate(PROMPT, GREEDY)
        answers.append(out.token_ids)
        refs += _refs(llm)
        del llm, out  # dropped without close(): the way a script or a notebook cell lets go of it
    threads, alive = _settled(refs)
    assert not threads, f"tier threads outlived their LLMs: {[t.name for t in threads]}"
    assert not alive, f"objects outlived their LLMs: {sorted({type(o).__name__ for o in alive})}"
    assert all(a == answers[0] for a in answers)  # the later LLMs read the tier; the answer never changes
    assert store.data, "the dropped LLMs' pages should have been saved to the tier"


def test_with_block_and_close_are_final_and_idempotent(tiny_engine_dir: Path, store: MemoryStore) -> None:
    with _make(tiny_engine_dir, shared_cache=URL) as llm:
        [out] = llm.generate(PROMPT, GREEDY)
        refs = _refs(llm)
    assert out.token_ids
    assert not _tier_threads(), "leaving the with block should stop the tier's threads"
    llm.close()  # a second close is a no-op, not an error
    llm.close()
    del llm
    threads, alive = _settled(refs)
    assert not threads and not alive


def test_dropped_llms_without_a_tier_free_the_engine(tiny_engine_dir: Path) -> None:
    refs: list[weakref.ref] = []
    for _ in range(2):
        llm = _make(tiny_engine_dir)
        llm.generate(PROMPT, GREEDY)
        refs += _refs(llm)
        del llm
    _, alive = _settled(refs)
    assert not alive


def test_an_engine_given_by_the_caller_stays_open_when_the_llm_is_dropped(tiny_engine_dir: Path,
                                                                         store: MemoryStore) -> None:
    owner = _make(tiny_engine_dir, shared_cache=URL)
    borrower = LLM(str(tiny_engine_dir), engine=owner.engine)
    del borrower
    gc.collect()
    assert _tier_threads(), "dropping an LLM must not close an engine it was lent"
    [out] = owner.generate(PROMPT, GREEDY)
    assert out.token_ids
    owner.close()
    assert not _tier_threads()
