"""Page geometry and pool sizing: the numbers llm_build validates, resolves and records."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvforge.contract.errors import KvforgeError
from kvforge.contract.paging import pages_for

INT32_MAX = 2**31 - 1
MAX_KV_POOL_PAGES = INT32_MAX // 2  # K and V page ids (and 2 * pages in kernels) must fit in int32
DEFAULT_TOKENS_PER_PAGE = 128


@dataclass(frozen=True, slots=True)
class BuildGeometry:
    max_input_len: int
    max_kv_cache_capacity: int
    max_batch_size: int
    tokens_per_page: int
    max_kv_pool_pages: int  # resolved
    max_pages_per_seq: int
    minimum_active_pages: int

    def to_builder_config(self) -> dict[str, int]:
        return asdict(self)


def resolve_geometry(*, max_input_len: int, max_kv_cache_capacity: int, max_batch_size: int,
                     tokens_per_page: int, max_kv_pool_pages: int, max_position_embeddings: int) -> BuildGeometry:
    """Validate the build flags; 0 pool pages means exactly the active minimum."""
    if not 0 < max_batch_size <= 1024:
        raise KvforgeError(f"must be in [1, 1024], got {max_batch_size}", "--maxBatchSize")
    if tokens_per_page <= 0 or tokens_per_page & (tokens_per_page - 1):
        raise KvforgeError(f"must be a positive power of two, got {tokens_per_page}", "--tokensPerPage")
    if not 0 < max_kv_cache_capacity <= (INT32_MAX // tokens_per_page) * tokens_per_page:
        raise KvforgeError(f"must be in [1, {(INT32_MAX // tokens_per_page) * tokens_per_page}], "
                           f"got {max_kv_cache_capacity}", "--maxKVCacheCapacity")
    if max_kv_cache_capacity > max_position_embeddings:
        raise KvforgeError(f"{max_kv_cache_capacity} exceeds the model's max_position_embeddings "
                           f"({max_position_embeddings})", "--maxKVCacheCapacity")
    if not 0 < max_input_len <= max_kv_cache_capacity:
        raise KvforgeError(f"must be in [1, maxKVCacheCapacity={max_kv_cache_capacity}], got {max_input_len}",
                           "--maxInputLen")
    pages_per_seq = pages_for(max_kv_cache_capacity, tokens_per_page)
    minimum = max_batch_size * pages_per_seq
    if max_kv_pool_pages < 0:
        raise KvforgeError(f"must be 0 (the minimum, {minimum}) or at least {minimum}, got {max_kv_pool_pages}",
                           "--maxKVPoolPages")
    resolved = max_kv_pool_pages or minimum
    if resolved < minimum:
        raise KvforgeError(f"{resolved} pages cannot hold {max_batch_size} sequences of {max_kv_cache_capacity} "
                           f"tokens; use 0 or at least {minimum}", "--maxKVPoolPages")
    if resolved > MAX_KV_POOL_PAGES:
        raise KvforgeError(f"must be at most {MAX_KV_POOL_PAGES} (int32 page ids), got {resolved}",
                           "--maxKVPoolPages")
    return BuildGeometry(max_input_len, max_kv_cache_capacity, max_batch_size, tokens_per_page, resolved,
                         pages_per_seq, minimum)


def kv_bytes_per_page(num_kv_heads: int, head_dim: int, tokens_per_page: int, kv_cache_dtype: str) -> int:
    """Bytes of one page (K and V) in one layer."""
    itemsize = {"fp32": 4, "fp16": 2, "fp8": 1}[kv_cache_dtype]
    return 2 * num_kv_heads * tokens_per_page * head_dim * itemsize
