"""kvforge.cpu.PagedAttentionRope (RoPE and the K/V write inside the kernel) against the numpy reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from support.ort_support import random_tree, rope_attention_session

from kvforge.plugins import reference
from kvforge.plugins.reference import pool_numpy_dtype, rope_table, to_storage

TOLERANCE = 1e-5


@dataclass
class Case:
    starts: list[int]
    lengths: list[int]
    seq: int
    dtype: str = "fp16"
    num_q: int = 6
    num_kv: int = 2
    head_dim: int = 64
    rotary: int = 64  # < head_dim: partial rotary (Qwen3.5)
    tokens_per_page: int = 16
    tree: bool = False  # explicit positions and a tree mask
    hole: bool = False  # one new position of row 0 has no page (-1): not written, still attended
    seed: int = 0


def _session(case: Case, library: Path) -> ort.InferenceSession:
    return rope_attention_session(library, num_q=case.num_q, num_kv=case.num_kv, head_dim=case.head_dim,
                                  tokens_per_page=case.tokens_per_page, dtype=case.dtype, tree=case.tree,
                                  rotary=case.rotary)


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
    if case.hole:  # the page of row 0's last new position
        table[0, (case.starts[0] + case.lengths[0] - 1) // t] = -1
    feeds = {
        "query": rng.standard_normal((batch, case.seq, case.num_q * d)).astype(np.float32),
        "key": rng.standard_normal((batch, case.seq, case.num_kv * d)).astype(np.float32),
        "value": (3 * rng.standard_normal((batch, case.seq, case.num_kv * d))).astype(np.float32),
        "pool": to_storage(rng.standard_normal((num_pages, 2, case.num_kv, t, d)).astype(np.float32),
                           case.dtype).astype(pool_numpy_dtype(case.dtype)),
        "kv_page_table": table,
        "kvcache_start_index": np.array(case.starts, dtype=np.int32),
        "context_lengths": np.array(case.lengths, dtype=np.int32),
        "rope_rotary_cos_sin": rope_table(max(case.starts) + case.seq + 8, case.rotary, 10000.0),
    }
    if case.tree:  # each node's parent comes before it; its RoPE position is start + its depth - 1
        feeds.update(random_tree(rng, case.starts, case.seq))
    return feeds


def _run(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The pool is bound zero-copy, as the runtime binds it, so the kernel's write lands in this numpy array."""
    pool = feeds["pool"].copy()
    binding = session.io_binding()
    for name, value in feeds.items():
        if name == "pool":
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(pool))
        else:
            binding.bind_cpu_input(name, value)
    binding.bind_output("out", "cpu")
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0], pool


