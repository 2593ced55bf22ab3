"""The page geometry of an engine, resolved and validated once by llm_build and read back by the runtime."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.paging import pages_for

INT32_MAX = 2**31 - 1
MAX_KV_POOL_PAGES = INT32_MAX // 2  # K and V page ids (and 2 * pages in kernels) must fit in int32
# 16-token pages: a shared prefix reuses to a 16-token block by default, as vLLM's blocks (issue 51 item 3); decode
# cost measured in docs/benchmarks.md "Page size". llm_build, llm_bench and llm_serve MODEL all build with it.
DEFAULT_TOKENS_PER_PAGE = 16
MAX_TOKENS_PER_PAGE = 2**16


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """How an engine's KV cache is paged; every number is resolved (no 0 = "default" left)."""

    max_input_len: int  # max new tokens of one sequence in one engine call (a prefill chunk)
    max_kv_cache_capacity: int  # max tokens of one sequence: prompt + generated
    max_batch_size: int  # max sequences in one engine call
    tokens_per_page: int  # tokens per KV page, a power of two
    max_kv_pool_pages: int  # physical pages in each layer's pool; at least max_pages_per_seq
    max_pages_per_seq: int  # ceil(max_kv_cache_capacity / tokens_per_page): the kv_page_table row width

    @property
    def full_batch_pages(self) -> int:
        """Pages that let a full batch run at full capacity at once: the default pool size."""
        return self.max_batch_size * self.max_pages_per_seq


def resolve_geometry(*, max_input_len: int, max_kv_cache_capacity: int, max_batch_size: int,
                     tokens_per_page: int, max_kv_pool_pages: int, max_position_embeddings: int) -> PageGeometry:
    """Validate the requested numbers; a pool of 0 pages means `full_batch_pages`.

    A pool only has to hold one sequence at full capacity: with fewer than `full_batch_pages` pages, rows wait or
    are preempted while the pool is full. Errors are `InvalidConfig` whose field is the setting's name.
    """
    if not 0 < max_batch_size <= 1024:
        raise InvalidConfig(f"must be in [1, 1024], got {max_batch_size}", "max_batch_size")
    if tokens_per_page <= 0 or tokens_per_page & (tokens_per_page - 1) or tokens_per_page > MAX_TOKENS_PER_PAGE:
        raise InvalidConfig(f"must be a power of two in [1, {MAX_TOKENS_PER_PAGE}], got {tokens_per_page}",
                            "tokens_per_page")
    largest_capacity = (INT32_MAX // tokens_per_page) * tokens_per_page
    if not 0 < max_kv_cache_capacity <= largest_capacity:
        raise InvalidConfig(f"must be in [1, {largest_capacity}], got {max_kv_cache_capacity}",
                            "max_kv_cache_capacity")
    if max_kv_cache_capacity > max_position_embeddings:
        raise InvalidConfig(f"{max_kv_cache_capacity} exceeds the model's max_position_embeddings "
                            f"({max_position_embeddings})", "max_kv_cache_capacity")
    if not 0 < max_input_len <= max_kv_cache_capacity:
        raise InvalidConfig(f"must be in [1, maxKVCacheCapacity={max_kv_cache_capacity}], got {max_input_len}",
                            "max_input_len")
    pages_per_seq = pages_for(max_kv_cache_capacity, tokens_per_page)
    full_batch = max_batch_size * pages_per_seq
    if max_kv_pool_pages < 0:
        raise InvalidConfig(f"must be 0 (batch × pages per sequence = {full_batch}) or at least {pages_per_seq}, "
                            f"got {max_kv_pool_pages}", "max_kv_pool_pages")
    resolved = max_kv_pool_pages or full_batch
    if resolved < pages_per_seq:
        raise InvalidConfig(f"{resolved} pages cannot hold one sequence of {max_kv_cache_capacity} tokens "
                            f"({pages_per_seq} pages of {tokens_per_page}); use 0 or at least {pages_per_seq}",
                            "max_kv_pool_pages")
    if resolved > MAX_KV_POOL_PAGES:
        raise InvalidConfig(f"must be at most {MAX_KV_POOL_PAGES} (int32 page ids), got {resolved}",
                            "max_kv_pool_pages")
    return PageGeometry(max_input_len, max_kv_cache_capacity, max_batch_size, tokens_per_page, resolved,
                        pages_per_seq)


def kv_bytes_per_page(num_kv_heads: int, head_dim: int, tokens_per_page: int, kv_cache_dtype: str) -> int:
    """Bytes of one page (K and V) in one layer."""
    itemsize = {"fp32": 4, "fp16": 2, "fp8": 1}[kv_cache_dtype]
    return 2 * num_kv_heads * tokens_per_page * head_dim * itemsize


def partial_kv_bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, tokens_per_page: int,
                              kv_cache_dtype: str) -> int:
    """Bytes of one partial-KV snapshot slot: one whole K+V page per attention layer (TensorRT Edge-LLM's
    `partialKvBytesPerSlot`); only the tail's tokens matter, but a page-sized slot is one contiguous copy."""
    return num_layers * kv_bytes_per_page(num_kv_heads, head_dim, tokens_per_page, kv_cache_dtype)


def recurrent_bytes_per_slot(num_recurrent_layers: int, num_heads: int, head_dim: int, state_size: int,
                             conv_dim: int, conv_kernel: int) -> int:
    """Bytes of one recurrent snapshot slot: every recurrent layer's state [H, P, N] and conv state
    [conv_dim, K-1], both fp32 (TensorRT Edge-LLM's `recurrentBytesPerSlot`, with the conv's K-1 live columns)."""
    return num_recurrent_layers * 4 * (num_heads * head_dim * state_size + conv_dim * (conv_kernel - 1))


def snapshot_slots(budget_bytes: int, bytes_per_slot: int) -> int:
    """Whole slots a byte budget holds (the rest of the budget stays unused)."""
    return budget_bytes // bytes_per_slot if bytes_per_slot > 0 else 0
