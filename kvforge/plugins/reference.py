"""Numpy reference semantics of the paged-KV ops: the definition every backend is tested against."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kvforge.contract.paging import pages_for
from kvforge.contract.rope import rope_table as rope_table  # re-exported: the backends and tests read it here
from kvforge.plugins.ops import UNUSED_PAGE

STORAGE_DTYPES: dict[str, np.dtype] = {
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
}


def pool_numpy_dtype(kv_cache_dtype: str) -> np.dtype:
    """The numpy dtype a pool is held in: FP8 pools travel as raw uint8 bytes (E4M3 bit patterns)."""
    return np.dtype(np.uint8) if kv_cache_dtype == "fp8" else STORAGE_DTYPES[kv_cache_dtype]


FP8_E4M3_MAX = 448.0


def _saturate(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    # E4M3 stores saturate to +-448 like ONNX Cast(saturate=1) and PTX cvt.satfinite; ml_dtypes alone
    # would turn values above 464 into NaN.
    return np.clip(x, -FP8_E4M3_MAX, FP8_E4M3_MAX) if kv_cache_dtype == "fp8" else x


def to_storage(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """Encode float values as the pool stores them."""
    stored = _saturate(x, kv_cache_dtype).astype(STORAGE_DTYPES[kv_cache_dtype])
    return stored.view(np.uint8) if kv_cache_dtype == "fp8" else stored


def from_storage(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    if kv_cache_dtype == "fp8":
        x = x.view(ml_dtypes.float8_e4m3fn)
    return x.astype(np.float32)


def round_to_storage(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """The value a float takes after a trip through the pool (what attention reads back)."""
    return _saturate(x, kv_cache_dtype).astype(STORAGE_DTYPES[kv_cache_dtype]).astype(np.float32)


def apply_rope(x: np.ndarray, cos_sin: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [..., n, heads, D] at positions [..., n]; a table narrower than D ([capacity, R])
    rotates the first R dims of each head and passes the rest (partial rotary)."""
    rotary = cos_sin.shape[-1]
    half = rotary // 2
    cos = cos_sin[positions, :half][..., None, :]
    sin = cos_sin[positions, half:][..., None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary], x[..., rotary:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1).astype(np.float32)


def rotate_keys(stored_k: np.ndarray, delta: int, cos_sin: np.ndarray, kv_cache_dtype: str,
                rotary_dim: int | None = None) -> np.ndarray:
    """Keys [..., D] as the pool stores them, computed at position p, moved to p + delta: RoPE rotations compose,
    so this is one more rotate-half rotation by `delta` (the angles of `cos_sin` row |delta|; a negative delta
    rotates back). Decoded, the first `rotary_dim` dims rotated (the table's width, as in `apply_rope`: partial
    rotary passes the rest unchanged), encoded again; values come back in the storage dtype. Exact up to the
    storage's rounding, since the table has no rope scaling."""
    rotary = cos_sin.shape[-1]
    # A table is built for its rotary dims (rope_table(capacity, rotary_dim, theta)): its frequencies are theirs.
    if rotary_dim is not None and rotary_dim != rotary:
        raise ValueError(f"rotary_dim {rotary_dim} does not match the rope table, built for {rotary} dims")
    if rotary % 2 or rotary > stored_k.shape[-1]:
        raise ValueError(f"the rope table's {rotary} dims must be even and fit the head's {stored_k.shape[-1]}")
    if abs(delta) >= cos_sin.shape[0]:
        raise ValueError(f"a move of {delta} positions is past the rope table's {cos_sin.shape[0]} rows")
    half = rotary // 2
    cos = cos_sin[abs(delta), :half]
    sin = cos_sin[abs(delta), half:] * (1 if delta >= 0 else -1)  # rotating back: sin(-a) = -sin(a)
    k = from_storage(stored_k, kv_cache_dtype)
    x1, x2, rest = k[..., :half], k[..., half:rotary], k[..., rotary:]
    rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return to_storage(rotated, kv_cache_dtype)


