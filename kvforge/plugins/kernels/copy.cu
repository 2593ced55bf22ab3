// Snapshot copies between one page of a layer's pool and a contiguous slot with the same per-page
// layout [2 (K, V), num_kv_heads, tokens_per_page, head_dim].
//
// Only the first num_tokens tokens of each (K|V, head) block are copied: a partial tail page snapshot
// moves its valid rows and nothing else. Elements are opaque bytes (FP16: 2, FP8: 1), moved 16 bytes at
// a time, which needs head_dim * elem_bytes % 16 == 0 (checked on the host) and 16-byte-aligned bases.
// grid = (ceil(tokens_per_page * head_dim * elem_bytes / 16 / 256), 2 * num_kv_heads), block = 256.
#include "common.cuh"

namespace kvf {

__device__ __forceinline__ void copy_page_rows(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                               i64 src_block, i64 dst_block, int tokens_per_page,
                                               int head_dim, int elem_bytes, int num_tokens) {
    const int row_vecs = head_dim * elem_bytes / 16;  // 16-byte vectors per token row
    const i64 block_vecs = (i64)tokens_per_page * row_vecs;  // one (K|V, head) block of the page
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)min(num_tokens, tokens_per_page) * row_vecs) return;
    const i64 kv_head = blockIdx.y;  // 0 .. 2 * num_kv_heads - 1
    dst[dst_block + kv_head * block_vecs + idx] = src[src_block + kv_head * block_vecs + idx];
}

}  // namespace kvf

// pool -> slot
extern "C" __global__ void __launch_bounds__(256)
    kvforge_copy_page_to_slot(const uint4* __restrict__ pool, uint4* __restrict__ slot, int page,
                              int num_kv_heads, int tokens_per_page, int head_dim, int elem_bytes, int num_tokens) {
    const kvf::i64 page_vecs = 2ll * num_kv_heads * tokens_per_page * (head_dim * elem_bytes / 16);
    kvf::copy_page_rows(pool, slot, (kvf::i64)page * page_vecs, 0, tokens_per_page, head_dim,
                        elem_bytes, num_tokens);
}

// slot -> pool
extern "C" __global__ void __launch_bounds__(256)
    kvforge_copy_slot_to_page(const uint4* __restrict__ slot, uint4* __restrict__ pool, int page,
                              int num_kv_heads, int tokens_per_page, int head_dim, int elem_bytes, int num_tokens) {
    const kvf::i64 page_vecs = 2ll * num_kv_heads * tokens_per_page * (head_dim * elem_bytes / 16);
    kvf::copy_page_rows(slot, pool, 0, (kvf::i64)page * page_vecs, tokens_per_page, head_dim,
                        elem_bytes, num_tokens);
}
