// PagedAttention, tiled for chunked prefill (any seq_len; the decode kernel in decode.cu is faster at 1).
//
// A block owns 32 query rows of one (sequence, kv head); a row is a (token, group member) pair, so the
// GQA group shares every K/V tile the block loads. Keys are walked in tiles of 32 straight from the
// pages (converted to float32 in shared memory), with an fp32 online softmax in the log2 domain. The
// causal limit of row (token i) is start + i (bottom-right alignment), read from device memory, so the
// launch depends on shapes only.
//
// Thread layout (128 threads): ty = tid / 16 owns rows 4*ty .. 4*ty+3 in both phases, so the softmax
// state (max, sum, rescale) never leaves the thread; tx = tid % 16 owns key columns tx and tx + 16 for
// the scores and dims 4*tx + 64*c .. +3 of the output. Row reductions are shuffles inside 16 lanes.
// grid = (ceil(seq_len * group / 32), num_kv_heads, batch), block = 128, static shared memory only
// (<= 38 KiB, below the 48 KiB a launch gets without an opt-in that AOT plugins cannot make).
#include "common.cuh"

namespace kvf {

constexpr int kTileRows = 32;
constexpr int kTileKeys = 32;
constexpr int kTileThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;

// Fill kv_s[key][dim] (float, row stride kStride) with K (kv = 0) or V (kv = 1) of keys
// key0 .. key0 + 31; keys at or past key_end (or on a -1 page) read as zeros so that 0 * garbage never
// makes a NaN.
template <int D, class S, int kStride>
__device__ __forceinline__ void load_kv_tile(float* kv_s, const typename S::T* __restrict__ pool,
                                             const int* __restrict__ page_row, int kv, int head, int num_kv_heads,
                                             int tokens_per_page, int shift, int key0, int key_end) {
    constexpr int kChunks = D / S::kElems;  // 16-byte chunks per key row
    for (int c = threadIdx.x; c < kTileKeys * kChunks; c += kTileThreads) {
        const int j = c / kChunks;
        const int q = c - j * kChunks;
        const int pos = key0 + j;
        float vals[S::kElems];
        int page = -1;
        if (pos < key_end) page = page_row[pos >> shift];
        if (page >= 0) {
            const typename S::T* src = pool + pool_offset(page, kv, head, num_kv_heads, tokens_per_page, D) +
                                       (i64)(pos & (tokens_per_page - 1)) * D + q * S::kElems;
            S::unpack16(load16(src), vals);
        } else {
#pragma unroll
            for (int e = 0; e < S::kElems; ++e) vals[e] = 0.0f;
        }
        float4* dst = reinterpret_cast<float4*>(kv_s + j * kStride + q * S::kElems);
#pragma unroll
        for (int e = 0; e < S::kElems / 4; ++e)
            dst[e] = make_float4(vals[4 * e], vals[4 * e + 1], vals[4 * e + 2], vals[4 * e + 3]);
    }
}

template <int D, class S>
__device__ __forceinline__ void paged_attention_tiled(const float* __restrict__ query,
                                                      const typename S::T* __restrict__ pool,
                                                      const int* __restrict__ context_lengths,
                                                      const int* __restrict__ start_index,
                                                      const int* __restrict__ page_table, float* __restrict__ out,
                                                      int seq_len, int num_q_heads, int num_kv_heads,
                                                      int tokens_per_page, int pages_per_seq, int scale_bits) {
    // Row stride D + 4 floats: the 8 lanes of a 128-bit shared access read 8 different rows and land on
    // 8 different 16-byte bank groups.
    constexpr int kStride = D + 4;
    constexpr int kPStride = kTileKeys + 4;
    constexpr int kDimsPerThread = D / 16;  // output dims per thread: float4 groups at 4*tx + 64*c
    constexpr int kDimGroups = D / 64;
    __shared__ __align__(16) float q_s[kTileRows * kStride];
    __shared__ __align__(16) float kv_s[kTileKeys * kStride];
    __shared__ __align__(16) float p_s[kTileRows * kPStride];

    const int tid = threadIdx.x;
    const int ty = tid >> 4;
    const int tx = tid & 15;
    const int head = blockIdx.y;
    const int b = blockIdx.z;
    const int group = num_q_heads / num_kv_heads;
    const int total_rows = seq_len * group;
    const int row0 = blockIdx.x * kTileRows;
    const int len = context_lengths[b];
    const int start = start_index[b];
    const int* page_row = page_table + (i64)b * pages_per_seq;
    const int shift = log2_pow2(tokens_per_page);

    // Rows past context_lengths[b] are written as zeros; a tile with none left does only that.
    const int last_row = min(row0 + kTileRows, total_rows) - 1;
    const int first_token = row0 / group;
    if (first_token >= len) {
        for (int f = tid; f < kTileRows * D; f += kTileThreads) {
            const int r = f / D, d = f - r * D;
            const int row = row0 + r;
            if (row > last_row) continue;
            const int i = row / group, g = row - i * group;
            out[(((i64)b * seq_len + i) * num_q_heads + head * group + g) * D + d] = 0.0f;
        }
        return;
    }
    const int last_token = min(last_row / group, len - 1);
    // Keys this tile can see: 0 .. key_end - 1, never past the page-table row (malformed lengths must not
    // read beyond it; the keys past it simply do not exist).
    const int key_end = (int)min64((i64)start + last_token + 1, (i64)pages_per_seq << shift);

    // Queries, pre-scaled into the log2 domain (scale * log2(e)) so the softmax uses exp2.
    const float qscale = __int_as_float(scale_bits) * kLog2e;
    for (int f = tid; f < kTileRows * (D / 4); f += kTileThreads) {
        const int r = f / (D / 4), c4 = f - r * (D / 4);
        const int row = row0 + r;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row <= last_row) {
            const int i = row / group, g = row - i * group;
            if (i < len) {
                v = reinterpret_cast<const float4*>(
                    query + (((i64)b * seq_len + i) * num_q_heads + head * group + g) * D)[c4];
                v.x *= qscale; v.y *= qscale; v.z *= qscale; v.w *= qscale;
            }
        }
        reinterpret_cast<float4*>(q_s + r * kStride)[c4] = v;
    }

