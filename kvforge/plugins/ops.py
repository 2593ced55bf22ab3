"""Schemas of the paged-KV custom ops: the export-level ops (domain `kvforge`) and the CPU kernel's lowered op."""

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
        "prefill (S>1 over cached pages) and decode (S=1). Output rows past context_lengths[b] are 0. Optional "
        "attribute sliding_window W (Gemma's local layers; absent or 0 = none): query at position p sees only "
        "positions p-W+1..p.",
)

SCHEMAS = {s.name: s for s in (PAGED_KV_WRITE, PAGED_ATTENTION)}

# The ONNX Runtime CPU custom-op library (kvforge/plugins/cpu/, built by kvforge/plugins/cpu_kernel.py) registers this
# domain.
CPU_DOMAIN = "kvforge.cpu"
CPU_EXECUTION_PROVIDER = "CPUExecutionProvider"

CPU_PAGED_ATTENTION = OpSchema(
    name="PagedAttention",
    inputs=("query", "new_kv", "pool", "kv_page_table", "kvcache_start_index", "context_lengths",
            "attention_mask"),
    outputs=("attention_output",),
    attributes=("num_q_heads", "num_kv_heads", "head_dim", "tokens_per_page", "scale"),
    doc="Attention that reads the layer's pool in place through the page table (no gather, cast or copy). "
        "query [B,S,Hq*D] float32, RoPE applied; new_kv [B,S,2,Hkv,D] float32: this call's rotated keys and "
        "values, already rounded through the storage dtype; pool [num_pages,2,Hkv,T,D] float16, uint8 (FP8 "
        "E4M3 bit patterns) or float32, the element type choosing the decoding; kv_page_table [B,W] int32 "
        "covering the cached positions only (W may be 0 or short: missing pages count as -1); "
        "kvcache_start_index [B] int32 (positions 0..start-1 are in the pool); context_lengths [B] int32 "
        "(new tokens per row, <= S, right-padded); optional attention_mask [B,S,S] bool (query i sees new key "
        "j iff mask[b,i,j]; absent or empty ([B,0,0]) = causal j <= i, a tree mask for speculative verification). "
        "Cached position p is page table[b, p // T], slot p % T, visible to every query unless its page is -1 or "
        "beyond W. GQA: q head h reads kv head h // (Hq/Hkv). Output [B,S,Hq*D] float32, rows past "
        "context_lengths[b] (and queries that see nothing) are 0; fp32 online softmax. head_dim must be a "
        "multiple of 16 up to 512. Optional attribute sliding_window as PAGED_ATTENTION's. "
        "Semantics: reference.paged_attention_rows.",
)

CPU_PAGED_ATTENTION_ROPE = OpSchema(
    name="PagedAttentionRope",
    inputs=("query", "key", "value", "pool", "kv_page_table", "kvcache_start_index", "context_lengths",
            "rope_rotary_cos_sin", "position_ids", "attention_mask"),
    outputs=("attention_output",),
    attributes=("num_q_heads", "num_kv_heads", "head_dim", "tokens_per_page", "scale", "packed_qkv"),
    doc="PagedAttention with RoPE and the K/V write inside: query [B,S,Hq*D], key and value [B,S,Hkv*D] float32, "
        "un-rotated (packed_qkv = 1, absent 0: query is the packed projection [B,S,(Hq+2Hkv)*D], each token's q "
        "then k then v, and key and value are that same tensor again); rope_rotary_cos_sin [capacity, R] (R even, "
        "<= head_dim: partial rotary rotates each head's first R dims); optional position_ids [B,S] int32 (a tree's "
        "RoPE positions; absent or empty = start + i), clamped to the table. The rotated keys and the values are "
        "rounded through the pool's storage dtype and written IN PLACE into `pool` (the input is aliased: ONNX "
        "Runtime has no in-place input, so the runtime binds its own pool memory and reads the write back there) at "
        "positions start..start+len-1 through kv_page_table, which here covers those positions too (-1 or missing "
        "pages: not written). Attention is then CPU_PAGED_ATTENTION's over the cached positions and the rounded new "
        "rows. No new_key_values output. Semantics: reference.paged_attention_rope.",
)

CPU_MATMUL_BLOCKS = OpSchema(
    name="MatMulBlocks",
    inputs=("A", "blocks"),
    outputs=("Y",),
    attributes=("K", "N", "bits", "bf16"),
    doc="Y [..., N] = A [..., K] @ W for 4- or 8-bit weights in blocks of 32 along K: W[k, n] = scale * q + min of "
        "column n's block b = k // 32. bits 4 (the default when absent): blocks uint8 [N, K/32, 24], per block 16 "
        "bytes of values (byte j: element j in the low nibble, element j + 16 in the high one); bits 8: [N, K/32, "
        "40], 32 bytes, one a value; then scale and min as little-endian float32 "
        "(kvforge/builder/lower_matmul.pack_blocks). "
        "A GGUF Q4_1 block as it is, Q4_0 with min = -8 * scale, Q8_0 with min = -128 * scale over q + 128. Up to "
        "16 rows of A (any row count for 8 bits), each output element is summed in one fixed order whatever the row "
        "count (a verification row equals its decode row bit for bit); more rows of a 4-bit weight dequantize W once "
        "and run ONNX Runtime's Gemm, or with bf16 = 1 (absent: 0) on a CPU with AVX512_BF16 round A and W to "
        "bfloat16 and sum their products in float32 (VDPBF16PS). Semantics: reference.matmul_blocks.",
)


CPU_SWIGLU = OpSchema(
    name="SwiGLU",
    inputs=("X",),
    outputs=("Y",),
    attributes=(),
    doc="Y [..., I] = silu(X[..., :I]) * X[..., I:] for X [..., 2I] (a gated MLP's packed gate/up projection), "
        "silu(g) = g * sigmoid(g), computed (g * sigmoid(g)) * u element by element, so a row's result does not "
        "depend on the row count. Semantics: reference.swiglu.",
)