def paged_kv_write(key: np.ndarray, value: np.ndarray, cos_sin: np.ndarray, context_lengths: np.ndarray,
                   kvcache_start_index: np.ndarray, kv_page_table: np.ndarray, pool: np.ndarray, *,
                   num_kv_heads: int, head_dim: int, kv_cache_dtype: str) -> np.ndarray:
    """PagedKVWrite: returns the updated pool (a copy; backends update in place)."""
    pool = pool.copy()
    tokens_per_page = pool.shape[3]
    for b in range(key.shape[0]):
        for i in range(int(context_lengths[b])):
            pos = int(kvcache_start_index[b]) + i
            page = int(kv_page_table[b, pos // tokens_per_page])
            if page == UNUSED_PAGE:
                continue
            k = key[b, i].reshape(num_kv_heads, head_dim)
            k = apply_rope(k[None], cos_sin, np.array([pos]))[0]
            v = value[b, i].reshape(num_kv_heads, head_dim)
            pool[page, 0, :, pos % tokens_per_page, :] = to_storage(k, kv_cache_dtype)
            pool[page, 1, :, pos % tokens_per_page, :] = to_storage(v, kv_cache_dtype)
    return pool


def gather_sequence_kv(pool: np.ndarray, page_row: np.ndarray, num_tokens: int,
                       kv_cache_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """K and V [heads, num_tokens, D] of one sequence, read through its page-table row."""
    keys, values, _ = _paged_kv(pool, page_row, num_tokens, kv_cache_dtype)
    return keys, values


def _paged_kv(pool: np.ndarray, page_row: np.ndarray, num_tokens: int,
              kv_cache_dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """K, V [heads, num_tokens, D] float32 and which positions have a page: a -1 entry, or one past the row's
    width, leaves its positions unread (zeros) and invisible."""
    tokens_per_page = pool.shape[3]
    num_pages = pages_for(num_tokens, tokens_per_page)
    row = np.full(num_pages, UNUSED_PAGE, dtype=np.int64)
    width = min(num_pages, len(page_row))
    row[:width] = page_row[:width]
    has_page = row != UNUSED_PAGE
    pages = np.zeros((num_pages, *pool.shape[1:]), dtype=np.float32)
    pages[has_page] = from_storage(pool[row[has_page]], kv_cache_dtype)
    kv = pages.transpose(1, 2, 0, 3, 4).reshape(2, pool.shape[2], num_pages * tokens_per_page, pool.shape[4])
    valid = np.repeat(has_page, tokens_per_page)[:num_tokens]
    return kv[0, :, :num_tokens], kv[1, :, :num_tokens], valid


def _new_visibility(length: int, mask: np.ndarray | None) -> np.ndarray:
    """[length, length]: which new tokens each new query sees (the tree mask, or causal when absent)."""
    if mask is not None:
        return np.asarray(mask[:length, :length], dtype=bool)
    return np.arange(length)[None, :] <= np.arange(length)[:, None]


def _window(visible: np.ndarray, start: int, sliding_window: int) -> np.ndarray:
    """`visible` [L, C] (C = start + L key positions) narrowed to a sliding window: query i, at position start + i,
    sees the keys at positions start + i - sliding_window + 1 and later (0 = no window)."""
    if not sliding_window:
        return visible
    length, keys = visible.shape
    first = start + np.arange(length)[:, None] - sliding_window + 1
    return visible & (np.arange(keys)[None, :] >= first)


def _attend(query: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray, *, num_kv_heads: int,
            head_dim: int, scale: float) -> np.ndarray:
    """The one softmax of both forms: queries [L, Hq*D] over keys/values [Hkv, C, D] where visible [L, C];
    q head h reads kv head h // group; a query that sees nothing gets zeros."""
    length = query.shape[0]
    probs = _probabilities(query, keys, visible, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale)
    attn = np.einsum("hgst,htd->shgd", probs, values.astype(np.float64))
    return attn.reshape(length, -1)


def _probabilities(query: np.ndarray, keys: np.ndarray, visible: np.ndarray, *, num_kv_heads: int, head_dim: int,
                   scale: float) -> np.ndarray:
    """The softmax [Hkv, group, L, C] of queries [L, Hq*D] over keys [Hkv, C, D] where visible [L, C] (float64)."""
    length = query.shape[0]
    group = query.shape[1] // (num_kv_heads * head_dim)
    q = query.reshape(length, num_kv_heads, group, head_dim).astype(np.float64)
    scores = np.einsum("shgd,htd->hgst", q, keys.astype(np.float64)) * scale
    scores = np.where(visible, scores, -np.inf)
    peak = scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores - np.where(np.isfinite(peak), peak, 0.0))
    total = probs.sum(axis=-1, keepdims=True)
    return np.divide(probs, total, out=np.zeros_like(probs), where=total > 0)


def paged_attention(query: np.ndarray, pool: np.ndarray, context_lengths: np.ndarray,
                    kvcache_start_index: np.ndarray, kv_page_table: np.ndarray, *, num_q_heads: int,
                    num_kv_heads: int, head_dim: int, scale: float, kv_cache_dtype: str,
                    attention_mask: np.ndarray | None = None, sliding_window: int = 0) -> np.ndarray:
    """PagedAttention over a pool that already holds the new tokens: query i of row b sees the cached positions
    0..start-1 and the new ones per `attention_mask` [B,S,S] (bottom-right causal when None), only the last
    `sliding_window` positions up to its own when that is set; positions without a page (-1, or past the table's
    width) are invisible."""
    batch, seq = query.shape[:2]
    out = np.zeros((batch, seq, num_q_heads * head_dim), dtype=np.float32)
    for b in range(batch):
        start, length = int(kvcache_start_index[b]), int(context_lengths[b])
        if length == 0:
            continue
        keys, values, valid = _paged_kv(pool, kv_page_table[b], start + length, kv_cache_dtype)
        mask = None if attention_mask is None else attention_mask[b]
        visible = np.concatenate([np.ones((length, start), dtype=bool), _new_visibility(length, mask)], axis=1)
        visible = _window(visible & valid[None, :], start, sliding_window)
        out[b, :length] = _attend(query[b, :length], keys, values, visible,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale)
    return out


def paged_attention_rows(query: np.ndarray, new_kv: np.ndarray, pool: np.ndarray, kv_page_table: np.ndarray,
                         kvcache_start_index: np.ndarray, context_lengths: np.ndarray, *, num_q_heads: int,
                         num_kv_heads: int, head_dim: int, scale: float, kv_cache_dtype: str,
                         attention_mask: np.ndarray | None = None, sliding_window: int = 0) -> np.ndarray:
    """kvforge.cpu.PagedAttention (the lowered form): the pool holds only the cached positions 0..start-1 and
    this call's keys/values come as new_kv [B,S,2,Hkv,D] (float32, already rounded through the storage dtype);
    `sliding_window` as in paged_attention."""
    batch, seq = query.shape[:2]
    out = np.zeros((batch, seq, num_q_heads * head_dim), dtype=np.float32)
    for b in range(batch):
        start, length = int(kvcache_start_index[b]), int(context_lengths[b])
        if length == 0:
            continue
        cached_k, cached_v, valid = _paged_kv(pool, kv_page_table[b], start, kv_cache_dtype)
        new = new_kv[b, :length].astype(np.float32).transpose(1, 2, 0, 3)  # [2, Hkv, length, D]
        keys = np.concatenate([cached_k, new[0]], axis=1)
        values = np.concatenate([cached_v, new[1]], axis=1)
        mask = None if attention_mask is None else attention_mask[b]
        visible = np.concatenate([np.broadcast_to(valid, (length, start)), _new_visibility(length, mask)], axis=1)
        visible = _window(visible, start, sliding_window)
        out[b, :length] = _attend(query[b, :length], keys, values, visible, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, scale=scale)
    return out


def paged_attention_rope(query: np.ndarray, key: np.ndarray, value: np.ndarray, pool: np.ndarray,
                         kv_page_table: np.ndarray, kvcache_start_index: np.ndarray, context_lengths: np.ndarray,
                         cos_sin: np.ndarray, *, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                         kv_cache_dtype: str, position_ids: np.ndarray | None = None,
                         attention_mask: np.ndarray | None = None,
                         sliding_window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """kvforge.cpu.PagedAttentionRope: (attention output, the pool after the call's write). Query and key
    [B,S,H*D] arrive un-rotated and rotate at `position_ids` [B,S] (start + i when None, clamped to the table);
    the new rows, rounded through the storage dtype, go to positions start..start+len-1 through the page table
    (-1 or missing pages skip the write) and attention is paged_attention_rows over them."""
    batch, seq = query.shape[:2]
    starts = np.asarray(kvcache_start_index, dtype=np.int64)
    positions = (starts[:, None] + np.arange(seq)[None, :]) if position_ids is None else position_ids
    positions = np.clip(np.asarray(positions, dtype=np.int64), 0, len(cos_sin) - 1)
    q = apply_rope(query.reshape(batch, seq, num_q_heads, head_dim), cos_sin, positions)
    k = apply_rope(key.reshape(batch, seq, num_kv_heads, head_dim), cos_sin, positions)
    v = value.reshape(batch, seq, num_kv_heads, head_dim).astype(np.float32)
    new_kv = round_to_storage(np.stack([k, v], axis=2), kv_cache_dtype)  # [B, S, 2, Hkv, D]
    out = paged_attention_rows(q.reshape(batch, seq, -1), new_kv, pool, kv_page_table, kvcache_start_index,
                               context_lengths, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, scale=scale, kv_cache_dtype=kv_cache_dtype,
                               attention_mask=attention_mask, sliding_window=sliding_window)
    written = pool.copy()
    tokens_per_page = pool.shape[3]
    for b in range(batch):
        for i in range(int(context_lengths[b])):
            at = int(starts[b]) + i
            index = at // tokens_per_page
            page = int(kv_page_table[b, index]) if index < kv_page_table.shape[1] else UNUSED_PAGE
            if page != UNUSED_PAGE:
                written[page, :, :, at % tokens_per_page, :] = to_storage(new_kv[b, i], kv_cache_dtype)
    return out, written


def attention_mass(query: np.ndarray, key: np.ndarray, pool: np.ndarray, kv_page_table: np.ndarray,
                   kvcache_start_index: np.ndarray, context_lengths: np.ndarray, cos_sin: np.ndarray,
                   query_from: np.ndarray, positions: int, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   scale: float, kv_cache_dtype: str, position_ids: np.ndarray | None = None,
                   attention_mask: np.ndarray | None = None, sliding_window: int = 0) -> np.ndarray:
    """PagedAttentionRope's attention-mass output (issue 53; kernel: cpu/attention_mass.cc) for one call, [B,
    positions]: for row b, the softmax probabilities its query rows at positions >= query_from[b] give each key
    position (below `positions`), summed over query heads. `pool` is the pool before the call; the inputs are
    paged_attention_rope's (values do not enter the probabilities). The kernel adds this into a watch's buffer
    on every layer's call."""
    batch, seq = query.shape[:2]
    starts = np.asarray(kvcache_start_index, dtype=np.int64)
    rotary_at = (starts[:, None] + np.arange(seq)[None, :]) if position_ids is None else position_ids
    rotary_at = np.clip(np.asarray(rotary_at, dtype=np.int64), 0, len(cos_sin) - 1)
    q = apply_rope(query.reshape(batch, seq, num_q_heads, head_dim), cos_sin, rotary_at).reshape(batch, seq, -1)
    k = round_to_storage(apply_rope(key.reshape(batch, seq, num_kv_heads, head_dim), cos_sin, rotary_at),
                         kv_cache_dtype)
    mass = np.zeros((batch, positions), dtype=np.float64)
    for b in range(batch):
        start, length = int(starts[b]), int(context_lengths[b])
        first = max(int(query_from[b]) - start, 0)
        if first >= length:
            continue
        cached_k, _, valid = _paged_kv(pool, kv_page_table[b], start, kv_cache_dtype)
        keys = np.concatenate([cached_k, k[b, :length].transpose(1, 0, 2)], axis=1)
        mask = None if attention_mask is None else attention_mask[b]
        visible = np.concatenate([np.broadcast_to(valid, (length, start)), _new_visibility(length, mask)], axis=1)
        visible = _window(visible, start, sliding_window)
        probs = _probabilities(q[b, first:length], keys, visible[first:], num_kv_heads=num_kv_heads,
                               head_dim=head_dim, scale=scale)
        summed = probs.sum(axis=(0, 1, 2))
        upto = min(positions, len(summed))
        mass[b, :upto] = summed[:upto]
    return mass.astype(np.float32)


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even, as VCVTNE2PS2BF16), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def quantize_int16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The int16 decode rows' activations (MatMulBlocks on AVX2, 4-bit blocks, up to 16 rows): per block of 32,
    xq = round-half-even(x * float32(32767 / max |x|)) and the scale max |x| / 32767, both in float32."""
    x = a.astype(np.float32).reshape(*a.shape[:-1], -1, 32)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(32767) / amax, np.float32(0)).astype(np.float32)
    return np.rint(x * inverse).astype(np.int16), (amax / np.float32(32767)).astype(np.float32)


def matmul_blocks(a: np.ndarray, blocks: np.ndarray, bf16: bool = False, int16: bool = False) -> np.ndarray:
    """CPU_MATMUL_BLOCKS in float64: A [..., K] @ W, where W[k, n] = scale * q + min of k's block b = k // 32 of
    column n; blocks uint8 [N, K/32, 24] (4 bits: 16 bytes of values, byte j: element j low, element j + 16 high) or
    [N, K/32, 40] (8 bits: 32 bytes, one a value), then the block's scale and min as little-endian float32.
    `bf16`: the many-row bfloat16 path (attribute bf16, more than 16 rows, AVX512_BF16): A and the float32 weights
    (scale * q + min, rounded once) each rounded to bfloat16 before the products.
    `int16`: AVX2's int16 decode rows (4 bits): scale * dx * sum(q * xq) + min * sum(x) per block (quantize_int16)."""
    n, count, width = blocks.shape
    stored = blocks[..., :width - 8]
    if width == 24:
        values = np.concatenate([stored & 0xF, stored >> 4], axis=-1).astype(np.float64)
    else:
        values = stored.astype(np.float64)
    floats = np.ascontiguousarray(blocks[..., width - 8:]).view("<f4").astype(np.float64)  # [N, K/32, 2]
    w = values * floats[..., :1] + floats[..., 1:]
    if int16:
        xq, dx = quantize_int16(a)  # [..., K/32, 32], [..., K/32, 1]
        sums = np.einsum("...bi,nbi->...nb", xq.astype(np.float64), values)  # exact integers
        scaled = sums * dx[..., 0].astype(np.float64)[..., None, :] * floats[..., 0]
        mins = a.astype(np.float32).reshape(xq.shape).astype(np.float64).sum(-1)[..., None, :] * floats[..., 1]
        return (scaled + mins).sum(-1)
    if bf16:
        a, w = to_bfloat16(a), to_bfloat16(w.astype(np.float32))
    return a.astype(np.float64) @ w.reshape(n, count * 32).astype(np.float64).T


def swiglu(x: np.ndarray) -> np.ndarray:
    """CPU_SWIGLU in float64: silu(gate) * up for X [..., 2I] = [gate | up]."""
    gate, up = np.split(x.astype(np.float64), 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up
