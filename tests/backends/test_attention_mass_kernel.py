"""The attention-mass output of kvforge.cpu.PagedAttentionRope (issue 53, cpu/attention_mass.cc) against the numpy
reference (reference.attention_mass), on every target this CPU runs, and what arming it must not change."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from support.ort_support import random_tree, rope_attention_session

from kvforge.plugins import reference
from kvforge.plugins.attention_mass import AttentionMassMeter, attention_mass_meter
from kvforge.plugins.reference import pool_numpy_dtype, rope_table, to_storage

TOLERANCE = 2e-5


@dataclass
class Case:
    starts: list[int]
    lengths: list[int]
    seq: int
    query_from: list[int]  # per row: the first watched query position (past the row's end: not watched)
    dtype: str = "fp16"
    num_q: int = 6
    num_kv: int = 2
    head_dim: int = 64
    tokens_per_page: int = 16
    tree: bool = False
    hole: bool = False  # one cached page of row 0 is missing (-1): its positions are invisible, get no mass
    seed: int = 0


CASES = {
    "question-chunk-fp16": Case(starts=[40, 7], lengths=[9, 5], seq=9, query_from=[43, 100]),
    "both-rows-fp8": Case(starts=[21, 3], lengths=[6, 6], seq=6, query_from=[21, 5], dtype="fp8"),
    "prefill-fp32-from-0": Case(starts=[0], lengths=[30], seq=30, query_from=[12], dtype="fp32"),
    "tree-fp16": Case(starts=[21, 3], lengths=[7, 5], seq=7, query_from=[21, 3], tree=True),
    "gqa-128-hole": Case(starts=[36], lengths=[5], seq=5, query_from=[36], num_q=8, num_kv=1, head_dim=128,
                         hole=True),
}


def _session(case: Case, library: Path) -> ort.InferenceSession:
    return rope_attention_session(library, num_q=case.num_q, num_kv=case.num_kv, head_dim=case.head_dim,
                                  tokens_per_page=case.tokens_per_page, dtype=case.dtype, tree=case.tree)


def _feeds(case: Case) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(case.seed)
    batch, t, d = len(case.starts), case.tokens_per_page, case.head_dim
    pages = [-(-(s + n) // t) for s, n in zip(case.starts, case.lengths, strict=True)]
    num_pages = sum(pages) + 2
    order = rng.permutation(num_pages)
    table = np.full((batch, max(pages)), -1, dtype=np.int32)
    used = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[used:used + count]
        used += count
    if case.hole:
        table[0, 1] = -1
    feeds = {
        # Scaled so the softmax is far from uniform (a wrong position or head shows).
        "query": (2 * rng.standard_normal((batch, case.seq, case.num_q * d))).astype(np.float32),
        "key": (2 * rng.standard_normal((batch, case.seq, case.num_kv * d))).astype(np.float32),
        "value": rng.standard_normal((batch, case.seq, case.num_kv * d)).astype(np.float32),
        "pool": to_storage(2 * rng.standard_normal((num_pages, 2, case.num_kv, t, d)).astype(np.float32),
                           case.dtype).astype(pool_numpy_dtype(case.dtype)),
        "kv_page_table": table,
        "kvcache_start_index": np.array(case.starts, dtype=np.int32),
        "context_lengths": np.array(case.lengths, dtype=np.int32),
        "rope_rotary_cos_sin": rope_table(max(case.starts) + case.seq + 8, d, 10000.0),
    }
    if case.tree:
        feeds.update(random_tree(rng, case.starts, case.seq))
    return feeds


def _positions(case: Case) -> int:
    return max(s + n for s, n in zip(case.starts, case.lengths, strict=True)) + 3


def _run(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> np.ndarray:
    pool = feeds["pool"].copy()  # bound zero-copy, as the runtime binds it: the kernel writes the new rows
    binding = session.io_binding()
    for name, value in feeds.items():
        if name == "pool":
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(pool))
        else:
            binding.bind_cpu_input(name, value)
    binding.bind_output("out", "cpu")
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


def _meter() -> AttentionMassMeter:
    meter, reason = attention_mass_meter()
    assert meter is not None, reason
    return meter


def _measure(case: Case, library: Path, calls: int = 1) -> tuple[np.ndarray, list[int], np.ndarray]:
    """The kernel's mass per row ([B, positions], one watch per row on its question page), the rows each watch
    summed, and the attention output (of the last call)."""
    meter, feeds, session = _meter(), _feeds(case), _session(case, library)
    t, table = case.tokens_per_page, feeds["kv_page_table"]
    watches = [meter.watch(int(table[b, q // t]), q // t, q, _positions(case)) if q // t < table.shape[1] and
               table[b, q // t] >= 0 else None for b, q in enumerate(case.query_from)]
    try:
        for _ in range(calls):
            out = _run(session, feeds)
    finally:
        readings = [None if w is None else meter.read(w) for w in watches]
    mass = np.stack([np.zeros(_positions(case), np.float32) if r is None else r.mass for r in readings])
    return mass, [0 if r is None else r.rows for r in readings], out


def _expected(case: Case) -> np.ndarray:
    feeds = _feeds(case)
    return reference.attention_mass(
        feeds["query"], feeds["key"], feeds["pool"], feeds["kv_page_table"], feeds["kvcache_start_index"],
        feeds["context_lengths"], feeds["rope_rotary_cos_sin"], np.array(case.query_from), _positions(case),
        num_q_heads=case.num_q, num_kv_heads=case.num_kv, head_dim=case.head_dim,
        scale=float(case.head_dim) ** -0.5, kv_cache_dtype=case.dtype, position_ids=feeds.get("position_ids"),
        attention_mask=feeds.get("attention_mask"))


@pytest.mark.parametrize("name", list(CASES))
def test_mass_matches_reference(name: str, library: Path) -> None:
    case = CASES[name]
    mass, rows, _ = _measure(case, library)
    want = _expected(case)
    np.testing.assert_allclose(mass, want, atol=TOLERANCE, rtol=TOLERANCE)
    for b, (start, length) in enumerate(zip(case.starts, case.lengths, strict=True)):
        watched = max(start + length - max(case.query_from[b], start), 0)
        # Normalisation: each watched (row, query head) softmax adds 1.
        assert rows[b] == watched * case.num_q
        assert mass[b].sum() == pytest.approx(watched * case.num_q, rel=1e-5)
        assert not mass[b, start + length:].any()  # nothing past the row's last position (causal)
    if case.hole:
        assert not mass[0, 16:32].any()  # the missing page's positions are invisible


def test_mass_adds_over_calls_and_arming_changes_no_output(library: Path) -> None:
    """Two calls (two layers) add up; the attention output with a watch armed is the output without one."""
    case = CASES["question-chunk-fp16"]
    once, rows_once, out_armed = _measure(case, library)
    twice, rows_twice, _ = _measure(case, library, calls=2)
    np.testing.assert_allclose(twice, 2 * once, rtol=1e-6)
    assert rows_twice == [2 * r for r in rows_once]
    plain = _run(_session(case, library), _feeds(case))
    np.testing.assert_array_equal(out_armed, plain)


def test_a_watch_sees_only_its_page_and_stops_when_read(library: Path) -> None:
    case = CASES["question-chunk-fp16"]
    meter, feeds, session = _meter(), _feeds(case), _session(case, library)
    free_page = int(np.setdiff1d(np.arange(len(feeds["pool"])), feeds["kv_page_table"])[0])
    other = meter.watch(free_page, 2, 40, _positions(case))  # a page no row holds
    assert other is not None
    _run(session, feeds)
    reading = meter.read(other)
    assert reading.rows == 0 and not reading.mass.any()
    assert meter.read(other).rows == 0  # reading again: already disarmed (the kernel answers -1)


def test_every_runnable_target_gives_the_reference_mass(library: Path, each_target) -> None:
    """The pass is not per target, but it runs inside the op each target dispatches: forced in turn (avx2 among
    them on this CPU), the same mass."""
    for target in each_target():
        for name in ("question-chunk-fp16", "tree-fp16", "gqa-128-hole"):
            mass, _, _ = _measure(CASES[name], library)
            np.testing.assert_allclose(mass, _expected(CASES[name]), atol=TOLERANCE, rtol=TOLERANCE,
                                       err_msg=f"{target} {name}")
