// PagedKVWrite: rotate the new keys (rotate-half RoPE from the cos/sin table) and store K and V in pages.
//
// One thread per (token, kv head, rotation pair j): it owns dims j and j + head_dim/2 of K and V, so the
// rotation needs no exchange and a warp's stores are contiguous along head_dim.
// grid = (ceil(seq_len * num_kv_heads * head_dim / 2 / 256), batch), block = 256.
#include "common.cuh"

namespace kvf {

template <class S>
__device__ __forceinline__ void paged_kv_write(const float* __restrict__ key, const float* __restrict__ value,
                                               const float* __restrict__ cos_sin,
                                               const int* __restrict__ context_lengths,
                                               const int* __restrict__ start_index,
                                               const int* __restrict__ page_table, typename S::T* __restrict__ pool,
                                               int seq_len, int num_kv_heads, int head_dim, int tokens_per_page,
                                               int pages_per_seq, int capacity) {
    const int b = blockIdx.y;
    const int half = head_dim >> 1;
    const i64 per_token = (i64)num_kv_heads * half;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= per_token * seq_len) return;
    const int i = (int)(idx / per_token);
    const int rem = (int)(idx - (i64)i * per_token);
    const int h = rem / half;
    const int j = rem - h * half;
    if (i >= context_lengths[b]) return;  // padding rows of a shorter sequence
    const int pos = start_index[b] + i;
    if (pos < 0 || pos >= capacity) return;  // outside the rope table: nothing defined to write
    const int shift = log2_pow2(tokens_per_page);
    const int slot = pos >> shift;
    if (slot >= pages_per_seq) return;
    const int page = page_table[(i64)b * pages_per_seq + slot];
    if (page < 0) return;  // -1: unused page, the write is skipped

    const i64 src = (((i64)b * seq_len + i) * num_kv_heads + h) * head_dim;
    const float* cs = cos_sin + (i64)pos * head_dim;
    const float c = cs[j], s = cs[half + j];
    const float k1 = key[src + j], k2 = key[src + half + j];
    // Explicit _rn intrinsics: no FMA contraction, so the rotated key is bit-identical to numpy's
    // float32 `x1 * cos - x2 * sin` and the stored FP16/E4M3 bytes match the reference exactly.
    const float r1 = __fsub_rn(__fmul_rn(k1, c), __fmul_rn(k2, s));
    const float r2 = __fadd_rn(__fmul_rn(k2, c), __fmul_rn(k1, s));

    const i64 dst_k = pool_offset(page, 0, h, num_kv_heads, tokens_per_page, head_dim) +
                      (i64)(pos & (tokens_per_page - 1)) * head_dim;
    const i64 dst_v = dst_k + (i64)num_kv_heads * tokens_per_page * head_dim;
    pool[dst_k + j] = S::encode(r1);
    pool[dst_k + half + j] = S::encode(r2);
    pool[dst_v + j] = S::encode(value[src + j]);
    pool[dst_v + half + j] = S::encode(value[src + half + j]);
}

}  // namespace kvf

// Parameter order: input pointers (the pool is the past_key_values input, updated in place), then the
// int32 scalars; TensorRT passes the aliased present_key_values pointer after them, which is not declared.
#define KVF_KV_WRITE_ENTRY(NAME, STORAGE)                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        NAME(const float* __restrict__ key, const float* __restrict__ value, const float* __restrict__ cos_sin, \
             const int* __restrict__ context_lengths, const int* __restrict__ start_index,                      \
             const int* __restrict__ page_table, STORAGE::T* __restrict__ pool, int seq_len, int num_kv_heads,  \
             int head_dim, int tokens_per_page, int pages_per_seq, int capacity) {                              \
        kvf::paged_kv_write<STORAGE>(key, value, cos_sin, context_lengths, start_index, page_table, pool,      \
                                     seq_len, num_kv_heads, head_dim, tokens_per_page, pages_per_seq,          \
                                     capacity);                                                                 \
    }

KVF_KV_WRITE_ENTRY(kvforge_paged_kv_write_fp16, kvf::Fp16)
KVF_KV_WRITE_ENTRY(kvforge_paged_kv_write_fp8, kvf::Fp8)
