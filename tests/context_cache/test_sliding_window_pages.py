"""The sliding-window page group as a cache type, no model: a row's window table covers exactly what its next call
reads and writes, pages out of the window go back to the group, and the audit agrees with the pools."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.contract.paging import pages_for
from kvforge.contract.profile_schema import RESOURCE_POOLS, SLIDING_WINDOW_PAGES
from kvforge.contract.window_pool import window_pages_per_row
from kvforge.runtime.context_cache.manager import Admission, ContextCacheManager
from kvforge.runtime.context_cache.types.sliding_window import NO_PAGE, window_table
from kvforge.runtime.execution.kv_store import KVStore

T, WINDOW, CALL = 4, 10, 8  # tokens per page, the window, the most new tokens of a row per call


def manager(window_pages: int, num_pages: int = 64) -> ContextCacheManager:
    return ContextCacheManager(num_pages, T, enabled=False, sliding_window=WINDOW, sliding_window_pages=window_pages,
                               sliding_window_call_tokens=CALL)


def needed(computed: int, extent: int) -> set[int]:
    """Logical pages a call computing [computed, extent) reads or writes: the window before it, then its own."""
    first = max(computed - WINDOW + 1, 0)
    return set(range(first // T, pages_for(extent, T)))


def kept(computed: int, extent: int) -> set[int]:
    """What the type keeps for that call: from the window of the last page boundary at or before `computed` (what a
    checkpoint there needs), through the call's own pages."""
    boundary = computed // T * T
    return set(range(max(boundary - WINDOW + 1, 0) // T, pages_for(extent, T)))


def run_row(cache: ContextCacheManager, prompt: int, chunks: list[int]) -> tuple[object, int]:
    """Admit a row and compute its first call, then each chunk as the scheduler would (grow, then run)."""
    lease = cache.try_acquire(Admission(list(range(prompt))))
    assert lease is not None
    computed = min(prompt, CALL)
    table = window_table(lease)
    assert table is not None and all(p != NO_PAGE for p in table[:pages_for(computed, T)])
    for step, count in enumerate(chunks):
        assert cache.try_grow(lease, computed + count)
        table = window_table(lease)
        held = {p for p, slot in enumerate(table) if slot != NO_PAGE}
        # Exactly the call's pages: after the first growth the row's position is known; at the first, the type
        # knows only that the call gives it at most CALL tokens.
        known = computed if step else max(computed + count - CALL, 0)
        assert needed(computed, computed + count) <= held == kept(known, computed + count)
        computed += count
        cache.check_invariants()
    return lease, computed


def test_decode_holds_only_the_window_and_gives_pages_back() -> None:
    cache = manager(window_pages=8)
    lease, computed = run_row(cache, 8, [1] * 60)
    held = [slot for slot in window_table(lease) if slot != NO_PAGE]
    assert len(held) <= pages_for(WINDOW, T) + 1  # the ceil(window / page) + 1 once decoding
    assert cache.pools[SLIDING_WINDOW_PAGES].num_free == 8 - len(held)
    cache.release(lease)
    cache.check_invariants()
    assert cache.pools[SLIDING_WINDOW_PAGES].num_free == 8
    assert cache.profile()[RESOURCE_POOLS][SLIDING_WINDOW_PAGES] == {"free": 8, "capacity": 8}


def test_a_row_never_needs_more_than_the_built_group() -> None:
    """Two rows at their worst (a full call each) fit in the group llm_build sizes for two rows."""
    per_row = window_pages_per_row(WINDOW, T, CALL, 1 << 30)
    cache = manager(window_pages=2 * per_row)
    first = cache.try_acquire(Admission(list(range(40))))
    second = cache.try_acquire(Admission(list(range(40))))
    assert first is not None and second is not None
    for computed in range(CALL, 40 - CALL, CALL):
        assert cache.try_grow(first, computed + CALL) and cache.try_grow(second, computed + CALL)
        cache.check_invariants()


def test_no_group_without_window_pages() -> None:
    cache = ContextCacheManager(64, T, enabled=False)
    lease = cache.try_acquire(Admission(list(range(12))))
    assert lease is not None and window_table(lease) is None
    assert cache.profile()[RESOURCE_POOLS][SLIDING_WINDOW_PAGES] == {"free": 0, "capacity": 0}


@settings(max_examples=60, deadline=None)
@given(prompt=st.integers(1, 40), chunks=st.lists(st.integers(1, CALL), max_size=30),
       others=st.lists(st.tuples(st.integers(1, 30), st.lists(st.integers(1, CALL), max_size=8)), max_size=3))
def test_any_schedule_keeps_the_window_and_the_audit(prompt: int, chunks: list[int],
                                                     others: list[tuple[int, list[int]]]) -> None:
    """Rows admitted and grown in any chunks (each at most one call's tokens): every call's pages are there, every
    page outside the rows' windows is free, and releasing every row empties the group."""
    per_row = window_pages_per_row(WINDOW, T, CALL, 1 << 30)
    cache = manager(window_pages=(len(others) + 1) * per_row)
    leases = [run_row(cache, prompt, chunks)[0]]
    leases += [run_row(cache, length, steps)[0] for length, steps in others]
    for lease in leases:
        assert len([s for s in window_table(lease) if s != NO_PAGE]) <= per_row
        cache.release(lease)
    cache.check_invariants()
    assert cache.pools[SLIDING_WINDOW_PAGES].num_free == cache.pools[SLIDING_WINDOW_PAGES].capacity


# --- reuse: records keep the window before their endpoint ------------------------------------------------------


class WindowStore:
    """The sliding pool's contents: (slot, offset) -> the token whose K/V is there. A call checks that every key it
    reads (the window before its first position) is the input's own token at that position: a hit is exact
    exactly when this holds."""

    def __init__(self) -> None:
        self.cells: dict[tuple[int, int], int] = {}

    def compute(self, lease: object, ids: list[int], start: int, end: int) -> None:
        table = window_table(lease)
        for pos in range(max(start - WINDOW + 1, 0), end):
            slot = table[pos // T]
            assert slot != NO_PAGE, f"position {pos}'s page is not in the row's window table"
            if pos < start:
                assert self.cells.get((slot, pos % T)) == ids[pos], f"position {pos} holds another token"
            else:
                self.cells[slot, pos % T] = ids[pos]


def serve(cache: ContextCacheManager, store: WindowStore, ids: list[int], generate: list[int]) -> int:
    """One request as the scheduler runs it: admit, compute in calls of at most CALL tokens, publish the prompt,
    decode `generate` one token a call, publish the whole sequence, release. Returns the tokens reused."""
    lease = cache.try_acquire(Admission(list(ids)))
    assert lease is not None
    computed = lease.reuse_tokens
    first = min(len(ids) - computed, CALL)
    store.compute(lease, ids, computed, computed + first)
    computed += first
    while computed < len(ids):
        count = min(len(ids) - computed, CALL)
        assert cache.try_grow(lease, computed + count)
        store.compute(lease, ids, computed, computed + count)
        computed += count
        cache.check_invariants()
    cache.publish(lease, ids)
    whole = list(ids)
    for token in generate:
        whole.append(token)
        assert cache.try_grow(lease, computed + 1)
        store.compute(lease, whole, computed, computed + 1)
        computed += 1
    cache.publish(lease, whole)
    cache.release(lease)
    cache.check_invariants()
    return lease.reuse_tokens


def reuse_manager(window_pages: int) -> ContextCacheManager:
    return ContextCacheManager(64, T, enabled=True, sliding_window=WINDOW, sliding_window_pages=window_pages,
                               sliding_window_call_tokens=CALL)


def test_multi_turn_chat_hits_the_previous_turns_window() -> None:
    cache, store = reuse_manager(window_pages=3 * window_pages_per_row(WINDOW, T, CALL, 1 << 30)), WindowStore()
    first = list(range(100, 130))
    assert serve(cache, store, first, [7, 8, 9, 10, 11]) == 0
    second = first + [7, 8, 9, 10, 11] + list(range(200, 215))
    reused = serve(cache, store, second, [12, 13])
    assert reused == 32  # the deepest page boundary with a window: the first turn's end (35 tokens) rounded down
    profile = cache.profile()
    assert profile["sliding_window"]["hits"] == 1 and profile["hit_sequences"] == 1


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(st.integers(1, 25), st.integers(0, 6), st.booleans()), min_size=1, max_size=6),
       spare=st.integers(0, 6))
def test_any_conversation_reuses_only_exact_windows(turns: list[tuple[int, int, bool]], spare: int) -> None:
    """Conversations that extend (or restart) in any way, in a group with little room besides one row: every
    key a call reads is its own input's, and the audit holds after every step (evictions included)."""
    cache = reuse_manager(window_pages=window_pages_per_row(WINDOW, T, CALL, 1 << 30) + spare)
    store, history, salt = WindowStore(), [], 1000
    for new, generated, restart in turns:
        if restart:
            history, salt = [], salt + 100
        ids = history + [salt + i for i in range(new)]
        answer = [salt + 50 + i for i in range(generated)]
        serve(cache, store, ids, answer)
        history = ids + answer
    reclaimed = cache.profile()["reclaimed_resources"][SLIDING_WINDOW_PAGES]
    assert reclaimed >= 0


def test_the_pool_refuses_one_table_copies_over_a_window_group() -> None:
    """A snapshot, tier or tree copy addresses every layer with one row of page ids: wrong for a window group."""
    store = KVStore(3, 8, 1, T, 4, "fp32", groups={"window": ({0, 1}, 3)})
    assert [len(layer) for layer in store.layers] == [3, 3, 8]
    for copy in (lambda: store.read_tokens([0], 2), lambda: store.read_page(0),
                 lambda: store.copy_positions([0], [1], [0])):
        with pytest.raises(AssertionError, match=r"another page group \(window\)"):
            copy()
    plain = KVStore(2, 8, 1, T, 4, "fp32")
    assert len(plain.read_page(1)) == 2


def test_page_groups_are_data_a_third_group_included() -> None:
    """The pool sizes each group's layers by its entry, and the cache hands each group's table from its owner."""
    store = KVStore(4, 8, 1, T, 4, "fp32", groups={"window": ([0], 3), "chunked": ([2, 3], 5)})
    assert [len(layer) for layer in store.layers] == [3, 8, 5, 5]
    assert store.layer_group == ["window", None, "chunked", "chunked"]
    with pytest.raises(AssertionError, match=r"another page group \(chunked, window\)"):
        store.read_page(0)
    cache = manager(window_pages=8)
    lease = cache.try_acquire(Admission(list(range(12))))
    assert lease is not None and cache.page_tables(lease) == {"window": window_table(lease)}
    assert ContextCacheManager(8, T, enabled=False).page_tables(lease) == {}  # no type owns a group there
