"""Schemas of the paged-KV custom ops (domain `kvforge`) that export writes and backends lower."""

from __future__ import annotations

from dataclasses import dataclass

DOMAIN = "kvforge"
OPSET_VERSION = 1
UNUSED_PAGE = -1  # page-table sentinel, as in TensorRT Edge-LLM

# Pool layout, one tensor per attention layer: [num_pages, 2 (K, V), num_kv_heads, tokens_per_page, head_dim].
# A page is contiguous (page <-> snapshot copies are one memcpy) and head-major inside, which gathers a
# sequence's pages into [heads, tokens, dim] without a per-token shuffle on the CPU.
POOL_AXES = ("num_pages", "kv", "num_kv_heads", "tokens_per_page", "head_dim")


@dataclass(frozen=True, slots=True)
class OpSchema:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]
    doc: str


# RoPE is rotate-half; `rope_rotary_cos_sin` is [capacity, R]: cos of the R/2 frequencies, then their sin, with
# R = head_dim, or the optional attribute `rotary_dim` (partial rotary: the first R dims of each head rotate, the
# rest pass; absent or 0 = head_dim). Positions are kvcache_start_index[b] + i for the i-th new token of row b.
PAGED_KV_WRITE = OpSchema(
    name="PagedKVWrite",
    inputs=("key", "value", "rope_rotary_cos_sin", "context_lengths", "kvcache_start_index",
            "kv_page_table", "past_key_values"),
    outputs=("present_key_values",),
    attributes=("num_kv_heads", "head_dim", "tokens_per_page"),
    doc="Rotates the new keys [B,S,Hkv*D] and writes them and the values [B,S,Hkv*D] into the pages "
        "of each row at positions start..start+len-1. Rows past context_lengths[b] and -1 pages are "
        "skipped. present_key_values aliases past_key_values (in place on the GPU).",
)

PAGED_ATTENTION = OpSchema(
    name="PagedAttention",
    inputs=("query", "present_key_values", "context_lengths", "kvcache_start_index", "kv_page_table"),
    outputs=("attention_output",),
    attributes=("num_q_heads", "num_kv_heads", "head_dim", "tokens_per_page", "scale"),
    doc="Grouped-query attention of the rotated queries [B,S,Hq*D] over the cached and new keys of each "
        "row with bottom-right causal alignment: query i sees positions 0..start+i. Serves chunked "
        "prefill (S>1 over cached pages) and decode (S=1). Output rows past context_lengths[b] are 0.",
)

SCHEMAS = {s.name: s for s in (PAGED_KV_WRITE, PAGED_ATTENTION)}
