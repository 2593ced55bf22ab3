"""The sliding-window page group's sizes: which pools hold only a window, and how many pages that group needs."""

from __future__ import annotations

from kvforge.contract.geometry import PageGeometry, kv_bytes_per_page
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.paging import PageGroup, pages_for

# The graph input the sliding layers read their pages through (the global layers keep kv_page_table): a row's
# logical pages, -1 where a page fell wholly out of the window and went back to the group.
WINDOW_PAGE_TABLE = "kv_page_table_window"
WINDOW_GROUP = "window"  # the sliding layers' page group (its cache type: context_cache/types/sliding_window.py)


def window_pool_layers(model: ModelConfig) -> list[int]:
    """The engine's own pools (past_key_values_{i}) that sliding layers write and read (a layer reading another's
    pool has that layer's type)."""
    sliding = set(model.sliding_window_layers)
    return [i for i in model.attention_layer_ids if i in sliding]


def page_groups(model: ModelConfig, window_pool_pages: int) -> tuple[PageGroup, ...]:
    """The engine's page groups beside the global one: the sliding layers' when it was built with one. A third
    group (chunked-local attention, say) is one more entry here and the cache type that fills its tables."""
    if not window_pool_pages:
        return ()
    return (PageGroup(WINDOW_GROUP, tuple(window_pool_layers(model)), window_pool_pages, WINDOW_PAGE_TABLE),)


def window_pages_per_row(window: int, tokens_per_page: int, call_tokens: int, max_pages_per_seq: int) -> int:
    """The most pages of the group one row holds at once. A row keeps the window before the last page boundary at
    or before its position c (what a checkpoint there needs: `checkpoint_pages`), then the pages of a call of up to
    `call_tokens` new tokens from c: at most ceil((W - 1) / T) + ceil((T - 1 + n) / T) pages; pages wholly before
    that are back in the group. Never more than the row has logical pages."""
    return min(checkpoint_pages(window, tokens_per_page) + pages_for(tokens_per_page - 1 + call_tokens,
                                                                     tokens_per_page), max_pages_per_seq)


def checkpoint_pages(window: int, tokens_per_page: int) -> int:
    """Pages a window checkpoint at a page boundary P keeps: the sliding layers' keys [P - W + 1, P), which the
    first position after a hit at P attends over (besides its own)."""
    return pages_for(window - 1, tokens_per_page)


def window_call_tokens(window: int, tokens_per_page: int, max_input_len: int) -> int:
    """The most new tokens one engine call gives a row on an engine with a sliding-window group: the window rounded
    up to whole pages (the runtime's prefill chunks are cut to it), so that a prefilling row holds about two
    windows of pages, not a whole maxInputLen."""
    return min(max_input_len, pages_for(window, tokens_per_page) * tokens_per_page)


def window_pool_pages(model: ModelConfig, geometry: PageGeometry, records: int = 0) -> int:
    """Pages of the sliding-window group: every row of a full batch at its worst (at least one row's worth), plus
    `records` window checkpoints kept for reuse beyond what idle rows leave free."""
    per_call = window_call_tokens(model.sliding_window, geometry.tokens_per_page, geometry.max_input_len)
    per_row = window_pages_per_row(model.sliding_window, geometry.tokens_per_page, per_call,
                                   geometry.max_pages_per_seq)
    rows = max(min(geometry.max_batch_size * per_row, geometry.max_kv_pool_pages), per_row)
    return rows + records * checkpoint_pages(model.sliding_window, geometry.tokens_per_page)


def layer_page_bytes(model: ModelConfig, tokens_per_page: int) -> dict[int, int]:
    """Bytes of one K+V page of each of the engine's own pools, by layer id: each layer's heads are its own size
    (Gemma 4's global layers may be wider, ModelConfig.layer_head_dim)."""
    return {i: kv_bytes_per_page(model.num_key_value_heads, model.layer_head_dim(i), tokens_per_page,
                                 model.kv_cache_dtype) for i in model.attention_layer_ids}


def pool_bytes_by_layer_type(model: ModelConfig, geometry: PageGeometry, window_pages: int) -> tuple[int, int]:
    """(global layers' KV pool bytes, sliding layers' KV pool bytes); sliding layers count as global when the engine
    has no window group (`window_pages` 0: each keeps a full-length pool)."""
    windowed = set(window_pool_layers(model)) if window_pages else set()
    per_page = layer_page_bytes(model, geometry.tokens_per_page)
    return (sum(b for i, b in per_page.items() if i not in windowed) * geometry.max_kv_pool_pages,
            sum(b for i, b in per_page.items() if i in windowed) * window_pages)