def _expected(case: Case, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return reference.paged_attention_rope(
        feeds["query"], feeds["key"], feeds["value"], feeds["pool"], feeds["kv_page_table"],
        feeds["kvcache_start_index"], feeds["context_lengths"], feeds["rope_rotary_cos_sin"],
        num_q_heads=case.num_q, num_kv_heads=case.num_kv, head_dim=case.head_dim,
        scale=float(case.head_dim) ** -0.5, kv_cache_dtype=case.dtype, position_ids=feeds.get("position_ids"),
        attention_mask=feeds.get("attention_mask"))


CASES = {
    "decode-fp16": Case(starts=[37, 5], lengths=[1, 1], seq=1),
    "decode-fp8": Case(starts=[37, 5], lengths=[1, 1], seq=1, dtype="fp8"),
    "prefill-fp32-padded": Case(starts=[0, 20], lengths=[30, 11], seq=30, dtype="fp32"),
    "chunk-fp16-cross-page": Case(starts=[13, 40], lengths=[9, 4], seq=9),
    "tree-fp16": Case(starts=[21, 3], lengths=[7, 5], seq=7, tree=True),
    "tree-fp8": Case(starts=[21, 3], lengths=[7, 5], seq=7, dtype="fp8", tree=True),
    "partial-rotary-fp16": Case(starts=[17], lengths=[3], seq=3, rotary=16),
    "partial-rotary-fp8-tree": Case(starts=[17], lengths=[4], seq=4, dtype="fp8", rotary=32, tree=True),
    "gqa-128-hole": Case(starts=[30], lengths=[5], seq=5, num_q=8, num_kv=1, head_dim=128, rotary=128, hole=True),
    # Gemma 4's global layers: 512-wide heads turned by a 256-wide table (the runtime's one table, partial rotary)
    "gemma4-global-512": Case(starts=[17, 2], lengths=[3, 1], seq=3, num_q=2, num_kv=1, head_dim=512, rotary=256),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name: str, library: Path) -> None:
    case = CASES[name]
    feeds = _feeds(case)
    out, pool = _run(_session(case, library), feeds)
    want_out, want_pool = _expected(case, feeds)
    np.testing.assert_allclose(out, want_out, atol=TOLERANCE, rtol=TOLERANCE)
    # The write is exact: the same float32 products as numpy, the same round-to-nearest-even storage encoding.
    np.testing.assert_array_equal(pool, want_pool)
    assert not np.array_equal(pool, feeds["pool"])  # the kernel wrote through the bound pool


def test_write_and_rotation_equal_the_separate_ops(library: Path) -> None:
    """The fused op equals what the graph did before: PagedKVWrite's rotated rows in the pool, then
    PagedAttention over the rotated queries."""
    case = Case(starts=[19, 0], lengths=[2, 6], seq=6)
    feeds = _feeds(case)
    out, pool = _run(_session(case, library), feeds)
    cos_sin = feeds["rope_rotary_cos_sin"]
    positions = np.asarray(case.starts)[:, None] + np.arange(case.seq)[None, :]
    query = reference.apply_rope(feeds["query"].reshape(2, case.seq, case.num_q, case.head_dim), cos_sin,
                                 np.minimum(positions, len(cos_sin) - 1)).reshape(2, case.seq, -1)
    written = reference.paged_kv_write(feeds["key"], feeds["value"], cos_sin, feeds["context_lengths"],
                                       feeds["kvcache_start_index"], feeds["kv_page_table"], feeds["pool"],
                                       num_kv_heads=case.num_kv, head_dim=case.head_dim, kv_cache_dtype=case.dtype)
    np.testing.assert_array_equal(pool, written)
    want = reference.paged_attention(query, written, feeds["context_lengths"], feeds["kvcache_start_index"],
                                     feeds["kv_page_table"], num_q_heads=case.num_q, num_kv_heads=case.num_kv,
                                     head_dim=case.head_dim, scale=float(case.head_dim) ** -0.5,
                                     kv_cache_dtype=case.dtype)
    np.testing.assert_allclose(out, want, atol=TOLERANCE, rtol=TOLERANCE)


def test_page_outside_the_pool_is_refused(library: Path) -> None:
    """A write target past the pool would corrupt memory: refused with the entry named."""
    case = Case(starts=[3], lengths=[2], seq=2)
    feeds = _feeds(case)
    feeds["kv_page_table"][0, 0] = len(feeds["pool"])
    with pytest.raises(Exception, match=r"kv_page_table\[0,0\]"):
        _run(_session(case, library), feeds)


def test_storage_rounding_saturates_fp8(library: Path) -> None:
    """Values past E4M3's range saturate to +-448 in the pool (as reference.to_storage), never NaN."""
    case = Case(starts=[0], lengths=[4], seq=4, dtype="fp8")
    feeds = _feeds(case)
    feeds["value"] *= 400.0
    out, pool = _run(_session(case, library), feeds)
    want_out, want_pool = _expected(case, feeds)
    np.testing.assert_array_equal(pool, want_pool)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want_out, atol=1e-3, rtol=TOLERANCE)


def test_every_runnable_target_matches_reference(library: Path, each_target) -> None:
    """Each compiled target this CPU runs, forced in turn: the same output (to tolerance) and pool bytes."""
    for target in each_target():
        for name in ("decode-fp8", "tree-fp16", "partial-rotary-fp8-tree", "gqa-128-hole"):
            case = CASES[name]
            feeds = _feeds(case)
            out, pool = _run(_session(case, library), feeds)
            want_out, want_pool = _expected(case, feeds)
            np.testing.assert_allclose(out, want_out, atol=TOLERANCE, rtol=TOLERANCE, err_msg=f"{target} {name}")
            np.testing.assert_array_equal(pool, want_pool)
