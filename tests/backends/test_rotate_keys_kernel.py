"""The CPU kernel library's K re-rotation (kvforge_rotate_keys, issue 37) writes the numpy reference's bytes, so a
document restored through it is the document restored through numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvforge.contract.rope import rope_table
from kvforge.plugins import cpu_kernel
from kvforge.plugins.reference import rotate_keys, to_storage
from kvforge.runtime.execution.kv_store import KVStore, moved_keys

HEAD_DIM, CAPACITY, THETA = 64, 512, 10000.0


def stored_keys(shape: tuple[int, ...], kv_cache_dtype: str, seed: int) -> np.ndarray:
    """Keys in the storage dtype, some large enough that fp8 saturates at +-448 once rotated."""
    rng = np.random.default_rng(seed)
    raw = rng.standard_normal(shape).astype(np.float32) * 3
    raw.reshape(-1)[:: 7] *= 140  # ~420: a rotation can carry a pair past fp8's largest value
    return to_storage(raw, kv_cache_dtype)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "fp8", "fp32"])
@pytest.mark.parametrize("rotary", [HEAD_DIM, HEAD_DIM // 2])
@pytest.mark.parametrize("delta", [1, 37, 300, -5])
def test_kernel_rotation_is_the_reference_byte_for_byte(library: Path, kv_cache_dtype: str, rotary: int,
                                                        delta: int) -> None:
    del library  # built: the rotation runs in it, not in the numpy fallback
    cos_sin = rope_table(CAPACITY, rotary, THETA)
    for shape, seed in (((7, 3, HEAD_DIM), 0), ((1, HEAD_DIM), 1), ((5, 2, 3, HEAD_DIM), 2)):  # 21, 1, 30 rows
        keys = stored_keys(shape, kv_cache_dtype, seed)
        before = keys.copy()
        moved = cpu_kernel.rotate_keys(keys, delta, cos_sin, kv_cache_dtype)
        assert moved is not None
        assert same_bytes(moved, rotate_keys(keys, delta, cos_sin, kv_cache_dtype)), (shape, kv_cache_dtype)
        assert same_bytes(keys, before)  # the input is not touched
        assert not same_bytes(moved, keys)


def test_strided_input_and_a_round_trip(library: Path) -> None:
    """A strided view (a pool's K half) is rotated as its values, and moving by d then -d is near the start."""
    del library
    cos_sin = rope_table(CAPACITY, HEAD_DIM, THETA)
    unit = np.random.default_rng(3).standard_normal((4, 2, 2, 8, HEAD_DIM)).astype(np.float32)
    pages = to_storage(unit, "fp16")  # [pages, K/V, Hkv, T, D], unit scale: the round trip is within fp16 steps
    view = pages[:, 0, :, ::3]
    moved = cpu_kernel.rotate_keys(view, 37, cos_sin, "fp16")
    assert moved is not None and same_bytes(moved, rotate_keys(view, 37, cos_sin, "fp16"))
    back = cpu_kernel.rotate_keys(moved, -37, cos_sin, "fp16")
    assert back is not None
    np.testing.assert_allclose(back.astype(np.float32), view.astype(np.float32), rtol=5e-3, atol=5e-3)


def test_switch_off_keeps_the_numpy_path(library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    del library
    cos_sin = rope_table(CAPACITY, HEAD_DIM, THETA)
    keys = stored_keys((6, HEAD_DIM), "fp8", 4)
    monkeypatch.setenv(cpu_kernel.SWITCH_ENV, "off")
    assert cpu_kernel.rotate_keys(keys, 5, cos_sin, "fp8") is None
    assert same_bytes(moved_keys(keys, 5, cos_sin, "fp8"), rotate_keys(keys, 5, cos_sin, "fp8"))


def test_arguments_it_does_not_take_fall_back_to_the_reference(library: Path) -> None:
    """A float64 table, a delta past the table or a table wider than the head: None, and the reference decides
    (computes, or raises its one-line error)."""
    del library
    keys = stored_keys((3, HEAD_DIM), "fp16", 5)
    assert cpu_kernel.rotate_keys(keys, 2, rope_table(CAPACITY, HEAD_DIM, THETA).astype(np.float64), "fp16") is None
    assert cpu_kernel.rotate_keys(keys, CAPACITY, rope_table(CAPACITY, HEAD_DIM, THETA), "fp16") is None
    wide = rope_table(CAPACITY, 2 * HEAD_DIM, THETA)
    assert cpu_kernel.rotate_keys(keys, 2, wide, "fp16") is None
    with pytest.raises(ValueError, match="fit the head"):
        moved_keys(keys, 2, wide, "fp16")


@pytest.mark.parametrize("kv_cache_dtype", ["fp16", "fp8"])
def test_copy_rotated_pages_match_with_the_kernel_on_and_off(library: Path, monkeypatch: pytest.MonkeyPatch,
                                                             kv_cache_dtype: str) -> None:
    del library
    cos_sin = rope_table(CAPACITY, HEAD_DIM, THETA)
    pools = []
    for switch in ("on", "off"):
        monkeypatch.setenv(cpu_kernel.SWITCH_ENV, switch)
        store = KVStore(2, 6, 2, 4, HEAD_DIM, kv_cache_dtype)
        for index, layer in enumerate(store.layers):
            layer[...] = stored_keys(layer.shape, kv_cache_dtype, 10 + index)
        store.copy_rotated([0, 1], [3, 4], 8, cos_sin)
        pools.append([layer.copy() for layer in store.layers])
    for on, off in zip(*pools, strict=True):
        assert same_bytes(on, off)
