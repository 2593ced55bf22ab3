"""resolve_geometry: pool sizing defaults, explicit pools, and errors naming the llm_build flag at fault."""

from __future__ import annotations

import math

import pytest

from kvforge.builder.geometry import INT32_MAX, MAX_KV_POOL_PAGES, kv_bytes_per_page, pages_for, resolve_geometry
from kvforge.contract.errors import KvforgeError


def geometry(**overrides):
    args = dict(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=4, tokens_per_page=16,
                max_kv_pool_pages=0, max_position_embeddings=4096)
    args.update(overrides)
    return resolve_geometry(**args)


@pytest.mark.parametrize("capacity, page, batch", [(256, 16, 4), (4096, 128, 4), (100, 16, 3), (1, 128, 1),
                                                    (129, 128, 2), (4096, 1, 1)])
def test_default_pool_is_batch_times_pages_per_sequence(capacity: int, page: int, batch: int) -> None:
    g = geometry(max_input_len=1, max_kv_cache_capacity=capacity, tokens_per_page=page, max_batch_size=batch)
    per_seq = math.ceil(capacity / page)
    assert g.max_pages_per_seq == per_seq == pages_for(capacity, page)
    assert g.minimum_active_pages == batch * per_seq
    assert g.max_kv_pool_pages == batch * per_seq


def test_explicit_pool_at_or_above_minimum_is_kept() -> None:
    assert geometry(max_kv_pool_pages=64).max_kv_pool_pages == 64  # exactly the minimum (4 × 256/16)
    g = geometry(max_kv_pool_pages=1000)
    assert g.max_kv_pool_pages == 1000 and g.minimum_active_pages == 64


def test_builder_config_records_the_resolved_numbers() -> None:
    assert geometry(max_kv_pool_pages=100).to_builder_config() == {
        "max_input_len": 64, "max_kv_cache_capacity": 256, "max_batch_size": 4, "tokens_per_page": 16,
        "max_kv_pool_pages": 100, "max_pages_per_seq": 16, "minimum_active_pages": 64}


def test_largest_pool_allowed() -> None:
    assert geometry(max_kv_pool_pages=MAX_KV_POOL_PAGES).max_kv_pool_pages == INT32_MAX // 2


@pytest.mark.parametrize("overrides, flag, needle", [
    pytest.param({"tokens_per_page": 100}, "--tokensPerPage", "power of two", id="page-100"),
    pytest.param({"tokens_per_page": 0}, "--tokensPerPage", "power of two", id="page-0"),
    pytest.param({"tokens_per_page": -16}, "--tokensPerPage", "power of two", id="page-negative"),
    pytest.param({"max_kv_pool_pages": 63}, "--maxKVPoolPages", "at least 64", id="pool-below-minimum"),
    pytest.param({"max_kv_pool_pages": -1}, "--maxKVPoolPages", "-1", id="pool-negative"),
    pytest.param({"max_kv_pool_pages": MAX_KV_POOL_PAGES + 1}, "--maxKVPoolPages", str(MAX_KV_POOL_PAGES),
                 id="pool-above-int32-half"),
    pytest.param({"max_kv_cache_capacity": 8192}, "--maxKVCacheCapacity", "max_position_embeddings",
                 id="capacity-over-max-positions"),
    pytest.param({"max_kv_cache_capacity": 0}, "--maxKVCacheCapacity", "got 0", id="capacity-0"),
    pytest.param({"max_input_len": 0}, "--maxInputLen", "got 0", id="input-len-0"),
    pytest.param({"max_input_len": 257}, "--maxInputLen", "maxKVCacheCapacity=256", id="input-len-over-capacity"),
    pytest.param({"max_batch_size": 0}, "--maxBatchSize", "got 0", id="batch-0"),
    pytest.param({"max_batch_size": 1025}, "--maxBatchSize", "1025", id="batch-over-1024"),
])
def test_errors_name_their_flag(overrides: dict, flag: str, needle: str) -> None:
    with pytest.raises(KvforgeError) as info:
        geometry(**overrides)
    assert info.value.field == flag
    assert str(info.value).startswith(f"{flag}: ")
    assert needle in info.value.message
    assert "\n" not in str(info.value)


def test_default_pool_above_int32_half_is_refused() -> None:
    # Huge batch × capacity / 1-token pages: the *resolved* default pool must still fit int32 page ids.
    with pytest.raises(KvforgeError) as info:
        geometry(max_batch_size=1024, max_kv_cache_capacity=2**21, max_position_embeddings=2**21,
                 tokens_per_page=1, max_input_len=1)
    assert info.value.field == "--maxKVPoolPages"


@pytest.mark.parametrize("dtype, itemsize", [("fp32", 4), ("fp16", 2), ("fp8", 1)])
def test_kv_bytes_per_page(dtype: str, itemsize: int) -> None:
    # K and V, each kv_heads × tokens × head_dim elements.
    assert kv_bytes_per_page(2, 16, 16, dtype) == 2 * 2 * 16 * 16 * itemsize
    assert kv_bytes_per_page(3, 64, 128, dtype) == 2 * 3 * 128 * 64 * itemsize


def test_kv_bytes_per_page_scales_with_dtype() -> None:
    sizes = [kv_bytes_per_page(2, 64, 128, d) for d in ("fp8", "fp16", "fp32")]
    assert sizes == [32768, 65536, 131072]