    // Causal limit per owned row: the last key position it may see, -1 for rows with nothing to do.
    int limit[4];
    float row_max[4], row_sum[4];
    float acc[4][kDimsPerThread];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = row0 + ty * 4 + r;
        const int i = row / group;
        limit[r] = (row <= last_row && i < len) ? start + i : -1;
        row_max[r] = neg_inf();
        row_sum[r] = 0.0f;
#pragma unroll
        for (int d = 0; d < kDimsPerThread; ++d) acc[r][d] = 0.0f;
    }

    for (int key0 = 0; key0 < key_end; key0 += kTileKeys) {
        load_kv_tile<D, S, kStride>(kv_s, pool, page_row, 0, head, num_kv_heads, tokens_per_page, shift, key0,
                                    key_end);
        __syncthreads();  // K tile (and, first time round, the queries) visible

        float score[4][2];
#pragma unroll
        for (int r = 0; r < 4; ++r) score[r][0] = score[r][1] = 0.0f;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            const float4 k0 = *reinterpret_cast<const float4*>(kv_s + tx * kStride + d);
            const float4 k1 = *reinterpret_cast<const float4*>(kv_s + (tx + 16) * kStride + d);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const float4 q = *reinterpret_cast<const float4*>(q_s + (ty * 4 + r) * kStride + d);
                score[r][0] += q.x * k0.x + q.y * k0.y + q.z * k0.z + q.w * k0.w;
                score[r][1] += q.x * k1.x + q.y * k1.y + q.z * k1.z + q.w * k1.w;
            }
        }

        // Online softmax: new running max, rescale what was accumulated, probabilities to shared memory.
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const float s0 = (key0 + tx <= limit[r]) ? score[r][0] : neg_inf();
            const float s1 = (key0 + tx + 16 <= limit[r]) ? score[r][1] : neg_inf();
            float tile_max = fmaxf(s0, s1);
