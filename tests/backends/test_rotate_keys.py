"""K re-rotation (issue 37): K computed at position p, rotated by delta, is K computed at p + delta up to the storage
dtype's rounding, for fp16 and fp8 pools, full and partial rotary; and a pool's copy_rotated moves pages so."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.contract.rope import rope_table
from kvforge.plugins.reference import apply_rope, from_storage, rotate_keys, to_storage
from kvforge.runtime.execution.kv_store import KVStore

HEADS, HEAD_DIM, CAPACITY, THETA = 2, 16, 512, 10000.0
# Mantissa bits and smallest normal exponent of each storage dtype: a value's rounding step (one ulp).
FORMATS = {"fp16": (10, -14), "fp8": (3, -6)}


def ulp(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    mantissa, min_exponent = FORMATS[kv_cache_dtype]
    exponent = np.maximum(np.floor(np.log2(np.maximum(np.abs(x), 1e-30))), min_exponent)
    return np.exp2(exponent - mantissa)


def keys_at(raw: np.ndarray, positions: np.ndarray, cos_sin: np.ndarray) -> np.ndarray:
    """Float K [n, heads, D] of the same raw keys rotated at `positions` (what PagedKVWrite computes)."""
    return apply_rope(raw, cos_sin, positions)


def within_one_rounding(at_p: np.ndarray, moved: np.ndarray, direct: np.ndarray, rotary_dim: int,
                        kv_cache_dtype: str) -> bool:
    """Whether K rotated from the stored K at p (`at_p`, decoded) equals K stored at p + delta up to one rounding
    each: the stored input's (half an ulp per value of a rotated pair, carried through the rotation) and each
    side's own output rounding (half an ulp)."""
    half = rotary_dim // 2
    pair_ulp = np.maximum(ulp(at_p[..., :half], kv_cache_dtype), ulp(at_p[..., half:rotary_dim], kv_cache_dtype))
    # A pair error (e1, e2), each at most half an ulp, rotated: e1 cos - e2 sin is at most sqrt(2) half ulps.
    input_error = np.concatenate([pair_ulp, pair_ulp, np.zeros_like(at_p[..., rotary_dim:])], axis=-1) * 2 ** -0.5
    bound = input_error + (ulp(moved, kv_cache_dtype) + ulp(direct, kv_cache_dtype)) / 2
    return bool(np.all(np.abs(moved - direct) <= bound * (1 + 1e-3)))


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "fp8"])
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2])
@pytest.mark.parametrize("delta", [1, 37, 300, -5])
def test_rotating_k_at_p_by_delta_is_k_at_p_plus_delta(kv_cache_dtype: str, rotary_dim: int, delta: int) -> None:
    rng = np.random.default_rng(abs(delta) * 7 + rotary_dim)
    cos_sin = rope_table(CAPACITY, rotary_dim, THETA)
    positions = np.arange(10, 42)
    raw = rng.standard_normal((len(positions), HEADS, HEAD_DIM)).astype(np.float32) * 3
    stored_at_p = to_storage(keys_at(raw, positions, cos_sin), kv_cache_dtype)
    moved = from_storage(rotate_keys(stored_at_p, delta, cos_sin, kv_cache_dtype, rotary_dim), kv_cache_dtype)
    direct = from_storage(to_storage(keys_at(raw, positions + delta, cos_sin), kv_cache_dtype), kv_cache_dtype)
    at_p = from_storage(stored_at_p, kv_cache_dtype)
    assert within_one_rounding(at_p, moved, direct, rotary_dim, kv_cache_dtype)
    # Most elements land on the very value a computation at p + delta stores.
    assert np.mean(moved == direct) > 0.5
    # Partial rotary: the dims past rotary_dim do not depend on the position and pass bit for bit.
    assert np.array_equal(moved[..., rotary_dim:], at_p[..., rotary_dim:])
    # A test that could fail: without the rotation, K at p is not K at p + delta.
    assert not np.allclose(at_p[..., :rotary_dim], direct[..., :rotary_dim], atol=0.05)


def test_rotation_composes_in_float32() -> None:
    """In fp32 storage the rotation is the rope table's own precision: rotating by a then b is rotating by a + b."""
    cos_sin = rope_table(CAPACITY, HEAD_DIM, THETA)
    raw = np.random.default_rng(0).standard_normal((8, HEADS, HEAD_DIM)).astype(np.float32)
    k0 = keys_at(raw, np.zeros(8, dtype=np.int64), cos_sin)
    twice = rotate_keys(rotate_keys(k0, 100, cos_sin, "fp32"), 23, cos_sin, "fp32")
    np.testing.assert_allclose(twice, keys_at(raw, np.full(8, 123), cos_sin), atol=2e-5)
    np.testing.assert_allclose(rotate_keys(twice, -123, cos_sin, "fp32"), k0, atol=2e-5)


def test_bad_rotations_are_refused() -> None:
    cos_sin = rope_table(16, HEAD_DIM, THETA)
    k = np.zeros((1, HEADS, HEAD_DIM), dtype=np.float16)
    with pytest.raises(ValueError, match="past the rope table"):
        rotate_keys(k, 16, cos_sin, "fp16")
    with pytest.raises(ValueError, match="does not match the rope table"):
        rotate_keys(k, 1, cos_sin, "fp16", rotary_dim=HEAD_DIM // 2)


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "fp8"])
def test_copy_rotated_moves_pages_on_a_pool(kv_cache_dtype: str) -> None:
    """A document's two pages written at positions [0, 8) are copied to pages 5 and 6 as if written at [24, 32)."""
    tokens_per_page, delta = 4, 24
    cos_sin = rope_table(64, HEAD_DIM, THETA)
    store = KVStore(2, 8, HEADS, tokens_per_page, HEAD_DIM, kv_cache_dtype)
    rng = np.random.default_rng(1)
    raw_k = rng.standard_normal((2, 8, HEADS, HEAD_DIM)).astype(np.float32)
    values = rng.standard_normal((2, 8, HEADS, HEAD_DIM)).astype(np.float32)
    pages, slots = store.locate([1, 2], 0, 8)
    for layer in range(2):
        k = keys_at(raw_k[layer], np.arange(8), cos_sin)
        store.scatter(layer, np.stack([k, values[layer]], axis=1), pages, slots)
    before = [layer.copy() for layer in store.layers]
    store.copy_rotated([1, 2], [5, 6], delta, cos_sin)
    for layer in range(2):
        moved = from_storage(store.read_tokens([5, 6], 8)[layer], kv_cache_dtype)  # [8, 2, Hkv, D]
        at_p = from_storage(store.read_tokens([1, 2], 8)[layer], kv_cache_dtype)
        direct = round_trip(keys_at(raw_k[layer], np.arange(8) + delta, cos_sin), kv_cache_dtype)
        assert within_one_rounding(at_p[:, 0], moved[:, 0], direct, HEAD_DIM, kv_cache_dtype)
        assert not np.array_equal(moved[:, 0], at_p[:, 0])  # K did move
        assert np.array_equal(store.read_tokens([5, 6], 8)[layer][:, 1], store.read_tokens([1, 2], 8)[layer][:, 1])
        # The sources and every other page are untouched.
        untouched = [0, 1, 2, 3, 4, 7]
        assert np.array_equal(store.layers[layer][untouched], before[layer][untouched])
    with pytest.raises(ValueError, match="destinations"):
        store.copy_rotated([1], [5, 6], delta, cos_sin)


def round_trip(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    return from_storage(to_storage(x, kv_cache_dtype), kv_cache_dtype)