#pragma unroll
            for (int off = 8; off > 0; off >>= 1)
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
            const float new_max = fmaxf(row_max[r], tile_max);
            // A row that has seen nothing yet keeps max -inf; subtracting 0 instead avoids inf - inf.
            const float base = (new_max == neg_inf()) ? 0.0f : new_max;
            const float correction = exp2f(row_max[r] - base);
            const float p0 = exp2f(s0 - base);
            const float p1 = exp2f(s1 - base);
            // Each lane keeps a partial sum of its own columns; the row total is reduced once at the end.
            row_sum[r] = row_sum[r] * correction + p0 + p1;
            row_max[r] = new_max;
#pragma unroll
            for (int d = 0; d < kDimsPerThread; ++d) acc[r][d] *= correction;
            p_s[(ty * 4 + r) * kPStride + tx] = p0;
            p_s[(ty * 4 + r) * kPStride + tx + 16] = p1;
        }
        __syncthreads();  // scores done with the K tile; probabilities complete

        load_kv_tile<D, S, kStride>(kv_s, pool, page_row, 1, head, num_kv_heads, tokens_per_page, shift, key0,
                                    key_end);
        __syncthreads();  // V tile visible

#pragma unroll 2
        for (int j = 0; j < kTileKeys; j += 4) {
            float4 p[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) p[r] = *reinterpret_cast<const float4*>(p_s + (ty * 4 + r) * kPStride + j);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
                for (int c = 0; c < kDimGroups; ++c) {
                    const float4 v = *reinterpret_cast<const float4*>(kv_s + (j + jj) * kStride + c * 64 + tx * 4);
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const float pr = jj == 0 ? p[r].x : jj == 1 ? p[r].y : jj == 2 ? p[r].z : p[r].w;
                        acc[r][c * 4 + 0] += pr * v.x;
                        acc[r][c * 4 + 1] += pr * v.y;
                        acc[r][c * 4 + 2] += pr * v.z;
                        acc[r][c * 4 + 3] += pr * v.w;
                    }
                }
            }
        }
        __syncthreads();  // V tile and probabilities consumed before the next tile overwrites them
    }

#pragma unroll
    for (int r = 0; r < 4; ++r) {
        float total = row_sum[r];
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
        const int row = row0 + ty * 4 + r;
        if (row > last_row) continue;
        const int i = row / group, g = row - i * group;
        const bool live = limit[r] >= 0;
        const float inv = live ? 1.0f / total : 0.0f;
        float* dst = out + (((i64)b * seq_len + i) * num_q_heads + head * group + g) * D;
#pragma unroll
        for (int c = 0; c < kDimGroups; ++c) {
            const float4 v = live ? make_float4(acc[r][c * 4] * inv, acc[r][c * 4 + 1] * inv,
                                                acc[r][c * 4 + 2] * inv, acc[r][c * 4 + 3] * inv)
                                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            reinterpret_cast<float4*>(dst + c * 64)[tx] = v;
        }
    }
}

}  // namespace kvf

// Parameter order is TensorRT AOT plugins': input pointers, the int32 scalars, then the output pointer.
#define KVF_ATTENTION_ENTRY(NAME, D, STORAGE)                                                                   \
    extern "C" __global__ void __launch_bounds__(kvf::kTileThreads)                                              \
        NAME(const float* __restrict__ query, const STORAGE::T* __restrict__ pool,                               \
             const int* __restrict__ context_lengths, const int* __restrict__ start_index,                       \
             const int* __restrict__ page_table, int seq_len, int num_q_heads, int num_kv_heads,                 \
             int tokens_per_page, int pages_per_seq, int scale_bits, float* __restrict__ out) {                  \
        kvf::paged_attention_tiled<D, STORAGE>(query, pool, context_lengths, start_index, page_table, out,      \
                                               seq_len, num_q_heads, num_kv_heads, tokens_per_page,              \
                                               pages_per_seq, scale_bits);                                       \
    }

KVF_ATTENTION_ENTRY(kvforge_paged_attention_fp16_d64, 64, kvf::Fp16)
KVF_ATTENTION_ENTRY(kvforge_paged_attention_fp16_d128, 128, kvf::Fp16)
KVF_ATTENTION_ENTRY(kvforge_paged_attention_fp8_d64, 64, kvf::Fp8)
KVF_ATTENTION_ENTRY(kvforge_paged_attention_fp8_d128, 128, kvf::Fp8)
